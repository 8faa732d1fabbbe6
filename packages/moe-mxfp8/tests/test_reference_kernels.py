"""``backend`` and the reference switch on every op with a Triton kernel: ``"reference"`` and
``"auto"`` on CPU are the public ``<op>_reference``; ``use_reference_kernels(True)`` sends every
op to it, ``backend="triton"`` included; another value is refused by name."""

import moe_mxfp8
import pytest
import torch
from moe_mxfp8 import (
    FP8RowCodec,
    MXFP8RowCodec,
    decode_fp8_rows,
    decode_fp8_rows_reference,
    dequantize,
    dequantize_reference,
    encode_fp8_rows,
    encode_fp8_rows_reference,
    quantize,
    quantize_dequantize,
    quantize_dequantize_reference,
    quantize_fp8,
    quantize_fp8_reference,
    quantize_group_columns,
    quantize_group_columns_reference,
    quantize_reference,
    quantize_rows_and_cols,
    quantize_rows_and_cols_reference,
    swiglu,
    swiglu_backward,
    swiglu_backward_quantized,
    swiglu_backward_quantized_reference,
    swiglu_backward_reference,
    swiglu_quantized,
    swiglu_quantized_reference,
    swiglu_reference,
    use_reference_kernels,
)
from moe_testing import check_backend_api, check_reference_switch, same_bits


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_mxfp8._triton_support)


def _operands() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g) * torch.exp2(torch.randint(-8, 8, (6, 1), generator=g).float())
    data, scales = quantize_reference(x)
    return dict(x=x, bf16=x.bfloat16(), data=data, scales=scales, dh=torch.randn(6, 48, generator=g).bfloat16(),
                offsets=torch.tensor([2, 2, 5], dtype=torch.int32), packed=encode_fp8_rows_reference(x))


