"""Local dispatch: dropless and capacity-limited, gradients, and the fairness of the drop policy."""

from pathlib import Path

import pytest
import torch
from moe_model import (
    GroupedExperts,
    LocalDispatcher,
    ReportsDrops,
    TokenDispatcher,
    _triton_support,
    dispatch,
)
from moe_model.dispatch import dropless_layout, dropless_layout_reference
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


def dense_reference(x, ids, weights, experts, kept=None):
    """sum_j w[t,j] * expert_{ids[t,j]}(x[t]) over kept slots, one token at a time."""
    T, k = ids.shape
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(k):
            if kept is not None and not kept[t, j]:
                continue
            e = ids[t, j]
            h = torch.nn.functional.silu(x[t] @ experts.w1[e].T) * (x[t] @ experts.w3[e].T)
            y[t] = y[t] + weights[t, j] * (h @ experts.w2[e].T)
    return y


def make(T=9, D=6, E=4, k=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    experts = GroupedExperts(E, D, 5, backend="loop").to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.4, generator=g)
    x = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=dtype, requires_grad=True)
    return x, ids, w, experts


def run(disp, x, ids, w, experts):
    rows, offsets, handle = disp.dispatch(x, ids)
    return disp.combine(experts(rows, offsets), w, handle), rows, offsets, handle


def test_protocols():
    assert isinstance(LocalDispatcher(4), TokenDispatcher)
    assert isinstance(LocalDispatcher(4), ReportsDrops)


def test_dropless_matches_dense_mixture_with_gradients():
    x, ids, w, experts = make()
    y, rows, offsets, _ = run(LocalDispatcher(4), x, ids, w, experts)
    assert rows.shape[0] == ids.numel() and offsets[-1].item() == ids.numel()
    ref = dense_reference(x, ids, w, experts)
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, *experts.parameters()), dy)
    want = torch.autograd.grad(ref, (x, w, *experts.parameters()), dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_capacity_drops_are_counted_and_ignored():
    x, ids, w, experts = make(T=12, E=4, k=2, seed=1)
    ids[:, 0] = 0  # everyone's first choice is expert 0: it overflows
    ids[:, 1] = 1 + torch.arange(12) % 3  # second choices: 4 per expert, they fit
    disp = LocalDispatcher(4, capacity_factor=1.0)
    C = disp.capacity(ids.numel())  # ceil(24 / 4) = 6
    y, rows, offsets, handle = run(disp, x, ids, w, experts)
    counts = torch.bincount(ids.flatten(), minlength=4)
    kept_E = counts.clamp(max=C)
    assert torch.equal(disp.dropped_per_expert(handle), counts - kept_E)
    assert offsets.tolist() == kept_E.cumsum(0).tolist()
    assert rows.shape[0] == min(ids.numel(), 4 * C)
    kept = handle.kept_of_slot.view(12, 2).bool()
    assert kept[:, 1].all()  # second choices to the non-full experts all fit
    assert kept[:, 0].sum() == C
    ref = dense_reference(x, ids, w, experts, kept)
    torch.testing.assert_close(y, ref)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, *experts.parameters()), dy)
    want = torch.autograd.grad(ref, (x, w, *experts.parameters()), dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert (got[1].view(-1)[~kept.view(-1)] == 0).all()  # dropped slots get no weight gradient


def test_padding_rows_get_no_gradient_even_when_garbage():
    x, ids, w, experts = make(T=10, E=4, k=2, seed=2)
    ids[:, 0] = 1
    ids[:, 1] = 0
    disp = LocalDispatcher(4, capacity_factor=0.5)
    rows, offsets, handle = disp.dispatch(x, ids)
    valid = int(offsets[-1])
    assert valid < rows.shape[0]
    assert (rows[valid:] == 0).all()
    out = experts(rows, offsets).clone()
    out[valid:] = float("nan")  # a grouped GEMM leaves padding rows unspecified
    y = disp.combine(out, w, handle)
    assert torch.isfinite(y).all()
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


def test_first_choices_win_over_second_choices():
    T, E, k = 16, 4, 2
    ids = torch.stack([torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.long)], 1)
    ids[8:] = ids[8:].flip(1)  # tokens 8.. choose expert 1 first, expert 0 second
    disp = LocalDispatcher(E, capacity_factor=1.0)  # C = 8
    _, _, h = disp.dispatch(torch.randn(T, 3), ids)
    kept = h.kept_of_slot.view(T, k).bool()
    assert kept[:, 0].all() and not kept[:, 1].any()


def test_drop_policy_is_position_and_id_fair():
    """Overflowing experts keep tokens spread over the whole sequence, whatever their id."""
    T, E = 4096, 8
    ids = torch.arange(T)[:, None] % E  # every expert gets T/E first choices
    disp = LocalDispatcher(E, capacity_factor=0.5)  # each keeps half
    _, offsets, h = disp.dispatch(torch.randn(T, 2), ids)
    kept = h.kept_of_slot.bool()
    assert (h.dropped_per_expert == T // E // 2).all()  # high ids are not favoured or punished
    positions = torch.arange(T, dtype=torch.float64)
    mean_kept_position = positions[kept].mean() / T
    assert abs(mean_kept_position - 0.5) < 0.02  # late tokens are not the ones dropped
    first_half = kept[: T // 2].float().mean()
    assert abs(first_half - 0.5) < 0.05


def test_dispatch_is_deterministic():
    x, ids, w, experts = make(T=33, E=4, k=2, seed=3)
    disp = LocalDispatcher(4, capacity_factor=0.75)
    a, b = disp.dispatch(x, ids), disp.dispatch(x, ids)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[2].row_of_slot, b[2].row_of_slot)


@pytest.mark.slow
@pytest.mark.interpreter
def test_counting_sort_layout_under_interpreter_matches_stable_argsort():
    run_under_triton_interpreter(Path(__file__).with_name("_dispatch_interpret_check.py"))


@pytest.mark.gpu
def test_counting_sort_layout_on_gpu_matches_stable_argsort_without_host_sync():
    """bench-1gpu's dispatch (8192 tokens, top-8 of 64 experts) and a skewed one."""
    from moe_model._dispatch_kernels import dropless_layout

    g = torch.Generator(device="cuda").manual_seed(0)
    for ids in (torch.randint(0, 64, (8192, 8), device="cuda", generator=g),
                torch.randint(0, 5, (8192, 8), device="cuda", generator=g)):
        got = {}
        assert_no_host_sync(lambda ids=ids, got=got: got.update(layout=dropless_layout(ids, 64)))
        for a, b in zip(got["layout"], dispatch.dropless_layout_reference(ids, 64), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_dropless_layout_backends():
    ids = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t))[:2] for t in range(7)])
    check_backend_api(_triton_support, dropless_layout, dropless_layout_reference, lambda: (ids, 4))
