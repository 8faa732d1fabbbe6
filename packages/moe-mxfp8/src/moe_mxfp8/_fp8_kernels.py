"""Triton kernels for the scaled E4M3 formats of ``moe_mxfp8.fp8``, bit-identical to its
torch reference on the GPU and under ``TRITON_INTERPRET=1``.

Imported lazily, like ``moe_mxfp8._quantize_kernels`` (whose exact E4M3 encoding they share: no
FP8 conversion instruction, whose subnormal and tie handling differs between the
hardware and the interpreter).

- ``quantize_blocks``: one program per tile of ``[B, M, N]``: ``ROWS`` rows by ``GROUPS``
  scale blocks side by side (a whole row, 128-column tiles, or 128x128 blocks); amax is
  an integer max over ``|x|`` bit patterns (NaN sorts above inf). 128x128 blocks either
  sit whole in registers (one read) or, with ``CHUNK``, are walked twice in chunks of
  rows, for the amax and then for the encoding, the second read mostly from L2: fewer
  registers per program, so more programs per SM hide the load latency.
- ``quantize_group_columns_t``: two launches over the same grid of (slot tile, column
  strip) tiles of the transposed output ``[N, W]``, where each expert's rows occupy a
  16-aligned run of slots: the first takes every column's amax per expert (an integer
  ``atomic_max`` of ``|x|`` bits, so the order does not matter), the second scales,
  encodes and writes the tile transposed (zeros in the padding). A tile serves the
  experts its slots meet, found from the padded ends on the device, so the work is
  spread evenly however the tokens are routed (a program per expert and strip left the
  busiest expert's strips to walk alone under Zipf routing: 0.95 TB/s on one H200). The
  price is a second read of ``x``.

Exactness: the scale is ``448 / amax`` divided in FP64 (IEEE on the GPU: ``div.rn.f64``)
and rounded once to FP32; the ``1e-12`` floor is applied by comparing FP32 bit patterns
(no FP32 rounding of the constant). Kernels launch with ``enable_fp_fusion=False`` so the
scaled value ``|x| * scale`` is rounded to FP32 before the E4M3 rounding step (an FMA
would skip that rounding; it matters for non-power-of-two scales).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_mxfp8._quantize_kernels import _abs_sign, _bits_view, _e4m3, _load_abs_sign
from moe_mxfp8._triton_support import _interpreting
from moe_mxfp8.fp8 import E4M3_MAX, EPS
from moe_mxfp8.fp8_gemm import _sm_count


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


# amax below the floor: FP32 bit patterns under that of the smallest FP32 >= 1e-12.
_EPS_F32 = torch.tensor(EPS, dtype=torch.float64).float().item()
_EPS_BITS = _f32_bits(_EPS_F32) + (1 if _EPS_F32 < EPS else 0)
_SCALE_AT_EPS = torch.tensor(E4M3_MAX / EPS, dtype=torch.float64).float().item()


@triton.jit
def _scale(amax_bits, POW2: tl.constexpr, EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr):
    """FP32 scale of blocks whose ``|x|`` maximum has FP32 bits ``amax_bits`` (uint32)."""
    amax = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    s = (448.0 / amax).to(tl.float32)
    s = tl.where(amax_bits < EPS_BITS, SCALE_AT_EPS, s)
    if POW2:
        s = (s.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax_bits > 0x7F800000, float("nan"), s)


@triton.jit
def _encode(abs_bits, sign, scale):
    """E4M3 bytes of ``x * scale`` (saturating; NaN where the product is NaN)."""
    q, _ = _e4m3(abs_bits, sign, scale, tl.full([], 126, tl.uint32))
    a = abs_bits.to(tl.float32, bitcast=True) * scale
    return tl.where(a != a, 0x7F, q).to(tl.uint8)


@triton.jit
def _quantize_blocks_kernel(
    x_ptr, sx_b, sx_m, d_ptr, sd_b, sd_m, s_ptr, ss_b, ss_m, M, N, n_scales,
    ROWS: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr, SQUARE: tl.constexpr,
    CHUNK: tl.constexpr, POW2: tl.constexpr, IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr,
    SCALE_AT_EPS: tl.constexpr,
):
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if SQUARE and CHUNK > 0:
        _quantize_square_in_chunks(x_ptr + b * sx_b, sx_m, d_ptr + b * sd_b, sd_m,
                                   s_ptr + b * ss_b + pid_m * ss_m, pid_m, pid_n, M, N, n_scales,
                                   ROWS, BN, GROUPS, CHUNK, POW2, IN_BF16, EPS_BITS, SCALE_AT_EPS)
        return
    rows = (pid_m * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (pid_n * GROUPS * BN + tl.arange(0, GROUPS * BN))[None, :]
    mask = (rows < M) & (cols < N)
    abs_bits, sign = _load_abs_sign(x_ptr + b * sx_b + rows * sx_m + cols, mask, IN_BF16)
    if GROUPS > 1:  # [ROWS, GROUPS, BN]: one amax per row (or block) and group
        amax = tl.max(tl.reshape(abs_bits, (ROWS, GROUPS, BN)), axis=2)
        if SQUARE:
            amax = tl.max(amax, axis=0, keep_dims=True)
        scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)  # [ROWS or 1, GROUPS]
        spread = tl.reshape(tl.broadcast_to(scale[:, :, None], (ROWS, GROUPS, BN)),
                            (ROWS, GROUPS * BN))
        tl.store(d_ptr + b * sd_b + rows * sd_m + cols, _encode(abs_bits, sign, spread), mask=mask)
        groups = (pid_n * GROUPS + tl.arange(0, GROUPS))[None, :]
        if SQUARE:
            tl.store(s_ptr + b * ss_b + pid_m * ss_m + groups, scale, mask=groups < n_scales)
        else:
            tl.store(s_ptr + b * ss_b + rows * ss_m + groups, scale,
                     mask=(rows < M) & (groups < n_scales))
        return
    if SQUARE:
        amax = tl.max(tl.max(abs_bits, axis=1, keep_dims=True), axis=0, keep_dims=True)
    else:
        amax = tl.max(abs_bits, axis=1, keep_dims=True)
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(d_ptr + b * sd_b + rows * sd_m + cols, _encode(abs_bits, sign, scale), mask=mask)
    if SQUARE:
        tl.store(s_ptr + b * ss_b + pid_m * ss_m + pid_n + tl.zeros([1, 1], tl.int32), scale)
    else:
        tl.store(s_ptr + b * ss_b + rows * ss_m + pid_n, scale, mask=rows < M)


@triton.jit
def _quantize_square_in_chunks(x_ptr, sx_m, d_ptr, sd_m, s_ptr, pid_m, pid_n, M, N, n_scales,
                               ROWS: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
                               CHUNK: tl.constexpr, POW2: tl.constexpr, IN_BF16: tl.constexpr,
                               EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr):
    """``GROUPS`` square blocks side by side, ``CHUNK`` rows at a time: their amax over
    every chunk, then each chunk read again, encoded and stored; ``s_ptr`` points at the
    blocks' row of scales."""
    cols = (pid_n * GROUPS * BN + tl.arange(0, GROUPS * BN))[None, :]
    amax = tl.zeros([GROUPS], tl.uint32)
    for r0 in range(0, ROWS, CHUNK):
        rows = (pid_m * ROWS + r0 + tl.arange(0, CHUNK)).to(tl.int64)[:, None]
        abs_bits, _ = _load_abs_sign(x_ptr + rows * sx_m + cols, (rows < M) & (cols < N), IN_BF16)
        chunk_max = tl.max(tl.reshape(abs_bits, (CHUNK, GROUPS, BN)), axis=2)
        amax = tl.maximum(amax, tl.max(chunk_max, axis=0))
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)  # [GROUPS]
    spread = tl.reshape(tl.broadcast_to(scale[None, :, None], (CHUNK, GROUPS, BN)),
                        (CHUNK, GROUPS * BN))
    for r0 in range(0, ROWS, CHUNK):
        rows = (pid_m * ROWS + r0 + tl.arange(0, CHUNK)).to(tl.int64)[:, None]
        mask = (rows < M) & (cols < N)
        abs_bits, sign = _load_abs_sign(x_ptr + rows * sx_m + cols, mask, IN_BF16)
        tl.store(d_ptr + rows * sd_m + cols, _encode(abs_bits, sign, spread), mask=mask)
    groups = pid_n * GROUPS + tl.arange(0, GROUPS)
    tl.store(s_ptr + groups, scale, mask=groups < n_scales)


