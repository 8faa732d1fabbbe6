"""Scaled E4M3 formats for Hopper's FP8 tensor cores: rowwise and blockwise.

One FP32 scale per block of a matrix ``[..., M, N]``; ``block = (bm, bn)``:

- ``(1, 0)``: rowwise, one scale per row (``0`` = the whole axis): torchao's float8
  "rowwise" recipe, with power-of-two scales (``pow2=True``, that recipe's default);
- ``(1, 128)``: DeepSeek-V3's activation tiles, ``(128, 128)``: its weight blocks,
  with FP32 scales (``pow2=False``), as torchao's ``blockwise_fp8_training``.

Numerics (torchao's ``amax_to_scale`` / ``to_fp8_saturated``): ``scale = fp32(448 /
max(amax, 1e-12))`` divided in FP64; with ``pow2`` the scale is rounded down to a power
of two. Elements become ``e4m3(clamp(fp32(x) * scale, -448, 448))`` (nearest even), so
``x ~ data / scale``. ``scale`` is the multiplier (torchao's convention); a GEMM takes its
reciprocal. Non-finite input, documented rather than refused (an overflow shows up as
NaN in the step's loss and gradient norm instead of stopping a kernel):

- a block holding an infinity gets scale 0: its finite elements encode 0 and its
  infinities NaN, so the whole block dequantizes to NaN (``0 * inf``);
- a block holding a NaN gets a NaN scale and dequantizes to NaN;
- all-zero blocks get ``448e12`` (the ``1e-12`` floor) and stay zero; FP32 denormals
  encode as zero.

Power-of-two rounding is exact (the FP32 scale's exponent bits). torchao evaluates
``exp2(floor(log2(s)))`` in FP32, whose ``log2`` rounds up to an integer when ``s`` is
within about 2**-22 (relative) below a power of two, i.e. when a row's ``amax`` lies
within that of ``7 * 2**j`` from above: only there torchao's scale is twice ours
(checked by a test). Bit-identical otherwise, also in the Triton kernels
(``moe_mxfp8._fp8_kernels``), which encode E4M3 without the FP8 conversion instructions.

Weight-gradient operands are quantized along the tokens of each expert's segment,
the result transposed to ``[N, rows]`` (the weight-gradient GEMM reduces over tokens, and
FP8 tensor cores read both operands along the reduction):

- rowwise recipes (``quantize_group_columns``): per group and column one scale, every
  group's start padded to 16 (the FP8 grouped GEMM reads each group's columns at a
  16-byte aligned address), padding zero;
- blockwise recipes (``quantize_group_column_blocks``): per column one scale for each 128
  tokens counted from the group's first row, DeepSeek-V3's "128x1" activation tiles of
  its weight-gradient GEMM (torchao's ``blockwise_fp8_training`` quantizes its right-hand
  operand the same way); every group's start padded to 128, so that each scale block is
  one aligned 128-column slot of the result.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moe_mxfp8._triton_support import Backend, resolve_backend

E4M3_MAX = 448.0
EPS = 1e-12  # torchao's amax floor
GROUP_ALIGN = 16  # FP8 grouped GEMMs over tokens: each group starts at a multiple of this
TOKEN_BLOCK = 128  # blockwise weight-gradient operands: one scale per column and this many tokens
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32_EXP_MASK = 0x7F800000


@dataclass(frozen=True)
class FP8Tensor:
    """E4M3 ``data`` ``[..., M, N]`` and FP32 ``scale`` ``[..., ceil(M/bm), ceil(N/bn)]``
    (``bn = 0``: one column), ``x ~ data / scale``."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self, dtype)


def fp8_nbytes(shape: tuple[int, ...], block: tuple[int, int]) -> int:
    """Bytes of the ``FP8Tensor`` :func:`quantize_fp8` makes of a ``shape`` tensor (its
    ``nbytes``): one byte per element, one FP32 scale per ``block`` (partial blocks count)."""
    bm, bn = check_block(tuple(block))
    *lead, M, N = shape
    n_scales = math.prod(lead) * -(-M // bm) * (1 if bn == 0 else -(-N // bn))
    return math.prod(shape) + 4 * n_scales


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    bm, bn = block
    if bm not in (1, 128) or bn not in (0, 128) or (bm, bn) == (128, 0):
        raise ValueError(f"block must be (1, 0), (1, 128) or (128, 128), got {block!r}")
    return bm, bn


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"x must be [..., M, N], got {x.dim()} dims")


