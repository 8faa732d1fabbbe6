"""The sm_100 native path: scale layout against torchao, call arguments via a stand-in GEMM.

No block-scaled tensor cores here: these tests check what we hand to
``torch._scaled_mm`` (operand layouts, swizzled scales) by replacing it with an
emulator that reads those arguments the way cuBLAS documents. The real GEMM is
checked by the sm_100-only GPU test in test_gpu.py.
"""

import moe_mxfp8.linear
import pytest
import torch
from moe_mxfp8 import MXFP8Linear, dequantize
from moe_mxfp8.gemm import swizzle_scales
from torch import nn

utils = pytest.importorskip("torchao.prototype.mx_formats.utils")


@pytest.mark.parametrize("shape", [(128, 4), (200, 7), (1, 1), (256, 64)])
def test_swizzle_matches_torchao_to_blocked(shape):
    s = torch.randint(0, 255, shape, dtype=torch.uint8)
    assert torch.equal(swizzle_scales(s), utils.to_blocked(s))


def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """Block-scaled GEMM as cuBLAS documents it: a [M,K] row-major, b [K,N] column-major."""
    M, K = a.shape
    N = b.shape[1]
    assert b.t().is_contiguous()
    sa = utils.from_blocked(scale_a.view(torch.uint8), M, K // 32).view(torch.float8_e8m0fnu)
    sb = utils.from_blocked(scale_b.view(torch.uint8), N, K // 32).view(torch.float8_e8m0fnu)
    a_f = dequantize(a, sa.contiguous(), 1, dtype=torch.float32)
    b_f = dequantize(b.t().contiguous(), sb.contiguous(), 1, dtype=torch.float32)
    return (a_f @ b_f.t()).to(out_dtype)


def test_native_linear_hands_cublas_the_documented_layouts(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    monkeypatch.setattr(moe_mxfp8.linear, "native_mx_available", lambda device: True)
    lin = nn.Linear(64, 96, bias=False)
    native, emulated = (MXFP8Linear.from_module(lin, gemm=g) for g in ("native", "emulated"))
    x = torch.randn(40, 64, requires_grad=True)
    dy = torch.randn(40, 96)
    grads = []
    for layer in (native, emulated):
        x.grad = lin.weight.grad = None
        y = layer(x)
        y.backward(dy)
        grads.append((y.detach(), x.grad.clone(), lin.weight.grad.clone()))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="divisible by 32"):
        MXFP8Linear(nn.Parameter(torch.randn(40, 64)), gemm="native")

