"""Scaled E4M3 formats (moe_mxfp8.fp8) bit for bit against torchao's float8 reference functions."""

import pytest
import torch
from moe_mxfp8 import (
    FP8RowCodec,
    FP8Tensor,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_reference,
    quantize_group_column_blocks,
    quantize_group_columns,
    quantize_weight_blocks,
    quantize_weight_rowwise,
)

torchao_float8 = pytest.importorskip("torchao.float8.float8_utils")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.prototype.blockwise_fp8_training.kernels import (  # noqa: E402
    torch_blockwise_scale_act_quant_lhs,
    torch_blockwise_scale_act_quant_rhs,
    torch_blockwise_scale_weight_quant,
)

E4M3 = torch.float8_e4m3fn


def torchao_axiswise(x: torch.Tensor, dim: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's float8 rowwise recipe cast: (E4M3 data, scale with ``dim`` kept as 1)."""
    scale = torchao_float8.tensor_to_scale(x, E4M3, scaling_granularity=ScalingGranularity.AXISWISE,
                                           axiswise_dim=dim, round_scales_to_power_of_2=pow2)
    return torchao_float8.to_fp8_saturated(x.float() * scale, E4M3), scale


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Differing elements by bits; NaN equals NaN whatever its payload or sign."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    as_int = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    both_nan = a.float().isnan() & b.float().isnan()
    return int(((a.view(as_int) != b.view(as_int)) & ~both_nan).sum())


def adversarial(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows over FP32's range plus rows that are zero, subnormal-only, infinite, NaN, at
    E4M3's and FP32's largest magnitudes, and sparse (one element per row)."""
    g = torch.Generator().manual_seed(seed)
    spread = (-20, 12) if dtype == torch.float16 else (-120, 120)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(*spread, (rows, 1), generator=g).float())
    x[0] = 0.0
    x[1] = -0.0
    x[2] = torch.randn(cols, generator=g) * (1e-6 if dtype == torch.float16 else 1e-40)
    x[3, 5] = float("inf")
    x[4, 7] = -float("inf")
    x[5, 3] = float("nan")
    x[6] = 448.0
    x[7] = torch.randn(cols, generator=g).sign() * (6e4 if dtype == torch.float16 else 3e38)
    x[8] = 0.0
    x[8, cols - 1] = -2.5
    x[9] = torch.randn(cols, generator=g) * 1e-12  # around the amax floor
    return x.to(dtype)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rowwise_matches_torchao(dtype, pow2):
    x = adversarial(48, 200, dtype)
    q = quantize_fp8(x, (1, 0), pow2, backend="reference")
    data, scale = torchao_axiswise(x, -1, pow2)
    assert q.scale.shape == (48, 1) and q.data.dtype == E4M3
    assert mismatches(q.scale, scale) == 0
    assert mismatches(q.data, data) == 0
    # columns of a 3-D stack (a weight's transposed copy) are rows of the transpose
    w = adversarial(60, 40, dtype, seed=1).view(3, 20, 40)
    q = quantize_fp8(w.transpose(-2, -1).contiguous(), (1, 0), pow2, backend="reference")
    data, scale = torchao_axiswise(w, -2, pow2)
    assert mismatches(q.data, data.transpose(-2, -1)) == 0
    assert mismatches(q.scale, scale.transpose(-2, -1)) == 0


@pytest.mark.parametrize("pow2", [True, False])
def test_weight_rowwise_copies_match_torchao_along_both_axes_of_gate_and_up(pow2):
    """Rows scaled along ``in`` and the transpose along ``out``, over gate and up as one
    weight (the adversarial rows fall in both parts); written into given copies."""
    w = adversarial(60, 40, torch.bfloat16, seed=2).view(3, 20, 40)
    gate, up = w[:, :8], w[:, 8:]
    rows, cols = quantize_weight_rowwise([gate, up], pow2, backend="reference")
    assert rows.block == cols.block == (1, 0) and cols.data.shape == (3, 40, 20)
    data, scale = torchao_axiswise(w, -1, pow2)
    assert mismatches(rows.data, data) == 0 and mismatches(rows.scale, scale) == 0
    data, scale = torchao_axiswise(w, -2, pow2)
    assert mismatches(cols.data, data.transpose(-2, -1)) == 0
    assert mismatches(cols.scale, scale.transpose(-2, -1)) == 0
    into = quantize_weight_rowwise([w], not pow2, backend="reference")
    got = quantize_weight_rowwise([w], pow2, out=into, backend="reference")
    assert got[0] is into[0] and got[1] is into[1]
    for g, want in zip(got, (rows, cols), strict=True):
        assert mismatches(g.data, want.data) == 0 and mismatches(g.scale, want.scale) == 0


@pytest.mark.parametrize("pow2", [True, False])
def test_weight_block_copies_are_the_blocks_of_the_weight_and_its_transpose(pow2):
    """128x128 blocks of gate and up as one weight (a block spans both parts) and of its
    transpose, cut blocks along both axes; written into given copies."""
    w = adversarial(2 * 150, 140, torch.bfloat16, seed=3).view(2, 150, 140)
    gate, up = w[:, :90], w[:, 90:]
    rows, cols = quantize_weight_blocks([gate, up], pow2, backend="reference")
    assert rows.block == cols.block == (128, 128) and cols.data.shape == (2, 140, 150)
    assert cols.scale.shape == (2, 2, 2)
    for got, src in ((rows, w), (cols, w.mT.contiguous())):
        want = quantize_fp8_reference(src, (128, 128), pow2)
        assert mismatches(got.data, want.data) == 0 and mismatches(got.scale, want.scale) == 0
    # a square block of the transpose holds the block's elements: codes and scales transposed
    assert torch.equal(cols.data.view(torch.uint8), rows.data.view(torch.uint8).mT)
    assert torch.equal(cols.scale.view(torch.int32), rows.scale.mT.view(torch.int32))  # NaN blocks too
    into = quantize_weight_blocks([w], not pow2, backend="reference")
    got = quantize_weight_blocks([w], pow2, out=into, backend="reference")
    assert got[0] is into[0] and got[1] is into[1]
    for g, want in zip(got, (rows, cols), strict=True):
        assert mismatches(g.data, want.data) == 0 and mismatches(g.scale, want.scale) == 0
    with pytest.raises(ValueError, match="out rows"):
        quantize_weight_blocks([w], out=quantize_weight_rowwise([w], backend="reference"))


def test_weight_rowwise_bad_input_names_the_argument():
    w = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="parts: one or two"):
        quantize_weight_rowwise([w, w, w])
    with pytest.raises(ValueError, match="parts: one dtype"):
        quantize_weight_rowwise([w, torch.randn(2, 4, 6)])
    rows, cols = quantize_weight_rowwise([w])
    with pytest.raises(ValueError, match="out cols"):
        quantize_weight_rowwise([w], out=(rows, rows))


def test_non_finite_rows_dequantize_to_nan_and_zero_rows_stay_zero():
    x = adversarial(16, 64, torch.float32)
    deq = dequantize_fp8(quantize_fp8(x, backend="reference"))
    assert deq[3:6].isnan().all()  # a row with inf or NaN: scale 0 or NaN
    assert (deq[[0, 1, 2]] == 0).all()  # zeros and FP32 denormals
    assert (deq[6] == 448.0).all() and deq[7].abs().max() < 3.5e38


def test_power_of_two_scale_is_rounded_down_exactly_where_torchao_log2_rounds_up():
    """amax just above 7 * 2**j puts 448/amax a few ulps below a power of two; torchao's
    FP32 log2 then rounds up to the integer (scale twice ours, saturating the amax)."""
    ulps = torch.arange(0, 40, dtype=torch.int32)
    amax = (torch.tensor(7.0 * 2.0**-3).view(torch.int32) + ulps).view(torch.float32)
    x = torch.zeros(len(ulps), 8)
    x[:, 0] = amax
    x[:, 1] = 0.5
    q = quantize_fp8(x, (1, 0), True, backend="reference")
    _, scale = torchao_axiswise(x, -1, True)
    exact = (torch.tensor(448.0, dtype=torch.float64) / amax.double()).float()
    assert (q.scale[:, 0] <= exact).all() and (exact < 2 * q.scale[:, 0]).all()
    differ = q.scale[:, 0] != scale[:, 0]
    assert differ.any() and not differ[0]
    assert (scale[differ, 0] == 2 * q.scale[differ, 0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_matches_torchao_deepseek_reference(dtype):
    x = adversarial(256, 384, dtype, seed=2)
    q = quantize_fp8(x, (1, 128), pow2=False, backend="reference")
    data, inv_scale = torch_blockwise_scale_act_quant_lhs(x.contiguous())
    assert q.scale.shape == (256, 3)
    assert mismatches(q.data, data) == 0 and mismatches(q.scale.reciprocal(), inv_scale) == 0
    q = quantize_fp8(x, (128, 128), pow2=False, backend="reference")
    data, inv_scale = torch_blockwise_scale_weight_quant(x.contiguous())
    assert q.scale.shape == (2, 3)
    assert mismatches(q.data, data) == 0 and mismatches(q.scale.reciprocal(), inv_scale) == 0


def test_partial_blocks_quantize_as_if_zero_padded():
    x = torch.randn(2, 130, 200)
    q = quantize_fp8(x, (128, 128), pow2=False, backend="reference")
    assert q.scale.shape == (2, 2, 2) and q.data.shape == x.shape
    padded = torch.zeros(2, 256, 256)
    padded[:, :130, :200] = x
    ref = quantize_fp8(padded, (128, 128), pow2=False, backend="reference")
    assert mismatches(q.scale, ref.scale) == 0
    assert mismatches(q.data, ref.data[:, :130, :200].contiguous()) == 0


@pytest.mark.parametrize("pow2", [True, False])
def test_group_columns_match_torchao_per_expert_and_are_16_aligned(pow2):
    x = adversarial(70, 48, torch.bfloat16, seed=3)
    offsets = torch.tensor([9, 9, 40, 41, 64], dtype=torch.int32)  # an empty expert; rows 64.. pad
    data_t, scale, ends = quantize_group_columns(x, offsets, pow2, backend="reference")
    assert ends.tolist() == [16, 16, 48, 64, 96]
    assert data_t.shape == (48, 80 + 5 * 16) and scale.shape == (5, 48)
    start = slot = 0
    for e, (end, padded_end) in enumerate(zip(offsets.tolist(), ends.tolist(), strict=True)):
        seg = x[start:end] if end > start else torch.zeros(1, 48, dtype=x.dtype)
        data, s = torchao_axiswise(seg, 0, pow2)
        assert mismatches(scale[e], s[0]) == 0, e
        n = end - start
        assert mismatches(data_t[:, slot:slot + n], data[:n].t()) == 0, e
        assert (data_t[:, slot + n:padded_end].float() == 0).all(), e  # padding is zero
        start, slot = end, padded_end


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_column_blocks_match_torchao_128x1_tiles_per_expert_and_are_128_aligned(dtype):
    """Each expert's rows, zero-padded to whole 128-row blocks, quantized by torchao's
    right-hand weight-gradient operand cast of its blockwise recipe (per column and 128
    rows): the same codes (transposed) and scales; padding codes zero."""
    x = adversarial(560, 128, dtype, seed=4)
    x[300:428:7, 11] = float("nan")  # a NaN past an expert's first block
    offsets = torch.tensor([0, 10, 10, 138, 139, 400, 560], dtype=torch.int32)
    data_t, scale, ends = quantize_group_column_blocks(x, offsets, pow2=False, backend="reference")
    assert ends.tolist() == [0, 128, 128, 256, 384, 768, 1024]
    width = 640 + 7 * 128
    assert data_t.shape == (128, width) and scale.shape == (width // 128, 128)
    start = slot = 0
    for e, (end, padded_end) in enumerate(zip(offsets.tolist(), ends.tolist(), strict=True)):
        seg = torch.zeros(padded_end - slot, 128)
        seg[:end - start] = x[start:end].float()
        if len(seg):
            data, inv_scale = torch_blockwise_scale_act_quant_rhs(seg)
            assert mismatches(scale[slot // 128:padded_end // 128].reciprocal(), inv_scale) == 0, e
            n = end - start
            assert mismatches(data_t[:, slot:slot + n], data[:n].t()) == 0, e
            assert (data_t[:, slot + n:padded_end].view(torch.uint8) == 0).all(), e  # padding: zero
        start, slot = end, padded_end
    assert (data_t[:, slot:].view(torch.uint8) == 0).all()  # past the last expert: zero blocks
    assert (scale[slot // 128:] == quantize_fp8(torch.zeros(1, 1), pow2=False).scale).all()


def test_dequantize_is_within_e4m3_precision():
    x = torch.randn(64, 256)
    for block, pow2 in (((1, 0), True), ((1, 128), False), ((128, 128), False)):
        q = quantize_fp8(x, block, pow2, backend="reference")
        assert isinstance(q, FP8Tensor) and q.block == block
        err = (q.dequantize() - x).abs()
        assert (err <= x.abs() * 2**-4 + 2**-9 * x.abs().max()).all(), block


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="block"):
        quantize_fp8(torch.randn(4, 4), (2, 0))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        quantize_fp8(torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., M, N\]"):
        quantize_fp8(torch.randn(4))
    with pytest.raises(ValueError, match="offsets must be int32"):
        quantize_group_columns(torch.randn(4, 4), torch.tensor([4]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_codec_round_trips_like_quantize_and_requantizes_to_the_same_values(dtype):
    codec = FP8RowCodec()
    x = adversarial(40, 96, dtype, seed=4)
    x[3:6] = 1.0  # finite rows for the re-quantization check
    packed = codec.encode(x)
    assert packed.shape == (40, 100) and packed.dtype == torch.uint8
    assert codec.packed_width(2048) == 2052 and codec.bytes_ratio(2048) < 0.502
    decoded = codec.decode(packed, dtype)
    assert mismatches(decoded.float(), dequantize_fp8(quantize_fp8(x, backend="reference"))) == 0
    again = dequantize_fp8(quantize_fp8(decoded, backend="reference"))
    assert mismatches(again, decoded.float()) == 0
    # a row whose largest code rounds to 224: its scale doubles on re-quantization
    row = torch.tensor([[225.0, 1.0, -3.5]])
    assert quantize_fp8(codec.decode(codec.encode(row), torch.float32)).scale.item() == 2.0
    with pytest.raises(ValueError, match="packed width"):
        codec.decode(torch.zeros(2, 4, dtype=torch.uint8), dtype)


def test_row_codec_bad_input_names_the_argument():
    codec = FP8RowCodec()
    for bad in (torch.zeros(8), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3, 4)):
        with pytest.raises(ValueError, match=r"rows must be float32, bfloat16 or float16 \[R, D\]"):
            codec.encode(bad)
    with pytest.raises(ValueError, match="positive width"):
        codec.encode(torch.zeros(2, 0))
    with pytest.raises(ValueError, match=r"packed must be uint8 \[R, W\], got torch.int8"):
        codec.decode(torch.zeros(2, 8, dtype=torch.int8), torch.float32)
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16, got torch.int32"):
        codec.decode(torch.zeros(2, 8, dtype=torch.uint8), torch.int32)
