"""QK-norm + RoPE in one kernel each way: under the Triton interpreter on CPU, and on a GPU
at the bench presets' attention shapes against the two kernels it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import _triton_support
from moe_model.layers import qk_norm_rope, qk_norm_rope_reference, rope_tables
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_fused_qk_norm_rope_under_interpreter_matches_the_two_kernels_and_eager():
    run_under_triton_interpreter(Path(__file__).with_name("_qk_norm_rope_interpret_check.py"))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 4])
def test_fused_qk_norm_rope_on_gpu_matches_the_two_kernels_without_host_sync(heads):
    """Query (16 heads) and key (4) shapes of bench-1gpu's microbatch; the output gradient
    as attention's backward hands it over (a transposed view). Out and dx equal RMSNorm's
    kernel followed by RoPE's in nearly every element, bit for bit; the rest are a BF16
    step of the intermediate apart (the mean of squares sums the two halves, so an rstd
    can differ in its last FP32 bit and round one normalised element the other way, which
    the rotation's cancellation can leave large next to a small result); dweight to FP32
    summation order."""
    from moe_model._qk_norm_rope_kernels import QKNormRope
    from moe_model._rms_norm_kernels import rms_norm
    from moe_model._rope_kernels import FusedRope

    dev, bf = torch.device("cuda"), torch.bfloat16
    B, S, Dh = 2, 4096, 128
    g = torch.Generator(device="cuda").manual_seed(heads)
    cos, sin = rope_tables(S, Dh, 1e6, dev)
    x = (torch.randn(B, S, heads, Dh, device=dev, generator=g) * 3).to(bf)
    w = (1 + 0.3 * torch.randn(Dh, device=dev, generator=g)).to(bf)
    dout = torch.randn(B, heads, S, Dh, device=dev, generator=g).to(bf).transpose(1, 2)

    def run(fn):
        x_, w_ = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
        out = fn(x_, w_)
        out.backward(dout)
        return out.detach(), x_.grad, w_.grad

    def fused(x_, w_):
        return QKNormRope.apply(x_, w_, 1e-6, cos, sin)

    def two_kernels(x_, w_):
        return FusedRope.apply(rms_norm(x_, w_, 1e-6).transpose(1, 2), cos, sin).transpose(1, 2)

    assert_no_host_sync(lambda: run(fused), warmup=1)
    for name, a, b in zip(("out", "dx", "dw"), run(fused), run(two_kernels), strict=True):
        scale = b.float().abs().max().item()
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=2**-7 * scale)
        if name != "dw":
            same = (a == b).float().mean().item()
            assert same > 0.99, f"{name}: {same:.4f} of the elements bitwise equal"


def test_qk_norm_rope_backends():
    cos, sin = rope_tables(7, 16, 10000.0, torch.device("cpu"))

    def make():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 7, 3, 16, generator=g).bfloat16().requires_grad_()
        w = (1 + 0.1 * torch.randn(16, generator=g)).bfloat16().requires_grad_()
        return x, w, 1e-6, cos, sin

    check_backend_api(_triton_support, qk_norm_rope, qk_norm_rope_reference, make)
