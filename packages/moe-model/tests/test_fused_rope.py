"""The fused RoPE kernel: under the Triton interpreter on CPU, and on a GPU at model size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_testing import run_under_triton_interpreter
from moe_model.layers import apply_rope_reference, rope_tables


def test_fused_rope_under_interpreter_matches_eager():
    run_under_triton_interpreter(Path(__file__).with_name("_rope_interpret_check.py"))


@pytest.mark.gpu
def test_fused_rope_on_gpu_matches_eager_without_host_sync():
    from moe_model._rope_kernels import FusedRope

    dev = torch.device("cuda")
    B, S, H, Dh = 2, 4096, 16, 128
    cos, sin = rope_tables(S, Dh, 1e6, dev)
    x = torch.randn(B, S, H, Dh, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    dy = torch.randn(B, H, S, Dh, device=dev, dtype=torch.bfloat16)
    with torch.autocast("cuda", enabled=False):
        ref = apply_rope_reference(x, cos, sin)
        (ref_dx,) = torch.autograd.grad(ref, x, dy)
    FusedRope.apply(x, cos, sin)  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = FusedRope.apply(x, cos, sin)
        (dx,) = torch.autograd.grad(out, x, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # The eager backward rounds each product to BF16 before adding them; the kernel rounds
    # once: a few elements differ by one BF16 step (2^-6 at magnitudes 2..4).
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-2, atol=2**-6)