def _check_columns_input(x: torch.Tensor, offsets: torch.Tensor) -> None:
    _check_input(x)
    if x.dim() != 2:
        raise ValueError(f"x must be [R, N], got {tuple(x.shape)}")
    if offsets.dim() != 1 or offsets.dtype != torch.int32:
        raise ValueError(f"offsets must be int32 [E], got {offsets.dtype} {tuple(offsets.shape)}")


# --- pure-torch reference -------------------------------------------------------------


def scale_from_amax(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """FP32 scale of blocks with FP32 ``amax`` (NaN where ``amax`` is NaN)."""
    scale = (E4M3_MAX / amax.double().clamp_min(EPS)).float()
    if pow2:  # the exponent bits: the largest power of two not above ``scale``
        scale = (scale.view(torch.int32) & _F32_EXP_MASK).view(torch.float32)
    return torch.where(amax.isnan(), float("nan"), scale)


def to_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating, nearest-even E4M3 of FP32 values (NaN stays NaN)."""
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _blocks_view(x: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, int, int]:
    """FP32 ``x [..., M, N]`` zero-padded to whole blocks, as ``[..., Mb, bm, Nb, bn]``."""
    M, N = x.shape[-2:]
    nb = 1 if bn == 0 else -(-N // bn)
    bn = bn or max(N, 1)
    mb = -(-M // bm)
    padded = F.pad(x.float(), (0, nb * bn - N, 0, mb * bm - M))
    return padded.reshape(*x.shape[:-2], mb, bm, nb, bn), mb * bm, nb * bn


def quantize_fp8_reference(x: torch.Tensor, block: tuple[int, int] = (1, 0), pow2: bool = True) -> FP8Tensor:
    """The eager reference of :func:`quantize_fp8` (any device): the same contract and bits."""
    _check_input(x)
    block = check_block(tuple(block))
    bm, bn = block
    M, N = x.shape[-2:]
    blocks, Mp, Np = _blocks_view(x, bm, bn)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    amax = torch.where(blocks.isnan().any(dim=(-3, -1), keepdim=True), float("nan"), amax)
    scale = scale_from_amax(amax, pow2)
    # a clone: a slice of whole padded rows is contiguous already and would keep the padding
    data = to_e4m3(blocks * scale).reshape(*x.shape[:-2], Mp, Np)[..., :M, :N].clone(
        memory_format=torch.contiguous_format)
    return FP8Tensor(data, scale.squeeze(-1).squeeze(-2).contiguous(), block)


def dequantize_fp8(t: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * (1 / scale)`` in FP32 (the reciprocal a GEMM applies), then ``dtype``."""
    bm, bn = t.block
    M, N = t.data.shape[-2:]
    inv = t.scale.reciprocal()
    inv = inv.repeat_interleave(bm, dim=-2)[..., :M, :]
    inv = inv.repeat_interleave(bn or max(N, 1), dim=-1)[..., :N]
    return (t.data.float() * inv).to(dtype)


def quantize_group_columns_reference(x: torch.Tensor, offsets: torch.Tensor, pow2: bool = True
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager reference of :func:`quantize_group_columns` (any device; reads the offsets
    on the host): the same contract and bits."""
    _check_columns_input(x, offsets)
    padded_ends = padded_group_ends(offsets)
    rows_out = group_columns_width(x.shape[0], offsets.shape[0])
    N = x.shape[1]
    data_t = torch.zeros(N, rows_out, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(offsets.shape[0], N, dtype=torch.float32, device=x.device)
    start = padded_start = 0
    for e, (end, padded_end) in enumerate(zip(offsets.tolist(), padded_ends.tolist(), strict=True)):
        seg = x[start:end].float()
        amax = seg.abs().amax(0) if end > start else seg.new_zeros(N)
        amax = torch.where(seg.isnan().any(0), float("nan"), amax)
        scale[e] = scale_from_amax(amax, pow2)
        data_t[:, padded_start:padded_start + end - start] = to_e4m3(seg * scale[e]).t()
        start, padded_start = end, padded_end
    return data_t, scale, padded_ends


def quantize_group_column_blocks_reference(x: torch.Tensor, offsets: torch.Tensor, pow2: bool = False
                                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The eager reference of :func:`quantize_group_column_blocks` (any device; reads the
    offsets on the host): the same contract and bits. One group at a time, so that its
    FP32 temporaries are the largest group's, not the whole operand's."""
    _check_columns_input(x, offsets)
    padded_ends = padded_group_ends(offsets, TOKEN_BLOCK)
    width = group_columns_width(x.shape[0], offsets.shape[0], TOKEN_BLOCK)
    N = x.shape[1]
    data_t = torch.zeros(N, width, dtype=torch.uint8, device=x.device)
    scale = scale_from_amax(x.new_zeros(1, 1, dtype=torch.float32), pow2).expand(
        width // TOKEN_BLOCK, N).contiguous()  # a zero block's, where no group is
    start = slot = 0
    for end, padded_end in zip(offsets.tolist(), padded_ends.tolist(), strict=True):
        n = end - start
        if n:
            seg = F.pad(x[start:end].float(), (0, 0, 0, padded_end - slot - n))  # zero rows
            blocks = seg.view(-1, TOKEN_BLOCK, N)
            amax = torch.where(blocks.isnan().any(1), float("nan"), blocks.abs().amax(1))
            block_scale = scale_from_amax(amax, pow2)
            scale[slot // TOKEN_BLOCK:padded_end // TOKEN_BLOCK] = block_scale
            codes = to_e4m3(blocks * block_scale[:, None, :]).view(-1, N)[:n]
            data_t[:, slot:slot + n] = codes.view(torch.uint8).t()
        start, slot = end, padded_end
    return data_t.view(torch.float8_e4m3fn), scale, padded_ends


# --- public API -----------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor, block: tuple[int, int] = (1, 0), pow2: bool = True,
                 backend: Backend = "auto") -> FP8Tensor:
    """Quantize ``x [..., M, N]`` with one scale per ``block`` (see the module notes).

    ``backend``: ``"auto"`` (the Triton kernel where ``fused_kernels_enabled``),
    ``"triton"`` or ``"reference"`` (:func:`quantize_fp8_reference`); the reference
    switch takes the reference whatever it says."""
    _check_input(x)
    block = check_block(tuple(block))
    if resolve_backend(backend, x.device):
        from moe_mxfp8._fp8_kernels import quantize_blocks

        data, scale = quantize_blocks(x, block, pow2)
        return FP8Tensor(data, scale, block)
    return quantize_fp8_reference(x, block, pow2)


def cat_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The weight ``cat(parts, dim=-2)`` of its parts (no copy for one part)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)


def quantize_weight_rowwise(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], pow2: bool = True,
                            out: tuple[FP8Tensor, FP8Tensor] | None = None,
                            backend: Backend = "auto") -> tuple[FP8Tensor, FP8Tensor]:
    """Both rowwise copies of the weight ``w = cat(parts, dim=-2) [..., M, K]``: ``rows``
    (``w`` scaled along ``K``) and ``cols`` (``w`` transposed to ``[..., K, M]``,
    contiguous, scaled along ``M``), bit for bit ``quantize_fp8(w)`` and
    ``quantize_fp8(w.mT.contiguous())``.

    ``parts``: one or two ``[..., M_i, K]`` (gate and up), of one dtype and device.
    ``out``: write into these copies (e.g. a cache whose addresses a captured CUDA graph
    reads) and return them. On the Triton path neither the concatenation nor the BF16
    transpose is built: each part is quantized straight into its rows of ``rows``, and
    the columns kernel reads the parts where they lie (weights with few column strips,
    such as one LM head, take the transposed copy: ``_fp8_kernels.quantize_weight_cols_t``).
    """
    parts, (rows, cols) = _weight_copies(parts, (1, 0), out)
    if not resolve_backend(backend, parts[0].device):
        _reference_weight_copies(parts, (1, 0), pow2, rows, cols)
        return rows, cols
    from moe_mxfp8._fp8_kernels import quantize_blocks, quantize_weight_cols_t

    start = 0
    for t in parts:
        m = t.shape[-2]
        quantize_blocks(t, (1, 0), pow2, out=(rows.data[..., start:start + m, :],
                                              rows.scale[..., start:start + m, :]))
        start += m
    if not quantize_weight_cols_t(parts, cols.data, cols.scale, pow2):
        quantize_blocks(cat_parts(parts).mT, (1, 0), pow2, out=(cols.data, cols.scale))
    return rows, cols


def quantize_weight_blocks(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], pow2: bool = False,
                           out: tuple[FP8Tensor, FP8Tensor] | None = None,
                           backend: Backend = "auto") -> tuple[FP8Tensor, FP8Tensor]:
    """Both 128x128-block copies of the weight ``w = cat(parts, dim=-2) [..., M, K]``:
    ``rows`` (``w``'s blocks) and ``cols`` (``w`` transposed to ``[..., K, M]``,
    contiguous), bit for bit ``quantize_fp8(w, (128, 128))`` and
    ``quantize_fp8(w.mT.contiguous(), (128, 128))``: a square block of the transpose holds
    the same elements, so its codes and scale are the transposes of the block's.

    ``parts`` and ``out`` as :func:`quantize_weight_rowwise`'s. On the Triton path one pass
    per part reads it once and writes both copies (codes and scales transposed in the
    same kernel); parts are concatenated first only where one ends inside a block (rows
    not a multiple of 128 before the last part).
    """
    parts, (rows, cols) = _weight_copies(parts, (128, 128), out)
    if not resolve_backend(backend, parts[0].device):
        _reference_weight_copies(parts, (128, 128), pow2, rows, cols)
        return rows, cols
    from moe_mxfp8._fp8_kernels import quantize_blocks

    if any(t.shape[-2] % 128 for t in parts[:-1]):
        parts = [cat_parts(parts)]
    start = 0
    for t in parts:
        m, b0, b1 = t.shape[-2], start // 128, -(-(start + t.shape[-2]) // 128)
        quantize_blocks(t, (128, 128), pow2,
                        out=(rows.data[..., start:start + m, :], rows.scale[..., b0:b1, :]),
                        out_t=(cols.data[..., start:start + m], cols.scale[..., b0:b1]))
        start += m
    return rows, cols


