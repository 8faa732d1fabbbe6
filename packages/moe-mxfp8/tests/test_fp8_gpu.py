"""FP8 on a GPU at real sizes: kernels bit-exact vs the torch reference; the native grouped
GEMMs (torch._scaled_grouped_mm, sm_90) and the Triton grouped GEMM against the exact
emulation; no host sync."""

import dataclasses
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from moe_mxfp8 import (
    FP8GroupedExperts,
    FP8Linear,
    FP8RowCodec,
    decode_fp8_rows,
    decode_fp8_rows_reference,
    encode_fp8_rows,
    encode_fp8_rows_reference,
    fp8_native_available,
    fp8_triton_available,
    quantize_fp8,
    quantize_group_column_blocks,
    quantize_group_columns,
)
from moe_mxfp8.fp8_gemm import (
    FP8_TILES_GPU,
    FP8TileConfig,
    fp8_grouped_mm,
    fp8_grouped_wgrad,
    triton_grouped_mm,
)
from moe_testing import assert_no_host_sync

sys.path.insert(0, str(Path(__file__).parent))
from fp8_codec_cases import adversarial_packed, adversarial_rows  # noqa: E402

pytestmark = pytest.mark.gpu

needs_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_native_available(torch.device("cuda"))),
    reason="needs a GPU with FP8 tensor cores and torch._scaled_grouped_mm (compute capability 9.x)")


needs_fp8_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and fp8_triton_available(torch.device("cuda"))),
    reason="needs Triton and a GPU with FP8 tensor cores (compute capability 8.9 or up)")