@triton.jit
def _quantize_square_tma_kernel(
    x_desc, d_desc, s_ptr, ss_b, ss_m, n_mb, n_nb, total,
    BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, POW2: tl.constexpr,
    IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr,
):
    """A persistent walk over the ``[BM, BN]`` blocks of ``[B, M, N]``: each block comes in
    by one tensor-memory-accelerator copy (zeros past the edges, which leave the amax as
    it is), ``STAGES`` blocks in flight, and goes out by one (clipped at the edges)."""
    for blk in tl.range(tl.program_id(0), total, tl.num_programs(0), num_stages=STAGES):
        bn = blk % n_nb
        bm = (blk // n_nb) % n_mb
        b = blk // (n_nb * n_mb)
        abs_bits, sign = _abs_sign(x_desc.load([b, bm * BM, bn * BN]).reshape(BM, BN), IN_BF16)
        amax = tl.max(tl.max(abs_bits, axis=1), axis=0)
        scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
        d_desc.store([b, bm * BM, bn * BN], _encode(abs_bits, sign, scale).reshape(1, BM, BN))
        tl.store(s_ptr + b * ss_b + bm * ss_m + bn, scale)


@triton.jit
def _slot_tile_experts(pends_ptr, s0, E, BS: tl.constexpr, EP: tl.constexpr):
    """The experts whose padded slots ``[pends[e-1], pends[e])`` meet slots ``[s0, s0 + BS)``:
    ``range(e_lo, e_hi)`` (padded ends are non-decreasing)."""
    experts = tl.arange(0, EP)
    pends = tl.load(pends_ptr + experts, mask=experts < E, other=2**31 - 1)
    e_lo = tl.sum((pends <= s0).to(tl.int32))
    e_hi = tl.minimum(E, 1 + tl.sum((pends < s0 + BS).to(tl.int32)))
    return e_lo, e_hi


@triton.jit
def _expert_slots(offs_ptr, pends_ptr, e, slots):
    """Rows of expert ``e`` at ``slots`` and which slots hold one of its rows."""
    e = e + tl.zeros([], tl.int32)  # a loop index is a plain int under the interpreter
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    p_start = tl.load(pends_ptr + e - 1, mask=e > 0, other=0)
    rows = (start + slots - p_start).to(tl.int64)
    return rows, (slots >= p_start) & (slots < p_start + end - start)


@triton.jit
def _group_columns_amax_kernel(
    x_ptr, sx_m, offs_ptr, pends_ptr, amax_ptr, N, E,
    BS: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr, IN_BF16: tl.constexpr,
):
    pid_s, pid_n = tl.program_id(0), tl.program_id(1)
    s0 = pid_s * BS
    slots = s0 + tl.arange(0, BS)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    e_lo, e_hi = _slot_tile_experts(pends_ptr, s0, E, BS, EP)
    for e in range(e_lo, e_hi):
        rows, used = _expert_slots(offs_ptr, pends_ptr, e, slots)
        mask = used[:, None] & col_ok[None, :]
        abs_bits, _ = _load_abs_sign(x_ptr + rows[:, None] * sx_m + cols[None, :], mask, IN_BF16)
        # |x| bits are below 2**31: their int32 order is the uint32 order
        col_max = tl.max(abs_bits, axis=0).to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr + e * N + cols, col_max, mask=col_ok, sem="relaxed")


