"""GPU checks at real sizes: kernels bit-exact vs the torch reference, layers, no host sync."""

import pytest
import torch
from moe_mxfp8 import (
    MXFP8GroupedExperts,
    MXFP8Linear,
    MXFP8RowCodec,
    dequantize,
    native_mx_available,
    quantize,
    quantize_dequantize,
    quantize_rows_and_cols,
)

pytestmark = pytest.mark.gpu


def sample(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda")
    x = x * torch.exp2(torch.randint(-140, 120, (*shape[:-1], 1), generator=g, device="cuda").float())
    flat = x.view(-1)
    flat[:64] = 0.0
    flat[100:110] = torch.randn(10, device="cuda") * 1e-40  # denormals
    flat[200] = float("inf")
    flat[300] = float("nan")
    flat[400:440] = 448.0
    flat[5000:5040] = torch.randn(40, device="cuda") * 1e-39  # a denormal-only block
    return x.to(dtype)


def mismatches(a, b):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    both_nan = a.float().isnan() & b.float().isnan()
    return int(((a.view(as_int) != b.view(as_int)) & ~both_nan).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 3999), (8, 1024, 520)])
def test_kernels_bit_exact_at_real_sizes(dtype, shape):
    x = sample(shape, dtype)
    for axis in range(len(shape)):
        (d, s), (rd, rs) = quantize(x, axis), quantize(x, axis, backend="reference")
        assert mismatches(d, rd) == 0 and mismatches(s, rs) == 0, axis
        for out in (torch.bfloat16, torch.float32):
            assert mismatches(dequantize(rd, rs, axis, dtype=out),
                              dequantize(rd, rs, axis, dtype=out, backend="reference")) == 0
    got, ref = quantize_rows_and_cols(x), quantize_rows_and_cols(x, backend="reference")
    for g, r in zip(got, ref, strict=True):
        assert mismatches(g.data, r.data) == 0 and mismatches(g.scales, r.scales) == 0
    (dq, kq), (dr, kr) = (quantize_dequantize(x, torch.bfloat16, True, backend=b)
                          for b in ("auto", "reference"))
    assert mismatches(dq, dr) == 0 and mismatches(kq.data, kr.data) == 0


def test_codec_on_gpu_round_trips_like_quantize():
    x = sample((4096, 2048), torch.bfloat16)
    codec = MXFP8RowCodec()
    packed = codec.encode(x)
    assert packed.shape == (4096, 2112) and codec.bytes_ratio(2048) <= 0.53
    d, s = quantize(x, backend="reference")
    assert mismatches(codec.decode(packed, torch.bfloat16), dequantize(d, s, backend="reference")) == 0


def _experts(E=8, D=256, F=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(shape, generator=g, device="cuda") * 0.05)
          for shape in ((E, F, D), (E, F, D), (E, D, F))]
    return MXFP8GroupedExperts(*ws)


def test_bf16_tensor_core_gemm_equals_fp32_gemm_of_the_same_operands():
    """The emulation's premise on real tensor cores: BF16 operands are exact, FP32 accumulates."""
    lin = torch.nn.Linear(2048, 1024, bias=False, device="cuda")
    layer = MXFP8Linear.from_module(lin)
    x = torch.randn(4096, 2048, device="cuda").bfloat16()
    y_bf16 = layer(x)  # BF16 GEMM of dequantized operands
    y_fp32 = layer(x.float())  # the same operands (x's BF16 values) in an FP32 GEMM
    assert y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(y_bf16, y_fp32.bfloat16(), rtol=8e-3, atol=1e-5)


def test_grouped_experts_run_forward_and_backward_on_gpu():
    layer = _experts()
    offsets = torch.tensor([100, 100, 250, 300, 512, 600, 700, 1024], dtype=torch.int32,
                           device="cuda")
    rows = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(rows, offsets).float().square().sum().backward()
    assert rows.grad.isfinite().all() and layer.w1.grad.isfinite().all()
    assert layer.w1.grad[1].abs().sum() == 0  # expert 1 received no rows


def test_no_host_sync_in_a_warm_step():
    layer = _experts()
    offsets = torch.tensor([100, 100, 250, 300, 512, 600, 700, 1024], dtype=torch.int32,
                           device="cuda")
    rows = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(rows, offsets).sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(rows, offsets).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not (torch.cuda.is_available() and native_mx_available(torch.device("cuda"))),
                    reason="needs a GPU with block-scaled tensor cores (compute capability 10.x)")
def test_native_linear_matches_emulated_on_sm100():
    lin = torch.nn.Linear(2048, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    outs = []
    for gemm in ("native", "emulated"):
        x.grad = None
        layer = MXFP8Linear.from_module(lin, gemm=gemm)
        y = layer(x)
        y.backward(dy)
        outs.append((y.float(), x.grad.float()))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