def sample(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda")
    x = x * torch.exp2(torch.randint(-100, 100, (*shape[:-1], 1), generator=g, device="cuda").float())
    flat = x.view(-1)
    flat[: shape[-1]] = 0.0  # a zero row
    flat[5 * shape[-1] + 3] = float("inf")
    flat[7 * shape[-1] + 9] = float("nan")
    flat[9 * shape[-1]: 9 * shape[-1] + 40] = 1e-40  # denormals
    return x.to(dtype)


def mismatches(a, b):
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    both_nan = a.float().isnan() & b.float().isnan()
    return int(((a.view(as_int) != b.view(as_int)) & ~both_nan).sum())


def routed_offsets(rows, experts, seed=0):
    """Uneven group ends over ``rows`` with one empty expert (expert 1)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(experts, generator=g) + 0.1
    w[1] = 0
    counts = (w / w.sum() * rows).floor().long()
    counts[0] += rows - counts.sum()
    return counts.cumsum(0).to(torch.int32).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("block", "pow2"), [((1, 0), True), ((1, 0), False), ((1, 128), False),
                                             ((128, 128), False)])
def test_kernels_bit_exact_at_real_sizes(block, pow2, dtype):
    # (64, 100352): rows of a vocabulary, wider than ROW_WIDTH_MAX (two passes in chunks)
    for shape in ((8192, 2048), (1000, 3000), (4, 384, 520), (64, 100352)):
        x = sample(shape, dtype)
        got, ref = (quantize_fp8(x, block, pow2, backend=b) for b in ("auto", "reference"))
        assert mismatches(got.data, ref.data) == 0 and mismatches(got.scale, ref.scale) == 0, shape


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("quantize", [quantize_group_columns, quantize_group_column_blocks],
                         ids=["per_expert", "per_128_tokens"])
def test_group_columns_bit_exact_at_real_sizes(quantize, pow2):
    x = sample((8192, 2048), torch.bfloat16)
    offsets = routed_offsets(8192, 64)
    (dt, st, et), (dr, sr, er) = (quantize(x, offsets, pow2, backend=b) for b in ("auto", "reference"))
    # per expert: columns past the last padded end are unspecified
    used = dt.shape[1] if quantize is quantize_group_column_blocks else int(er[-1])
    assert torch.equal(et, er) and mismatches(st, sr) == 0
    assert mismatches(dt[:, :used], dr[:, :used]) == 0


# Weights of the bench shapes: gate and up of 64 experts, one down weight, an odd stack
# (rowwise: the column kernel's byte stores; blocks: parts that end inside a block) and,
# rowwise only, an LM head (the transposed-copy fallback).
_WEIGHT_SHAPES = [((64, 1024, 2048), (64, 1024, 2048)), ((64, 2048, 1024),), ((8, 333, 520), (8, 77, 520))]
WEIGHT_COPIES = {"rowwise": ((1, 0), [*_WEIGHT_SHAPES, ((100352, 2048),)]),
                 "blocks": ((128, 128), _WEIGHT_SHAPES)}


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("kind", list(WEIGHT_COPIES))
def test_weight_copies_bit_exact_at_real_sizes(kind, pow2):
    """``quantize_weight_rowwise`` / ``quantize_weight_blocks``: both copies of each weight
    against quantizing it and its transpose, fresh and into given copies."""
    import moe_mxfp8

    quantize = getattr(moe_mxfp8, f"quantize_weight_{kind}")
    block, cases = WEIGHT_COPIES[kind]
    for i, shapes in enumerate(cases):
        parts = [sample(shape, torch.bfloat16, seed=i + j) for j, shape in enumerate(shapes)]
        weight = torch.cat(parts, dim=-2)
        want = (quantize_fp8(weight, block, pow2, backend="reference"),
                quantize_fp8(weight.mT.contiguous(), block, pow2, backend="reference"))
        into = quantize(parts, not pow2)
        for got in (quantize(parts, pow2), quantize(parts, pow2, out=into)):
            for g, w in zip(got, want, strict=True):
                assert mismatches(g.data, w.data) == 0 and mismatches(g.scale, w.scale) == 0, shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_swiglu_quantization_equals_the_unfused_kernels(dtype):
    from moe_mxfp8.swiglu import (
        swiglu,
        swiglu_backward,
        swiglu_backward_quantized,
        swiglu_quantized,
    )

    g = torch.Generator(device="cuda").manual_seed(3)
    h13 = (torch.randn(8192, 2048, generator=g, device="cuda") * 4).to(dtype)
    dh = torch.randn(8192, 1024, generator=g, device="cuda").to(dtype)
    fused = swiglu_quantized(h13, (1, 0), True)
    plain = quantize_fp8(swiglu(h13), (1, 0), True)
    assert mismatches(fused.data, plain.data) == 0 and mismatches(fused.scale, plain.scale) == 0
    dh13, fused = swiglu_backward_quantized(h13, dh, dtype, (1, 0), True)
    plain_dh13 = swiglu_backward(h13, dh, dtype)
    plain = quantize_fp8(plain_dh13, (1, 0), True)
    assert torch.equal(dh13, plain_dh13)
    assert mismatches(fused.data, plain.data) == 0 and mismatches(fused.scale, plain.scale) == 0
    # the forward's value from the backward kernels, as the forward kernel writes it
    h = swiglu(h13)
    for backward in (lambda h_out: swiglu_backward_quantized(h13, dh, dtype, (1, 0), True, h_out=h_out),
                     lambda h_out: swiglu_backward(h13, dh, dtype, h_out=h_out)):
        h_out = torch.empty_like(h)
        backward(h_out)
        assert mismatches(h_out, h) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
def test_output_gradient_row_encoding_is_bit_exact(dtype, pow2):
    """The device functions ``RowCodes`` hands a kernel give the reference's
    bytes on the GPU, on random and adversarial rows."""
    from row_encoding import row_encoding_mismatches

    assert row_encoding_mismatches(dtype, pow2, "cuda") == 0


def test_row_codec_on_gpu_matches_the_cpu_encoding():
    x = sample((4096, 2048), torch.bfloat16)
    codec = FP8RowCodec()
    packed = codec.encode(x)
    ref = codec.encode(x.cpu())
    assert packed.shape == (4096, 2052)
    assert mismatches(packed[:, :2048].view(torch.float8_e4m3fn).cpu(),
                      ref[:, :2048].view(torch.float8_e4m3fn)) == 0
    assert mismatches(codec.decode(packed, torch.float32).cpu(), codec.decode(ref, torch.float32)) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_row_codec_kernels_bit_exact_at_real_and_adversarial_rows(dtype):
    """One kernel each way against the reference on the same GPU: rows at the dispatch
    width and odd ones, the adversarial rows and packed bytes of the interpreter cases."""
    rows = [sample((4096, 2048), dtype), sample((1000, 7168), dtype, seed=1), sample((333, 77), dtype, seed=2),
            adversarial_rows(dtype).cuda()]
    for x in rows:
        D = x.shape[1]
        got, ref = encode_fp8_rows(x, backend="auto"), encode_fp8_rows_reference(x)
        assert mismatches(got[:, :D].view(torch.float8_e4m3fn), ref[:, :D].view(torch.float8_e4m3fn)) == 0
        assert mismatches(got[:, D:].contiguous().view(torch.float32),
                          ref[:, D:].contiguous().view(torch.float32)) == 0
    for packed in [encode_fp8_rows_reference(x) for x in rows] + [adversarial_packed().cuda(),
                                                                   adversarial_packed(2048).cuda()]:
        for out in (torch.bfloat16, torch.float32, torch.float16):
            got, ref = decode_fp8_rows(packed, out, backend="auto"), decode_fp8_rows_reference(packed, out)
            assert mismatches(got, ref) == 0, (tuple(packed.shape), out)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


# Fast accumulation keeps the partial sums in the tensor cores' accumulator, about 14
# significant bits, truncating (DeepSeek-V3 technical report, section 3.3.2, which measures
# a maximum relative error of nearly 2% per element at K = 4096: no per-element tolerance).
# In norm: each of the K / 32 steps of an sm_90 FP8 MMA (32 products a step) truncates less
# than 2**-13 of the running sum, so even if every step lost a whole unit the error stays
# under 64 * 2**-13 = 0.8% at K = 2048 (the forward here; the weight gradients reduce over
# an expert's tokens, fewer here). FAST_ACCUM_REL bounds the GEMM's relative error in norm.
FAST_ACCUM_REL = 1e-2


def _grouped_mm_equals_the_emulation(gemm, fast_accum, K, N, blocks=((1, 0), (1, 0)), pow2=True):
    """``fp8_grouped_mm`` of ``gemm`` against the emulation of the same E4M3 operands and
    scales. FP32 promotion: only accumulation order and the BF16 output rounding (per
    element); fast accumulation: within ``FAST_ACCUM_REL`` in norm. Returns the offsets
    and the generator, for further draws."""
    R, E = 8192, 16
    offsets = routed_offsets(R, E)
    g = torch.Generator(device="cuda").manual_seed(1)
    a = quantize_fp8(torch.randn(R, K, device="cuda", generator=g).bfloat16(), blocks[0], pow2)
    b = quantize_fp8((torch.randn(E, N, K, device="cuda", generator=g) * 0.02).bfloat16(), blocks[1], pow2)
    end = int(offsets[-1])
    got = fp8_grouped_mm(a, b, offsets, torch.bfloat16, gemm=gemm, fast_accum=fast_accum)[:end]
    emulated = fp8_grouped_mm(a, b, offsets, torch.float32, gemm="emulated", fast_accum=fast_accum)[:end]
    if fast_accum:
        assert _relative_error(got, emulated) < FAST_ACCUM_REL
    else:
        torch.testing.assert_close(got.float(), emulated, rtol=8e-3, atol=1e-3)
    return offsets, g


@needs_sm90
@pytest.mark.parametrize("fast_accum", [False, True])
def test_native_grouped_gemms_equal_the_emulation_of_the_same_operands(fast_accum):
    """The 2d x 3d GEMM (``_grouped_mm_equals_the_emulation``) and the weight gradients."""
    R, K, N = 8192, 2048, 1024
    offsets, g = _grouped_mm_equals_the_emulation("native", fast_accum, K, N)
    dy = torch.randn(R, N, device="cuda", generator=g).bfloat16()
    x = torch.randn(R, K, device="cuda", generator=g).bfloat16()
    native = fp8_grouped_wgrad(dy, x, offsets, True, torch.bfloat16, gemm="native", fast_accum=fast_accum)
    emulated = fp8_grouped_wgrad(dy, x, offsets, True, torch.float32, gemm="emulated", fast_accum=fast_accum)
    if fast_accum:  # K here is an expert's tokens, up to ~1000 rows
        assert _relative_error(native, emulated) < FAST_ACCUM_REL
    else:
        torch.testing.assert_close(native.float(), emulated, rtol=8e-3, atol=5e-2)
    assert native[1].abs().sum() == 0  # the empty expert


def _experts(E=16, D=2048, F=1024, gemm="native", recipe="fp8_rowwise", **kwargs):
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.nn.Parameter((torch.randn(shape, generator=g, device="cuda") * 0.02).bfloat16())
          for shape in ((E, F, D), (E, F, D), (E, D, F))]
    return FP8GroupedExperts(*ws, recipe=recipe, gemm=gemm, **kwargs)


# Whole layer, native against emulated. With FP32 promotion the GEMM outputs differ by
# accumulation order, so the SwiGLU between the GEMMs sees BF16 inputs an ulp apart now and
# then and an E4M3 rounding of ``h`` may flip: 1% in norm. With the forward GEMMs on fast
# accumulation ``h13`` differs by up to FAST_ACCUM_REL (relative), which moves a fraction
# of about FAST_ACCUM_REL / q of ``h``'s E4M3 codes by one step q (a relative step of 1/16 to
# 1/8): sqrt(FAST_ACCUM_REL / q) * q = sqrt(FAST_ACCUM_REL * q) <= 3.5% in norm, still half
# the recipe's own error against BF16 (6.6%, docs/performance.md).
LAYER_REL = {(): 1e-2, ("output",): 3.5e-2}


def _layers_agree(layer_a, layer_b, limit):
    """Forward, input and weight gradients of two layers on the same rows, in norm."""
    R = 8192
    offsets = routed_offsets(R, 16)
    end = int(offsets[-1])
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = torch.randn(R, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(R, 2048, device="cuda", generator=g).bfloat16()
    outs = []
    for layer in (layer_a, layer_b):
        y = layer(rows, offsets)
        grads = torch.autograd.grad(y, [rows, layer.w1, layer.w3, layer.w2], dy)
        outs.append((y[:end], grads[0][:end], *grads[1:]))
    for got, want in zip(*outs, strict=True):
        rel = _relative_error(got, want)
        assert rel < limit, rel
    assert outs[0][2][1].abs().sum() == 0  # the empty expert's gate weight gradient


@needs_sm90
@pytest.mark.parametrize("fast_accum", list(LAYER_REL), ids=["fp32", "default"])
def test_native_experts_match_emulated_experts(fast_accum):
    """Forward, input and weight gradients of the whole layer, in norm (``LAYER_REL``)."""
    native = _experts(fast_accum=fast_accum)
    emulated = FP8GroupedExperts(native.w1, native.w3, native.w2, gemm="emulated")
    _layers_agree(native, emulated, LAYER_REL[fast_accum])


@needs_fp8_triton
@pytest.mark.parametrize(("scales", "fast_accum", "K", "N"),
                         [("rowwise", False, 2048, 1024), ("rowwise", True, 2048, 1024),
                          ("blockwise", False, 2048, 1024), ("rowwise", False, 1000, 520),
                          ("blockwise", False, 1000, 520)])
def test_triton_grouped_gemm_equals_the_emulation_of_the_same_operands(scales, fast_accum, K, N):
    """The Triton GEMM at real sizes (TMA loads; K 1000 and N 520 take the pointer path
    with cut K steps, scale blocks and n-tiles), as ``_grouped_mm_equals_the_emulation``."""
    if scales == "rowwise":
        _grouped_mm_equals_the_emulation("triton", fast_accum, K, N)
    else:
        _grouped_mm_equals_the_emulation("triton", fast_accum, K, N, ((1, 128), (128, 128)), False)


@needs_fp8_triton
def test_blockwise_weight_gradient_kernel_equals_the_emulation_and_adds_in_place():
    """The blockwise weight-gradient kernel at the gate/up shape of ``bench-1gpu``'s experts
    (uneven experts, one empty), into a new result and, as a sink's add, into an FP32
    target in place (the up half of dh13: a row slice of its copy)."""
    from moe_mxfp8.fp8_gemm import fp8_wgrad_mm, quantize_wgrad_operands

    R, K, N, E = 16384, 2048, 2048, 16
    offsets = routed_offsets(R, E)
    g = torch.Generator(device="cuda").manual_seed(3)
    dy = torch.randn(R, N, device="cuda", generator=g).bfloat16()
    x = torch.randn(R, K, device="cuda", generator=g).bfloat16()
    ops = quantize_wgrad_operands(dy, x, offsets, False, True)
    emulated = fp8_wgrad_mm(ops, torch.float32, "emulated", False)
    triton = fp8_wgrad_mm(ops, torch.float32, "triton", False)
    torch.testing.assert_close(triton, emulated, rtol=1e-4, atol=1e-3)
    assert triton[1].abs().sum() == 0  # the empty expert
    target = torch.randn(E, N // 2, K, device="cuda", generator=g)
    before = target.clone()
    fp8_wgrad_mm(ops.dy_columns(N // 2, N), torch.bfloat16, "triton", False, accumulate_into=target)
    torch.testing.assert_close(target - before, emulated[:, N // 2:], rtol=1e-4, atol=1e-3)


@needs_fp8_triton
def test_tiles_larger_than_shared_memory_are_refused_by_name():
    """Eight stages of the fast 128 x 256 x 128 FP8 tile (384 KiB of operand buffers)
    compile, then cannot launch on an sm_90 SM (227 KiB): a ValueError naming the config."""
    a = quantize_fp8(torch.randn(512, 256, device="cuda").bfloat16())
    b = quantize_fp8(torch.randn(2, 256, 256, device="cuda").bfloat16())
    tiles = FP8TileConfig(128, 256, 128, 8, 8, 8, False)
    with pytest.raises(ValueError, match=r"tiles FP8TileConfig\(block_m=128, block_n=256, .* need shared memory"):
        triton_grouped_mm(a, b, torch.tensor([256, 512], dtype=torch.int32, device="cuda"), torch.bfloat16,
                          False, tiles)


@needs_fp8_triton
@pytest.mark.parametrize("tiles", ["fast", "promoted"])
@pytest.mark.parametrize(("K", "N"), [(2048, 1024), (1024, 2056)])
def test_triton_gemm_tma_store_equals_the_pointer_store(tiles, K, N):
    """The epilogue through TMA (``FP8TileConfig.tma_store``) writes the same bits as the
    masked pointer store and nothing past a group's end: uneven groups with an empty one,
    rows past the last group kept as they were (N 2056: a cut last n-tile)."""
    R, E = 8192, 16
    offsets = routed_offsets(R - 100, E)
    g = torch.Generator(device="cuda").manual_seed(3)
    a = quantize_fp8(torch.randn(R, K, device="cuda", generator=g).bfloat16())
    b = quantize_fp8((torch.randn(E, N, K, device="cuda", generator=g) * 0.02).bfloat16())
    base = FP8_TILES_GPU[tiles]
    results, empty = [], torch.empty
    for tma_store in (False, True):
        cfg = dataclasses.replace(base, tma_store=tma_store)
        y = torch.full((R, N), 7.0, device="cuda", dtype=torch.bfloat16)

        def result_buffer(*shape, y=y, **kwargs):  # the GEMM's result starts as the sentinel
            return y if shape == (R, N) else empty(*shape, **kwargs)

        with mock.patch.object(torch, "empty", result_buffer):
            out = triton_grouped_mm(a, b, offsets, torch.bfloat16, tiles == "fast", cfg)
        assert out is y
        results.append(out)
    assert mismatches(results[0], results[1]) == 0
    assert (results[1][R - 100:] == 7.0).all()


@needs_fp8_triton
@pytest.mark.parametrize("fast_accum", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_triton_gemm_default_tiles_fit_every_result_dtype(fast_accum, out_dtype):
    """The default tiles compile within the GPU's shared memory for BF16 and FP32 results,
    alone and adding into a result (the wide fast tile's FP32 epilogue does not fit an
    sm_90 SM), and equal the emulation (``FAST_ACCUM_REL`` in norm)."""
    R, K, N, E = 8192, 2048, 1024, 16
    offsets = routed_offsets(R, E)
    end = int(offsets[-1])
    g = torch.Generator(device="cuda").manual_seed(4)
    a = quantize_fp8(torch.randn(R, K, device="cuda", generator=g).bfloat16())
    b = quantize_fp8((torch.randn(E, N, K, device="cuda", generator=g) * 0.02).bfloat16())
    want = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", fast_accum)[:end]
    start = torch.randn(R, N, device="cuda", generator=g).to(out_dtype)
    alone = triton_grouped_mm(a, b, offsets, out_dtype, fast_accum)[:end]
    added = triton_grouped_mm(a, b, offsets, out_dtype, fast_accum, accumulate_into=start.clone())[:end]
    assert _relative_error(alone, want) < FAST_ACCUM_REL
    assert _relative_error(added.float() - start[:end].float(), want) < FAST_ACCUM_REL


@needs_fp8_triton
@pytest.mark.parametrize(("recipe", "fast_accum"), [("fp8_rowwise_gw_hp", ()),
                                                    ("fp8_rowwise_gw_hp", ("output",)),
                                                    ("fp8_blockwise", ()),
                                                    ("fp8_blockwise_gw_fp8", ())])
def test_triton_experts_match_emulated_experts(recipe, fast_accum):
    """The whole layer on the Triton GEMM against the emulation (``LAYER_REL``; blockwise
    scales promote every K block, so its limit is the FP32 one)."""
    triton_layer = _experts(gemm="triton", recipe=recipe, fast_accum=fast_accum)
    emulated = FP8GroupedExperts(triton_layer.w1, triton_layer.w3, triton_layer.w2, recipe=recipe,
                                 gemm="emulated")
    _layers_agree(triton_layer, emulated, LAYER_REL[() if recipe.startswith("fp8_blockwise") else fast_accum])


@needs_sm90
@pytest.mark.parametrize(("recipe", "gemm", "fast_accum"),
                         [("fp8_rowwise", "native", ()), ("fp8_rowwise", "native", ("output",)),
                          ("fp8_rowwise_gw_hp", "native", ("output", "grad_input")),
                          ("fp8_rowwise", "triton", ()), ("fp8_blockwise", "triton", ()),
                          ("fp8_blockwise_gw_fp8", "triton", ())])
def test_fp8_linear_matches_the_emulation(recipe, gemm, fast_accum):
    """A dense layer (``torch._scaled_mm`` natively, the grouped Triton GEMM over one group)
    against the emulation of the same operands: output, input and weight gradients, in
    norm (FP32 promotion: accumulation order and the BF16 rounding only)."""
    g = torch.Generator(device="cuda").manual_seed(4)
    weight = torch.nn.Parameter((torch.randn(1024, 2048, device="cuda", generator=g) * 0.02).bfloat16())
    x = torch.randn(4, 1000, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(4, 1000, 1024, device="cuda", generator=g).bfloat16()
    outs = []
    for layer in (FP8Linear(weight, recipe=recipe, gemm=gemm, fast_accum=fast_accum),
                  FP8Linear(weight, recipe=recipe, gemm="emulated")):
        y = layer(x)
        outs.append((y, *torch.autograd.grad(y, [x, weight], dy)))
    for got, want in zip(*outs, strict=True):
        assert _relative_error(got, want) < (FAST_ACCUM_REL if fast_accum else 2e-3)


@needs_sm90
@pytest.mark.parametrize("gemm", ["native", "triton"])
def test_fp8_linears_sharing_an_input_match_separate_calls(gemm):
    """Attention's q, k and v at bench-1gpu's shapes through ``shared_input_forward``: the
    outputs and weight gradients of separate calls bit for bit, the input gradient (added
    in the Triton GEMM's epilogue, rounded once) within BF16 rounding of theirs."""
    g = torch.Generator(device="cuda").manual_seed(5)
    weights = [torch.nn.Parameter((torch.randn(n, 2048, device="cuda", generator=g) * 0.02).bfloat16())
               for n in (2048, 512, 512)]
    x = torch.randn(8192, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    dys = [torch.randn(8192, w.shape[0], device="cuda", generator=g).bfloat16() for w in weights]
    outs = []
    for shared in (False, True):
        layers = tuple(FP8Linear(w, recipe="fp8_rowwise_gw_hp", gemm=gemm,
                                 fast_accum=("output", "grad_input")) for w in weights)
        ys = FP8Linear.shared_input_forward(x, layers) if shared else tuple(layer(x) for layer in layers)
        outs.append((ys, torch.autograd.grad(ys, [x, *weights], dys)))
    (ys0, (dx0, *dw0)), (ys1, (dx1, *dw1)) = outs
    for a, b in zip([*ys0, *dw0], [*ys1, *dw1], strict=True):
        assert torch.equal(a, b)
    assert _relative_error(dx1, dx0) < 4e-3


@needs_fp8_triton
@pytest.mark.parametrize("recipe", ["fp8_rowwise_gw_hp", "fp8_blockwise", "fp8_blockwise_gw_fp8"])
def test_no_host_sync_in_a_warm_triton_step(recipe):
    layer = _experts(E=8, D=256, F=128, gemm="triton", recipe=recipe)
    offsets = torch.tensor([100, 100, 250, 300, 512, 600, 700, 1024], dtype=torch.int32,
                           device="cuda")
    rows = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_no_host_sync(lambda: layer(rows, offsets).sum().backward())


@needs_sm90
def test_no_host_sync_in_a_warm_native_step():
    layer = _experts(E=8, D=256, F=128)
    offsets = torch.tensor([100, 100, 250, 300, 512, 600, 700, 1024], dtype=torch.int32,
                           device="cuda")
    rows = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert_no_host_sync(lambda: layer(rows, offsets).sum().backward())
