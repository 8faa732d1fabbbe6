"""The local dispatcher's fused (Triton) combine against its torch reference path: the
kernels run on CPU under the Triton interpreter; on a GPU at a realistic size, without
host synchronisation and without an FP32 [T*k, D] temporary."""

import sys
from pathlib import Path

import pytest
import torch
from moe_model import LocalDispatcher, _triton_support, use_reference_kernels
from moe_model.dispatch import (
    combine_backward,
    combine_backward_reference,
    weighted_gather_sum,
    weighted_gather_sum_reference,
)
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_fused_kernels_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_combine_interpret_check.py"))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_cpu_path_needs_no_triton(monkeypatch, capacity_factor):
    monkeypatch.setitem(sys.modules, "triton", None)  # any `import triton` now fails
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.rand(6, 2, requires_grad=True)
    disp = LocalDispatcher(3, capacity_factor)
    rows, _, h = disp.dispatch(x, torch.tensor([[0, 1]] * 5 + [[2, 0]]))
    disp.combine(rows * 2.0, w, h).sum().backward()
    assert x.grad is not None and w.grad is not None


def _gpu_inputs(T, k, D, E, capacity_factor):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=g)
    if capacity_factor is not None:  # favour low expert ids: drops and underfilled experts
        logits += torch.linspace(1.5, 0.0, E, device="cuda")
    logits[:, -1] = -float("inf")  # the last expert gets no tokens
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    x = torch.randn(T, D, device="cuda", generator=g, dtype=torch.bfloat16)
    dy = torch.randn(T, D, device="cuda", generator=g, dtype=torch.bfloat16)
    return x, ids, weights, dy


def _step(disp, x, ids, weights, dy):
    """dispatch -> a cheap stand-in for the experts -> combine, and the gradients of
    ``x``, the routing weights and the expert outputs (``d bias = d rows_out``)."""
    x, weights = x.detach().requires_grad_(), weights.detach().requires_grad_()
    rows, _, h = disp.dispatch(x, ids)
    scale = torch.linspace(0.5, 1.5, rows.shape[0], device="cuda", dtype=rows.dtype)[:, None]
    bias = torch.ones_like(rows).mul_(0.25).requires_grad_()
    y = disp.combine(rows * scale + bias, weights, h)
    return (y, *torch.autograd.grad(y, (x, weights, bias), dy)), h


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_fused_combine_matches_torch_on_gpu(monkeypatch, capacity_factor):
    T, k, D, E = 8192, 8, 2048, 64
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # an FP32 reference bmm
    x, ids, weights, dy = _gpu_inputs(T, k, D, E, capacity_factor)
    disp = LocalDispatcher(E, capacity_factor)
    (y, dx, dw, d_rows), h = _step(disp, x, ids, weights, dy)
    with use_reference_kernels(True):
        (ry, rdx, rdw, rd_rows), _ = _step(disp, x, ids, weights, dy)
    if capacity_factor is not None:
        assert (h.kept_of_slot == 0).any() and not h.valid_rows.all()
        assert (d_rows[~h.valid_rows] == 0).all()
    torch.testing.assert_close(y, ry)  # BF16 tolerances: the FP32 sums differ in order only
    torch.testing.assert_close(dx, rdx)
    torch.testing.assert_close(dw, rdw, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(d_rows, rd_rows, rtol=0, atol=0)  # one FP32 product, rounded once

    # memory: the forward and backward allocate y, d_rows and d_w and no [T*k, D] FP32 temporary
    rows, _, h = disp.dispatch(x, ids)
    rows_out = rows.detach().requires_grad_()
    w = weights.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    y = disp.combine(rows_out, w, h)
    torch.autograd.grad(y, (rows_out, w), dy)
    expected = (T * D + rows_out.numel()) * rows_out.element_size() + T * k * 4
    assert torch.cuda.max_memory_allocated() - base <= expected + 16 * 2**20


@pytest.mark.gpu
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_fused_dispatch_combine_has_no_host_sync(capacity_factor):
    x, ids, weights, dy = _gpu_inputs(8192, 8, 2048, 64, capacity_factor)
    disp = LocalDispatcher(64, capacity_factor)
    assert_no_host_sync(lambda: _step(disp, x, ids, weights, dy))


def _routed(capacity_factor, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    T, k, E, D = 7, 2, 4, 12
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    x = torch.randn(T, D, generator=g).to(dtype)
    _, _, h = LocalDispatcher(E, capacity_factor).dispatch(x, ids)
    return g, ids, h, T, k, D


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
@pytest.mark.parametrize("weighted", [False, True])
def test_weighted_gather_sum_backends(capacity_factor, weighted):
    _, _, h, T, k, D = _routed(capacity_factor)

    def make():
        rows = torch.randn(h.token_of_row.shape[0], D, generator=torch.Generator().manual_seed(1))
        weights = torch.rand(T * k, generator=torch.Generator().manual_seed(2)).requires_grad_() if weighted else None
        return rows.bfloat16().requires_grad_(), h.row_of_slot, T, weights, h.kept_of_slot

    check_backend_api(_triton_support, weighted_gather_sum, weighted_gather_sum_reference, make)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_combine_backward_backends(capacity_factor):
    g, _, h, T, k, D = _routed(capacity_factor)
    R = h.token_of_row.shape[0]
    w_S = torch.rand(T * k, generator=g)
    if h.kept_of_slot is not None:
        w_S = w_S * h.kept_of_slot
    dy, rows_out = torch.randn(T, D, generator=g).bfloat16(), torch.randn(R, D, generator=g).bfloat16()
    check_backend_api(_triton_support, combine_backward, combine_backward_reference, lambda: (dy, rows_out, w_S, h))