@triton.jit
def _group_columns_encode_kernel(
    x_ptr, sx_m, offs_ptr, pends_ptr, amax_ptr, d_ptr, sd_n, s_ptr, N, E,
    BS: tl.constexpr, BN: tl.constexpr, EP: tl.constexpr, POW2: tl.constexpr,
    IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr,
):
    pid_s, pid_n = tl.program_id(0), tl.program_id(1)
    s0 = pid_s * BS
    slots = s0 + tl.arange(0, BS)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    if pid_s == 0:  # every expert's scales, empty experts too (their amax stayed 0)
        for e in range(0, E):
            amax = tl.load(amax_ptr + e * N + cols, mask=col_ok, other=0)
            scale = _scale(amax.to(tl.uint32, bitcast=True), POW2, EPS_BITS, SCALE_AT_EPS)
            tl.store(s_ptr + e * N + cols, scale, mask=col_ok)
    e_lo, e_hi = _slot_tile_experts(pends_ptr, s0, E, BS, EP)
    q = tl.zeros([BS, BN], tl.uint8)  # padding slots stay zero
    for e in range(e_lo, e_hi):
        rows, used = _expert_slots(offs_ptr, pends_ptr, e, slots)
        mask = used[:, None] & col_ok[None, :]
        amax = tl.load(amax_ptr + e * N + cols, mask=col_ok, other=0)
        scale = _scale(amax.to(tl.uint32, bitcast=True), POW2, EPS_BITS, SCALE_AT_EPS)
        abs_bits, sign = _load_abs_sign(x_ptr + rows[:, None] * sx_m + cols[None, :], mask, IN_BF16)
        q = tl.where(mask, _encode(abs_bits, sign, scale[None, :]), q)
    p_end = tl.load(pends_ptr + E - 1)
    ptrs = d_ptr + cols.to(tl.int64)[:, None] * sd_n + slots[None, :]
    tl.store(ptrs, tl.trans(q), mask=col_ok[:, None] & (slots < p_end)[None, :])