# op name -> (the op called with a backend, its public reference), on the operands above.
OPS = {
    "quantize": (lambda o, b: quantize(o["x"], -2, backend=b), lambda o: quantize_reference(o["x"], -2)),
    "dequantize": (lambda o, b: dequantize(o["data"], o["scales"], dtype=torch.float32, backend=b),
                   lambda o: dequantize_reference(o["data"], o["scales"], dtype=torch.float32)),
    "quantize_rows_and_cols": (lambda o, b: quantize_rows_and_cols(o["bf16"], backend=b),
                               lambda o: quantize_rows_and_cols_reference(o["bf16"])),
    "quantize_dequantize": (lambda o, b: quantize_dequantize(o["x"], torch.bfloat16, True, backend=b),
                            lambda o: quantize_dequantize_reference(o["x"], torch.bfloat16, True)),
    "quantize_fp8": (lambda o, b: quantize_fp8(o["bf16"], (1, 0), True, backend=b),
                     lambda o: quantize_fp8_reference(o["bf16"], (1, 0), True)),
    "quantize_fp8_tiles": (lambda o, b: quantize_fp8(o["x"], (1, 128), False, backend=b),
                           lambda o: quantize_fp8_reference(o["x"], (1, 128), False)),
    "quantize_group_columns": (lambda o, b: quantize_group_columns(o["x"], o["offsets"], backend=b),
                               lambda o: quantize_group_columns_reference(o["x"], o["offsets"])),
    "encode_fp8_rows": (lambda o, b: encode_fp8_rows(o["bf16"], backend=b),
                        lambda o: encode_fp8_rows_reference(o["bf16"])),
    "decode_fp8_rows": (lambda o, b: decode_fp8_rows(o["packed"], torch.bfloat16, backend=b),
                        lambda o: decode_fp8_rows_reference(o["packed"], torch.bfloat16)),
    "swiglu": (lambda o, b: swiglu(o["bf16"], backend=b), lambda o: swiglu_reference(o["bf16"])),
    "swiglu_backward": (lambda o, b: swiglu_backward(o["bf16"], o["dh"], torch.float32, backend=b),
                        lambda o: swiglu_backward_reference(o["bf16"], o["dh"], torch.float32)),
    "swiglu_quantized": (lambda o, b: swiglu_quantized(o["bf16"], (1, 0), True, backend=b),
                         lambda o: swiglu_quantized_reference(o["bf16"], (1, 0), True)),
    "swiglu_backward_quantized": (
        lambda o, b: swiglu_backward_quantized(o["bf16"], o["dh"], torch.bfloat16, (1, 128), False, backend=b),
        lambda o: swiglu_backward_quantized_reference(o["bf16"], o["dh"], torch.bfloat16, (1, 128), False)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_keeps_the_backend_contract(name):
    op, reference = OPS[name]
    check_backend_api(moe_mxfp8._triton_support, lambda o, backend: op(o, backend), reference,
                      lambda: (_operands(),))


@pytest.mark.parametrize("codec", [MXFP8RowCodec, FP8RowCodec])
def test_a_codec_asked_for_triton_on_cpu_says_why(codec, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        codec(backend="triton").encode(torch.zeros(4, 32))
    with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
        codec(backend="triton").decode(codec(backend="reference").encode(torch.zeros(4, 32)), torch.float32)


def test_resolve_backend_is_the_one_decision():
    resolve, cpu, cuda = moe_mxfp8._triton_support.resolve_backend, torch.device("cpu"), torch.device("cuda")
    assert not resolve("reference", cuda) and not resolve("auto", cpu)
    assert resolve("auto", cuda) == moe_mxfp8.triton_available()
    with use_reference_kernels(True):
        assert not resolve("triton", cuda) and not resolve("auto", cuda)


@pytest.mark.gpu
def test_on_gpu_the_switch_launches_no_triton_kernel_and_matches_the_kernels():
    import moe_mxfp8
    from moe_mxfp8 import quantize_fp8
    from moe_testing import launched_triton_kernels

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    out = {}

    def run(tag: str) -> None:
        out[tag] = (*quantize(x, axis=-1), *quantize(x, axis=-2), quantize_fp8(x).data)

    assert launched_triton_kernels(lambda: run("fused"), moe_mxfp8)
    with use_reference_kernels(True):
        launched = launched_triton_kernels(lambda: run("reference"), moe_mxfp8)
    assert not launched, sorted(launched)
    for got, want in zip(out["reference"], out["fused"], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_swiglu_references_match_autograd_in_float64():
    """The swiglu references against an independent oracle: float64 autograd of ``silu(h1) * h3``."""
    g = torch.Generator().manual_seed(1)
    h13, dh = torch.randn(5, 2 * 40, generator=g) * 3, torch.randn(5, 40, generator=g)
    h = h13.double().requires_grad_(True)
    h1, h3 = h.chunk(2, dim=-1)
    y = torch.nn.functional.silu(h1) * h3
    (y * dh.double()).sum().backward()
    torch.testing.assert_close(swiglu_reference(h13), y.detach().float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(swiglu_backward_reference(h13, dh, torch.float32), h.grad.float(), rtol=1e-5, atol=1e-6)
    for block, pow2 in (((1, 0), True), ((1, 128), False)):
        assert same_bits(swiglu_quantized_reference(h13, block, pow2),
                          quantize_fp8_reference(swiglu_reference(h13), block, pow2))
        dh13, q = swiglu_backward_quantized_reference(h13, dh, torch.bfloat16, block, pow2)
        assert same_bits(dh13, swiglu_backward_reference(h13, dh, torch.bfloat16))
        assert same_bits(q, quantize_fp8_reference(dh13, block, pow2))
        h_out = torch.empty(5, 40)
        swiglu_backward_quantized_reference(h13, dh, torch.bfloat16, block, pow2, h_out=h_out)
        assert same_bits(h_out, swiglu_reference(h13))


def test_swiglu_backward_h_out_must_match_h():
    h13, dh = torch.randn(5, 80), torch.randn(5, 40)
    for bad in (torch.empty(5, 80), torch.empty(5, 40, dtype=torch.bfloat16), torch.empty(40, 5).t()):
        with pytest.raises(ValueError, match="h_out must be"):
            swiglu_backward(h13, dh, torch.float32, h_out=bad)
    h_out = torch.empty(5, 40)
    swiglu_backward(h13, dh, torch.float32, h_out=h_out)
    assert same_bits(h_out, swiglu_reference(h13))
