"""The fused RoPE kernel: under the Triton interpreter on CPU, and on a GPU at model size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import _triton_support
from moe_model.layers import apply_rope, apply_rope_reference, rope_tables
from moe_testing import check_backend_api, run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_fused_rope_under_interpreter_matches_eager():
    run_under_triton_interpreter(Path(__file__).with_name("_rope_interpret_check.py"))


@pytest.mark.gpu
def test_fused_rope_on_gpu_is_the_fp32_rotation_rounded_once_without_host_sync():
    from moe_model._rope_kernels import FusedRope

    dev = torch.device("cuda")
    B, S, H, Dh = 2, 4096, 16, 128
    cos, sin = rope_tables(S, Dh, 1e6, dev)
    x = torch.randn(B, S, H, Dh, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    dy = torch.randn(B, H, S, Dh, device=dev, dtype=torch.bfloat16)
    # Oracle: the rotation in FP32 from the same BF16 inputs; the kernel computes in FP32 and
    # rounds once, so it is within half a BF16 step (2^-8 relative) of it (plus FP32 rounding).
    with torch.autocast("cuda", enabled=False):
        x32 = x.detach().float().requires_grad_(True)
        ref = apply_rope_reference(x32, cos, sin)
        (ref_dx,) = torch.autograd.grad(ref, x32, dy.float())
    FusedRope.apply(x, cos, sin)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = FusedRope.apply(x, cos, sin)
        (dx,) = torch.autograd.grad(out, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.dtype == dx.dtype == torch.bfloat16
    half_step = 2.0**-8 + 2.0**-20
    torch.testing.assert_close(out.float(), ref, rtol=half_step, atol=1e-6)
    torch.testing.assert_close(dx.float(), ref_dx, rtol=half_step, atol=1e-6)


def test_apply_rope_backends():
    cos, sin = rope_tables(7, 16, 10000.0, torch.device("cpu"))

    def make():
        x = torch.randn(2, 3, 7, 16, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
        return x, cos, sin

    check_backend_api(_triton_support, apply_rope, apply_rope_reference, make)