_CONSTS = dict(EPS_BITS=_EPS_BITS, SCALE_AT_EPS=_SCALE_AT_EPS)


@dataclass(frozen=True)
class BlockTile:
    """Launch shape of ``quantize_blocks``: about ``elements`` per program (whole rows of
    ``groups`` scale blocks side by side; 128x128 blocks: ``groups`` of them per program
    whatever ``elements``), ``warps``; 128x128 blocks only: ``chunk_rows`` rows at a time
    in two passes (0: the whole blocks in registers, one pass)."""

    elements: int
    warps: int
    groups: int = 1
    chunk_rows: int = 0


@dataclass(frozen=True)
class TMABlockTile:
    """Launch shape of ``quantize_blocks`` for 128x128 blocks on the persistent kernel of
    tensor-memory-accelerator copies: ``programs_per_sm`` programs of ``warps`` each walk
    the blocks with ``stages`` of them in flight. Needs rows of 16-byte multiples in and
    out (else the tensor falls back to ``BLOCKS_WITHOUT_TMA``)."""

    warps: int
    stages: int
    programs_per_sm: int = 1


@dataclass(frozen=True)
class ColumnTile:
    """Launch shape of both ``quantize_group_columns_t`` kernels: ``slots`` of the
    transposed output (rows of the input) x ``cols`` columns per program, ``warps``."""

    slots: int
    cols: int
    warps: int


# Tuned on one H200 at the bench shapes (rows [131072, 2048] BF16, weight [64, 2048, 2048],
# Zipf group offsets) by tools/bench_fp8_experts.py's tile sweep, which checks each
# candidate bit-exact first (docs/performance.md, FP8 experts): rows 3.27 TB/s at
# (2048, 2) against 3.04 at (4096, 4); 1x128 tiles 3.04 TB/s at 8 groups per program on
# one warp against 2.96 at 16 groups on 2 warps and 2.55 at one group (`--no-blockwise
# --routing balanced`, commit 27d8ba2); 128x128 blocks 2.47 TB/s one per program on four
# warps in two passes of 32-row chunks, against 2.40 whole in registers at two per program
# on 16 warps (the same command, commit 14f9692); per-expert columns 0.96 at (128, 64, 8)
# against 0.77 at (64, 64, 4).
_TILES: dict[str, BlockTile | TMABlockTile | ColumnTile] = {
    "rows": BlockTile(2048, 2),  # one scale per row
    "tiles": BlockTile(1024, 1, 8),  # 1x128
    "blocks": BlockTile(128 * 128, 4, 1, 32),  # 128x128
    "group_columns": ColumnTile(128, 64, 4),
}
# 128x128 blocks whose rows the tensor memory accelerator cannot take, where "blocks" is a
# TMABlockTile.
BLOCKS_WITHOUT_TMA = BlockTile(128 * 128, 4, 1, 32)


