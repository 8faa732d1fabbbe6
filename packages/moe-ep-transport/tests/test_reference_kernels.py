"""``backend`` and the reference switch on every op of ``ops`` with a Triton kernel:
``"reference"`` and ``"auto"`` on CPU are the public ``<op>_reference``;
``use_reference_kernels(True)`` sends every op to it, ``backend="triton"`` included; another
value is refused by name. (The kernels themselves: test_kernels_interpret.py.)"""

import moe_ep_transport
import pytest
import torch
from moe_ep_transport import ops, use_reference_kernels
from moe_testing import check_backend_api, check_reference_switch


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_ep_transport._triton_support)


def _operands() -> dict:
    g = torch.Generator().manual_seed(0)
    E, M, k, T, D, C = 4, 2, 2, 5, 6, 6
    experts = [torch.randint(0, E, (T * k,), generator=g) for _ in range(M)]
    slots = [ops.rank_slots_reference(e, E) for e in experts]
    counts_ME = torch.stack([s.counts_E for s in slots])
    cells = ops.plan_cells_reference(counts_ME, C, 0, 0)
    return dict(
        E=E, M=M, k=k, T=T, C=C, expert_N=experts[0], slots=slots[0], counts_ME=counts_ME, cells=cells,
        out=torch.randint(0, 9, (9, 3), generator=g, dtype=torch.int32),
        inbox=torch.randint(10, 99, (9, 3), generator=g, dtype=torch.int32),
        row_src=torch.tensor([0, 1, 1, 0, 0, 1, -1, -1, -1]),
        origin=torch.randint(0, 1000, (9,), generator=g),
        rows_ND=torch.randn(T * k, D, generator=g),
        local_CD=torch.randn(C, D, generator=g),
        dst_rank=torch.tensor([0, 1, 1, -1, 0, 0, 1, 1, 0, 1]),
        dst_row=torch.randint(0, C, (T * k,), generator=g),
        w_N=torch.rand(T * k, generator=g),
        g_TD=torch.randn(T, D, generator=g),
        partials=torch.randn(M * T, D, generator=g),
    )


def _receive(o: dict, backend: str | None):
    """``finish_receive`` writes in place: its outputs, from fresh copies."""
    out, origin = o["out"].clone(), torch.zeros(9, dtype=torch.int64)
    args = (out, o["inbox"], o["row_src"], 1, o["origin"], origin)
    if backend is None:
        ops.finish_receive_reference(*args)
    else:
        ops.finish_receive(*args, backend=backend)
    return out, origin


# op name -> (the op called with a backend, its public reference), on the operands above.
OPS = {
    "rank_slots": (lambda o, b: ops.rank_slots(o["expert_N"], o["E"], backend=b),
                   lambda o: ops.rank_slots_reference(o["expert_N"], o["E"])),
    "plan_cells": (lambda o, b: ops.plan_cells(o["counts_ME"], o["C"], 3, 1, backend=b),
                   lambda o: ops.plan_cells_reference(o["counts_ME"], o["C"], 3, 1)),
    "plan_rows": (lambda o, b: ops.plan_rows(o["expert_N"], o["slots"], o["cells"], o["M"], o["C"], backend=b),
                  lambda o: ops.plan_rows_reference(o["expert_N"], o["slots"], o["cells"], o["M"], o["C"])),
    "finish_receive": (_receive, lambda o: _receive(o, None)),
    "topk_gather_sum": (
        lambda o, b: ops.topk_gather_sum(o["rows_ND"], o["local_CD"], o["dst_rank"], o["dst_row"], 1, o["w_N"],
                                         o["k"], torch.bfloat16, True, backend=b),
        lambda o: ops.topk_gather_sum_reference(o["rows_ND"], o["local_CD"], o["dst_rank"], o["dst_row"], 1,
                                                o["w_N"], o["k"], torch.bfloat16, True)),
    "combine_grads": (lambda o, b: ops.combine_grads(o["g_TD"], o["w_N"], o["rows_ND"], torch.bfloat16, True,
                                                     backend=b),
                      lambda o: ops.combine_grads_reference(o["g_TD"], o["w_N"], o["rows_ND"], torch.bfloat16, True)),
    "sum_partials": (lambda o, b: ops.sum_partials(o["partials"], o["dst_rank"], o["M"], o["T"], o["k"],
                                                   torch.bfloat16, backend=b),
                     lambda o: ops.sum_partials_reference(o["partials"], o["dst_rank"], o["M"], o["T"], o["k"],
                                                          torch.bfloat16)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_keeps_the_backend_contract(name):
    op, reference = OPS[name]
    check_backend_api(moe_ep_transport._triton_support, lambda o, backend: op(o, backend), reference,
                      lambda: (_operands(),))


def test_resolve_backend_is_the_one_decision():
    resolve = moe_ep_transport._triton_support.resolve_backend
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not resolve("reference", cuda) and not resolve("auto", cpu)
    assert resolve("auto", cuda) == moe_ep_transport.triton_available()
    with use_reference_kernels(True):
        assert not resolve("triton", cuda) and not resolve("auto", cuda)