def _weight_copies(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], block: tuple[int, int],
                   out: tuple[FP8Tensor, FP8Tensor] | None
                   ) -> tuple[list[torch.Tensor], tuple[FP8Tensor, FP8Tensor]]:
    """The checked parts of a weight ``cat(parts, dim=-2) [..., M, K]`` and its two copies
    (``out``, checked, or new): ``[..., M, K]`` and ``[..., K, M]`` E4M3 with ``block``'s
    scales (rowwise: one per row)."""
    parts = list(parts)
    if len(parts) not in (1, 2):
        raise ValueError(f"parts: one or two tensors, got {len(parts)}")
    for t in parts:
        _check_input(t)
    a = parts[0]
    if any(t.dtype != a.dtype or t.device != a.device or t.shape[:-2] != a.shape[:-2]
           or t.shape[-1] != a.shape[-1] for t in parts):
        raise ValueError("parts: one dtype and device, and shapes [..., M_i, K] that differ only "
                         f"in M_i, got {[(tuple(t.shape), t.dtype) for t in parts]}")
    lead, K = list(a.shape[:-2]), a.shape[-1]
    M = sum(t.shape[-2] for t in parts)

    def scale_shape(m: int, n: int) -> tuple[int, ...]:
        return (*lead, m, 1) if block == (1, 0) else (*lead, -(-m // block[0]), -(-n // block[1]))

    if out is None:
        out = tuple(FP8Tensor(torch.empty(*lead, m, n, dtype=torch.float8_e4m3fn, device=a.device),
                              torch.empty(scale_shape(m, n), dtype=torch.float32, device=a.device), block)
                    for m, n in ((M, K), (K, M)))
    for name, t, (m, n) in zip(("rows", "cols"), out, ((M, K), (K, M)), strict=True):
        want = ((*lead, m, n), scale_shape(m, n), torch.float8_e4m3fn, a.device)
        if (tuple(t.data.shape), tuple(t.scale.shape), t.data.dtype, t.data.device) != want:
            raise ValueError(f"out {name}: expected E4M3 {want[0]} and FP32 scale {want[1]} on "
                             f"{a.device}, got {t.data.dtype} {tuple(t.data.shape)} and "
                             f"{tuple(t.scale.shape)} on {t.data.device}")
    return parts, out


def _reference_weight_copies(parts: list[torch.Tensor], block: tuple[int, int], pow2: bool,
                             rows: FP8Tensor, cols: FP8Tensor) -> None:
    """The reference's copies, one matrix of a stacked weight (``[E, M, K]``: one expert) at a
    time, so that its FP32 temporaries are one matrix's, not the stack's."""
    for index in itertools.product(*(range(n) for n in parts[0].shape[:-2])):
        weight = cat_parts([t[index] for t in parts])
        for dst, src in ((rows, weight), (cols, weight.mT)):
            ref = quantize_fp8_reference(src, block, pow2)
            dst.data[index].copy_(ref.data)
            dst.scale[index].copy_(ref.scale)


def padded_group_ends(offsets: torch.Tensor, align: int = GROUP_ALIGN) -> torch.Tensor:
    """Cumulative group ends with every group's size rounded up to ``align`` (on the device)."""
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return ((sizes + align - 1) // align * align).cumsum(0).to(torch.int32)


def group_columns_width(rows: int, n_groups: int, align: int = GROUP_ALIGN) -> int:
    """Columns of the transposed weight-gradient operand: room for every group padded."""
    return -(-rows // align) * align + n_groups * align


class GroupColumnsLayout(NamedTuple):
    """Where :func:`quantize_group_columns` puts the groups of one ``offsets``, on the device:
    the padded group ends ``[E]`` int32 and, on the Triton path, the order its programs
    take the groups in (``None``: by index). Every operand quantized over the same groups
    (both operands of a weight gradient) can share one."""

    padded_ends: torch.Tensor
    program_order: torch.Tensor | None


def group_columns_layout(offsets: torch.Tensor, backend: Backend = "auto") -> GroupColumnsLayout:
    """The layout of the groups ``offsets`` (int32 ``[E]`` cumulative ends) for
    :func:`quantize_group_columns` with ``backend``."""
    order = None
    if resolve_backend(backend, offsets.device):
        from moe_mxfp8._fp8_kernels import group_columns_program_order

        order = group_columns_program_order(offsets)
    return GroupColumnsLayout(padded_group_ends(offsets), order)


def quantize_group_columns(x: torch.Tensor, offsets: torch.Tensor, pow2: bool = True,
                           backend: Backend = "auto", layout: GroupColumnsLayout | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert segment and column of ``x [R, N]``: one scale over the segment's rows.

    Returns ``data_t [N, W]`` (E4M3, ``x``'s segments transposed, each starting at a
    multiple of 16, zeros between; ``W = group_columns_width(R, E)``; columns past the
    last padded end are unspecified), ``scale [E, N]``
    and the padded group ends ``[E]`` int32. Rows past ``offsets[-1]`` are ignored; an
    empty group's scales are those of a zero block. Offsets stay on the device (on the
    Triton path; :func:`quantize_group_columns_reference` reads them). ``backend`` as
    :func:`quantize_fp8`'s. ``layout``: ``group_columns_layout(offsets, backend)``, made
    once for several operands over the same offsets (not checked: that would read them on
    the host); by default made here.
    """
    _check_columns_input(x, offsets)
    if not resolve_backend(backend, x.device):
        return quantize_group_columns_reference(x, offsets, pow2)
    from moe_mxfp8._fp8_kernels import quantize_group_columns_t

    layout = layout or group_columns_layout(offsets, backend)
    width = group_columns_width(x.shape[0], offsets.shape[0])
    data_t, scale = quantize_group_columns_t(x, offsets, layout.padded_ends, layout.program_order,
                                             width, pow2)
    return data_t, scale, layout.padded_ends


def quantize_group_column_blocks(x: torch.Tensor, offsets: torch.Tensor, pow2: bool = False,
                                 backend: Backend = "auto", padded_ends: torch.Tensor | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per expert segment of ``x [R, N]`` and column: one scale for each 128 rows, counted
    from the segment's first row (module notes).

    Returns ``data_t [N, W]`` (E4M3, ``x``'s segments transposed, each starting at a
    multiple of 128, zeros in the padding and past the last group;
    ``W = group_columns_width(R, E, 128)``), ``scale [W / 128, N]`` (row ``j``: the
    columns ``128 j`` to ``128 j + 127`` of ``data_t``; a block of padding alone has a zero
    block's scale) and the padded group ends ``[E]`` int32. Rows past ``offsets[-1]`` are
    ignored. Offsets stay on the device (on the Triton path;
    :func:`quantize_group_column_blocks_reference` reads them). ``backend`` as
    :func:`quantize_fp8`'s. ``padded_ends``: ``padded_group_ends(offsets, 128)``, made once
    for several operands over the same offsets (not checked: that would read them on the
    host); by default made here.
    """
    _check_columns_input(x, offsets)
    if not resolve_backend(backend, x.device):
        return quantize_group_column_blocks_reference(x, offsets, pow2)
    from moe_mxfp8._fp8_kernels import quantize_group_column_blocks_t

    if padded_ends is None:
        padded_ends = padded_group_ends(offsets, TOKEN_BLOCK)
    width = group_columns_width(x.shape[0], offsets.shape[0], TOKEN_BLOCK)
    data_t, scale = quantize_group_column_blocks_t(x, offsets, padded_ends, width, pow2)
    return data_t, scale, padded_ends