def _block_kind(block: tuple[int, int]) -> str:
    return "blocks" if block[0] > 1 else "rows" if block[1] == 0 else "tiles"


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], pow2: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., M, N]`` -> (E4M3 data, FP32 scales ``[..., ceil(M/bm), ceil(N/bn)]``)."""
    bm, bn = block
    x = x.contiguous()
    M, N = x.shape[-2:]
    B = math.prod(x.shape[:-2])
    n_cols = -(-N // bn) if bn else 1
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*x.shape[:-2], -(-M // bm), n_cols, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return data.view(torch.float8_e4m3fn), scale.fill_(_SCALE_AT_EPS if M and not N else 0)
    tile = _TILES[_block_kind(block)]
    if isinstance(tile, TMABlockTile):
        if _tma_fits(x, N):
            _quantize_square_tma(x, data, scale, tile, pow2)
            return data.view(torch.float8_e4m3fn), scale
        tile = BLOCKS_WITHOUT_TMA
    width = bn or triton.next_power_of_2(N)
    groups = tile.groups if bn else 1  # a whole row is one group
    rows = bm if bm > 1 else max(1, tile.elements // (groups * width))
    x3, d3, s3 = (t.reshape(B, t.shape[-2], t.shape[-1]) for t in (_bits_view(x), data, scale))
    grid = (triton.cdiv(M, rows), triton.cdiv(n_cols, groups), B)
    _quantize_blocks_kernel[grid](
        x3, x3.stride(0), x3.stride(1), d3, d3.stride(0), d3.stride(1),
        s3, s3.stride(0), s3.stride(1), M, N, n_cols,
        ROWS=rows, BN=width, GROUPS=groups, SQUARE=bm > 1,
        CHUNK=tile.chunk_rows if bm > 1 else 0, POW2=pow2,
        IN_BF16=x.dtype == torch.bfloat16,
        num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
    )
    return data.view(torch.float8_e4m3fn), scale


def _tma_fits(x: torch.Tensor, N: int) -> bool:
    """Whether the copy engines of the tensor memory accelerator take ``x`` and its E4M3
    codes: rows of 16-byte multiples at 16-byte aligned addresses, on sm_90 and later."""
    if N % 16 or x.data_ptr() % 16:
        return False
    return _interpreting() or torch.cuda.get_device_capability(x.device)[0] >= 9


def _quantize_square_tma(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                         tile: TMABlockTile, pow2: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, N = x.shape[-2:]
    B = math.prod(x.shape[:-2])
    x3 = _bits_view(x).reshape(B, M, N)
    s3 = scale.reshape(B, scale.shape[-2], scale.shape[-1])
    n_mb, n_nb = s3.shape[1:]
    total = B * n_mb * n_nb
    sms = 1 if x.device.type != "cuda" else _sm_count(x.device.index or 0)
    _quantize_square_tma_kernel[(min(total, tile.programs_per_sm * sms),)](
        TensorDescriptor.from_tensor(x3, [1, 128, 128]),
        TensorDescriptor.from_tensor(data.view(B, M, N), [1, 128, 128]),
        s3, s3.stride(0), s3.stride(1), n_mb, n_nb, total,
        BM=128, BN=128, STAGES=tile.stages, POW2=pow2, IN_BF16=x.dtype == torch.bfloat16,
        num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
    )


def quantize_group_columns_t(x: torch.Tensor, offsets: torch.Tensor, padded_ends: torch.Tensor,
                             width: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``moe_mxfp8.fp8.quantize_group_columns``; returns ``(data_t [N, width], scale [E, N])``."""
    x = x.contiguous()
    R, N = x.shape
    E = offsets.shape[0]
    data_t = torch.empty(N, width, dtype=torch.uint8, device=x.device)
    scale = torch.empty(E, N, dtype=torch.float32, device=x.device)
    if N and E:
        tile = _TILES["group_columns"]
        grid = (triton.cdiv(width, tile.slots), triton.cdiv(N, tile.cols))
        amax = torch.zeros(E, N, dtype=torch.int32, device=x.device)
        meta = dict(BS=tile.slots, BN=tile.cols, EP=triton.next_power_of_2(E),
                    IN_BF16=x.dtype == torch.bfloat16, num_warps=tile.warps)
        _group_columns_amax_kernel[grid](_bits_view(x), x.stride(0), offsets, padded_ends, amax,
                                         N, E, **meta)
        _group_columns_encode_kernel[grid](
            _bits_view(x), x.stride(0), offsets, padded_ends, amax, data_t, data_t.stride(0),
            scale, N, E, POW2=pow2, enable_fp_fusion=False, **meta, **_CONSTS,
        )
    return data_t.view(torch.float8_e4m3fn), scale
