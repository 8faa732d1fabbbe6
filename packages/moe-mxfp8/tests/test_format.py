"""The MXFP8 format against torchao's MX reference (floor scale rule), bit for bit."""

import pytest
import torch
from moe_mxfp8 import dequantize, quantize, quantize_dequantize, quantize_rows_and_cols
from moe_mxfp8.format import scale_to_float

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
ScaleCalculationMode = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode


def torchao_quantize(x: torch.Tensor, axis: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's to_mx (floor) along ``axis``, zero-padding a partial last block."""
    x_last = x.movedim(axis, -1)
    n = x_last.shape[-1]
    pad = -n % 32
    x_pad = torch.nn.functional.pad(x_last, (0, pad)).contiguous()
    scales, data = mx.to_mx(x_pad, torch.float8_e4m3fn, 32, ScaleCalculationMode.FLOOR)
    data = data[..., :n].movedim(-1, axis).contiguous()
    return data, scales.movedim(-1, axis).contiguous()


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal bit patterns; NaN only has to be NaN (IEEE leaves its sign and payload open)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    both_nan = ours.float().isnan() & ref.float().isnan()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[ours.element_size()]
    differ = (ours.view(as_int) != ref.view(as_int)) & ~both_nan
    assert not differ.any(), f"{int(differ.sum())} elements differ, first at {differ.nonzero()[0].tolist()}"


def many_magnitudes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    exps = torch.randint(-140, 128, (*shape[:-1], 1), generator=g).float()
    return x * torch.exp2(exps)  # rows span FP32's whole range, denormals included


def adversarial_rows() -> torch.Tensor:
    """One 32-wide block per row, each a special case of the scale rule."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(14, 32, generator=g)
    rows = [
        torch.zeros(32),  # all zero
        -torch.zeros(32),  # all negative zero
        torch.cat([torch.tensor([3.0e38]), base[0, 1:] * 1e-3]),  # one huge value
        base[1] * 1e-40,  # FP32 denormals only
        torch.cat([torch.tensor([1e-38]), base[2, 1:] * 1e-44]),  # denormals under a tiny normal
        torch.cat([torch.tensor([float("inf")]), base[3, 1:]]),
        torch.cat([torch.tensor([-float("inf")]), base[4, 1:]]),
        torch.cat([torch.tensor([float("nan")]), base[5, 1:]]),
        torch.full((32,), 448.0),  # the E4M3 maximum
        torch.cat([torch.tensor([-448.0, 464.0, 480.0, 511.9]), base[6, 4:]]),  # around the max
        torch.cat([torch.tensor([1.75 * 2.0**127]), base[7, 1:] * 2.0**100]),  # near FP32 max
        base[8] * 2.0**-126,  # smallest normals
        torch.tensor([2.0**-9 * k for k in range(32)]),  # ties at E4M3's subnormal grid
        base[9] * 256.0,
    ]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_random_data_over_many_magnitudes_matches_torchao(dtype, axis):
    x = many_magnitudes((64, 96), seed=0).to(dtype) if axis else many_magnitudes((96, 64), 0).t()
    x = x.contiguous().to(dtype)
    data, scales = quantize(x, axis, backend="reference")
    ref_data, ref_scales = torchao_quantize(x, axis)
    assert_same_bits(data, ref_data)
    assert_same_bits(scales, ref_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adversarial_blocks_match_torchao(dtype):
    x = adversarial_rows().to(dtype)
    data, scales = quantize(x, backend="reference")
    ref_data, ref_scales = torchao_quantize(x)
    assert_same_bits(data, ref_data)
    assert_same_bits(scales, ref_scales)
    s = scales.view(torch.uint8)
    assert s[0] == 0 and s[7] == 255  # all-zero block: 2**-127; NaN block: the NaN code
    assert data[7].float().isnan()[0] and data[5].float()[0] == 448.0  # NaN kept, inf saturates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_matches_torchao(dtype):
    x = torch.cat([adversarial_rows(), many_magnitudes((20, 32), seed=2)]).to(dtype)
    ref_data, ref_scales = torchao_quantize(x)
    for out in (torch.float32, torch.bfloat16):
        ours = dequantize(ref_data, ref_scales, dtype=out, backend="reference")
        ref = mx.to_dtype(ref_data, ref_scales, torch.float8_e4m3fn, 32, out)
        assert_same_bits(ours, ref)


@pytest.mark.parametrize("shape,axis", [((5, 45), -1), ((3, 7, 33), 1), ((70, 3), 0), ((1,), 0)])
def test_partial_blocks_are_zero_padded(shape, axis):
    x = many_magnitudes(shape, seed=3) if len(shape) > 1 else torch.tensor([3.0])
    data, scales = quantize(x, axis, backend="reference")
    ref_data, ref_scales = torchao_quantize(x, axis)
    assert data.shape == x.shape
    assert scales.shape[axis] == -(-x.shape[axis] // 32)
    assert_same_bits(data, ref_data)
    assert_same_bits(scales, ref_scales)
    back = dequantize(data, scales, axis, dtype=torch.float32, backend="reference")
    assert back.shape == x.shape


def test_quantize_dequantize_and_both_orientations_agree_with_quantize():
    x = many_magnitudes((4, 40, 72), seed=4).to(torch.bfloat16)
    rows, cols = quantize_rows_and_cols(x, backend="reference")
    for mx_t, axis in ((rows, 2), (cols, 1)):
        data, scales = quantize(x, axis, backend="reference")
        assert_same_bits(mx_t.data, data)
        assert_same_bits(mx_t.scales, scales)
    deq, kept = quantize_dequantize(x, torch.bfloat16, keep_mxfp8=True, backend="reference")
    assert_same_bits(kept.data, rows.data)
    assert_same_bits(deq, rows.dequantize(torch.bfloat16, backend="reference"))


def test_every_dequantized_value_is_exact_in_bf16_for_scale_codes_3_to_246():
    """The emulated GEMM's premise: E4M3 x 2**k is a BF16 value unless k is extreme."""
    codes = torch.arange(256, dtype=torch.uint8)
    data = codes.view(torch.float8_e4m3fn).float()
    finite = data.isfinite()
    scale = scale_to_float(codes.view(torch.float8_e8m0fnu)).double()
    exact = data[finite].double()[None, :] * scale[:, None]  # [256 scales, 254 values]
    via_bf16 = (data[finite][None, :] * scale[:, None].float()).to(torch.bfloat16).double()
    same = (via_bf16 == exact) | (exact.isnan() & via_bf16.isnan())
    exact_codes = same.all(dim=1).nonzero().flatten().tolist()
    assert exact_codes == list(range(3, 247)) + [255]  # 255 is the NaN scale: NaN either way
    # Blocks from quantize() with a finite amax >= 2**-116 get codes in [3, 246].
    x = torch.tensor([[2.0**-116] * 32, [3.3e38] * 32])
    assert quantize(x, backend="reference")[1].view(torch.uint8).flatten().tolist() == [3, 246]


def test_bad_inputs_name_the_field():
    with pytest.raises(TypeError, match="x must be float32"):
        quantize(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="axis=2"):
        quantize(torch.zeros(4, 4), axis=2)
    with pytest.raises(ValueError, match="block_size"):
        quantize(torch.zeros(4, 4), block_size=0)
    data, scales = quantize(torch.zeros(4, 64))
    with pytest.raises(ValueError, match="scales has shape"):
        dequantize(data, scales[:, :1])
    with pytest.raises(TypeError, match="data must be float8_e4m3fn"):
        dequantize(data.float(), scales)
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.zeros(4, 4), backend="cuda")
