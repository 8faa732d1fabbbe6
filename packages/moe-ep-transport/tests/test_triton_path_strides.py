"""Combine on the Triton path takes expert outputs and routing weights of any strides.

The kernels address rows as ``ptr + i * width``; a column slice of a wider expert
output or weights like ``w[:, ::2]`` once gave wrong sums and weight gradients there
while the CPU reference was right. Each rank runs the CUDA code path on CPU tensors:
``ops.resolve_backend`` answers Triton for every ``backend`` the dispatcher passes
("auto") and the kernels run under ``TRITON_INTERPRET=1`` (set in
the rank's own process before the kernels are imported, so nothing leaks).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

# Not importorskip: the ranks load this module too, and triton must not be imported there
# before TRITON_INTERPRET is set.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import all_gather_objects, assert_close, experts, make_data, oracle  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, make_transport, ops  # noqa: E402

E, K, D = 4, 2, 8


def _strided_rows_out_and_weights(combine: str) -> None:
    assert "triton" not in sys.modules  # the variable must precede its import
    os.environ["TRITON_INTERPRET"] = "1"
    ops.resolve_backend = lambda backend, device: True
    rank, M = dist.get_rank(), dist.get_world_size()
    L = E // M
    data = make_data([5, 3], E, K, D, torch.float32, seed=3, skew=1.5)
    cfg = EPConfig(E, K, 6, D, capacity_factor=None, combine=combine)
    # Weights sent along with dispatch only change anything where combine sums at the destination.
    for backend in ("all_to_all", "rowwise"):
        for stage in (False, True) if combine == "destination" else (False,):
            d = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.float32))
            x = data.x[rank].clone().requires_grad_(True)
            W = data.W[rank * L : (rank + 1) * L].clone().requires_grad_(True)
            # The weights every other element of a wider tensor (reshape(-1) of them stays strided).
            w_wide = torch.stack([data.w[rank], torch.full_like(data.w[rank], 1000.0)], 2)
            w_wide = w_wide.reshape(-1, 2 * K).requires_grad_(True)
            w = w_wide[:, ::2]
            rows, offsets, handle = d.dispatch(x, data.ids[rank], w if stage else None)
            out = experts(rows, offsets, W)
            rows_out = torch.cat([out, torch.full_like(out, 1000.0)], 1)[:, :D]  # row stride 2 * D
            assert not rows_out.is_contiguous() and not w.reshape(-1).is_contiguous()
            y = d.combine(rows_out, w, handle)
            (y * data.g[rank]).sum().backward()
            ys, dxs, dws, dW = oracle(data, all_gather_objects(handle.plan.valid_N.view(-1, K)))
            where = f"{backend}, combine at the {combine}, weights sent along: {stage}"
            assert_close(y.detach(), ys[rank], 1e-5, f"{where}: y")
            assert_close(x.grad, dxs[rank], 1e-5, f"{where}: grad x")
            assert_close(w_wide.grad[:, ::2], dws[rank], 1e-5, f"{where}: grad weights")
            assert bool((w_wide.grad[:, 1::2] == 0).all()), where
            assert_close(W.grad, dW[rank * L : (rank + 1) * L], 1e-5, f"{where}: grad experts")
    assert "moe_ep_transport._transport_kernels" in sys.modules  # the Triton path ran


@pytest.mark.interpreter
@pytest.mark.parametrize("combine", ["source", "destination"])
def test_combine_takes_strided_rows_out_and_weights_on_triton_path(combine: str) -> None:
    run_distributed(_strided_rows_out_and_weights, 2, combine, timeout=300)
