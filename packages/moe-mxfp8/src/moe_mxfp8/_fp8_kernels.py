"""Triton kernels for the scaled E4M3 formats of ``moe_mxfp8.fp8``, bit-identical to its
torch reference on the GPU and under ``TRITON_INTERPRET=1``.

Imported lazily, like ``moe_mxfp8._quantize_kernels``, whose exact E4M3 encoding they share.
They use no FP8 conversion instruction: its subnormal and tie handling differs between
the hardware and the interpreter, and ``tl.float8e4nv`` casts compiled by Triton 3.6 for
an H100 wrote wrong bytes in some layouts while exact in others (docs/performance.md,
"FP8 experts on Hopper", "Quantisation kernels": the failures and the tests that found them).

- ``quantize_blocks``: one program per tile of ``[B, M, N]``: ``ROWS`` rows by ``GROUPS``
  scale blocks side by side (a whole row, 128-column tiles, or 128x128 blocks; rows
  wider than ``ROW_WIDTH_MAX`` one per program, walked twice in chunks); amax is
  an integer max over ``|x|`` bit patterns (NaN sorts above inf); the passes that walk
  chunks keep an elementwise running max and reduce it across threads once, after the
  loop, instead of once per chunk (a reduction across warps per chunk is a shared-memory
  round trip and a barrier that stalls the next chunk's loads). 128x128 blocks either
  sit whole in registers (one read) or, with ``CHUNK``, are walked twice in chunks of
  rows, for the amax and then for the encoding, the second read mostly from L2: fewer
  registers per program, so more programs per SM hide the load latency.
- ``quantize_group_columns_t``: one program per (expert, column strip): a pass over the
  expert's rows for the column amax, a second (last rows first: those most likely still
  in L2) that scales, encodes and writes the strip transposed into the expert's
  16-aligned slot of ``[N, W]`` (zeros in the padding), four slots' bytes per 32-bit word
  so that the transpose moves words; the busiest experts' programs start first. Offsets
  are read on the device.
- ``quantize_group_column_blocks_t``: one program per 128-column slot of the ``[N, W]``
  result and column strip: it finds the expert whose 128-aligned slot holds it on the
  device, reads those up to 128 rows once, and writes their scale and transposed codes
  (zeros past the expert's rows).
- ``quantize_weight_cols_t``: the same two passes per (matrix, column strip) of a weight
  stack ``[B, M, K]`` given as one or two parts along ``M`` (gate and up), written into
  ``[B, K, M]``: the input-gradient copy of a rowwise FP8 weight without the BF16
  concatenation and transpose.

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

from moe_mxfp8._quantize_kernels import _bits_view, _e4m3, _load_abs_sign
from moe_mxfp8.fp8 import E4M3_MAX, EPS, TOKEN_BLOCK


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
    dt_ptr, sdt_b, sdt_m, st_ptr, sst_b, sst_m,
    ROWS: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr, SQUARE: tl.constexpr,
    CHUNK: tl.constexpr, POW2: tl.constexpr, IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr,
    SCALE_AT_EPS: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """``TRANSPOSE`` (square blocks): also store the codes transposed, ``[N, M]`` at
    ``dt_ptr``, and the scales transposed at ``st_ptr`` (a square block of the transpose
    holds the same elements, so these are its codes and scales bit for bit)."""
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    if not SQUARE and CHUNK > 0:
        _quantize_rows_in_chunks(x_ptr + b * sx_b, sx_m, d_ptr + b * sd_b, sd_m, s_ptr + b * ss_b,
                                 ss_m, pid_m, M, N, ROWS, CHUNK, POW2, IN_BF16, EPS_BITS,
                                 SCALE_AT_EPS)
        return
    if SQUARE and CHUNK > 0:
        _quantize_square_in_chunks(x_ptr + b * sx_b, sx_m, d_ptr + b * sd_b, sd_m,
                                   s_ptr + b * ss_b + pid_m * ss_m, pid_m, pid_n, M, N, n_scales,
                                   dt_ptr + b * sdt_b, sdt_m, st_ptr + b * sst_b + pid_m, sst_m,
                                   ROWS, BN, GROUPS, CHUNK, POW2, IN_BF16, EPS_BITS, SCALE_AT_EPS,
                                   TRANSPOSE)
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
        codes = _encode(abs_bits, sign, spread)
        tl.store(d_ptr + b * sd_b + rows * sd_m + cols, codes, mask=mask)
        groups = (pid_n * GROUPS + tl.arange(0, GROUPS))[None, :]
        if SQUARE:
            tl.store(s_ptr + b * ss_b + pid_m * ss_m + groups, scale, mask=groups < n_scales)
            if TRANSPOSE:
                _store_transposed(dt_ptr + b * sdt_b, sdt_m, codes, rows, cols, mask)
                tl.store(st_ptr + b * sst_b + groups * sst_m + pid_m, scale, mask=groups < n_scales)
        else:
            tl.store(s_ptr + b * ss_b + rows * ss_m + groups, scale,
                     mask=(rows < M) & (groups < n_scales))
        return
    if SQUARE:
        amax = tl.max(tl.max(abs_bits, axis=1, keep_dims=True), axis=0, keep_dims=True)
    else:
        amax = tl.max(abs_bits, axis=1, keep_dims=True)
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
    codes = _encode(abs_bits, sign, scale)
    tl.store(d_ptr + b * sd_b + rows * sd_m + cols, codes, mask=mask)
    if SQUARE:
        tl.store(s_ptr + b * ss_b + pid_m * ss_m + pid_n + tl.zeros([1, 1], tl.int32), scale)
        if TRANSPOSE:
            _store_transposed(dt_ptr + b * sdt_b, sdt_m, codes, rows, cols, mask)
            tl.store(st_ptr + b * sst_b + pid_n * sst_m + pid_m + tl.zeros([1, 1], tl.int32), scale)
    else:
        tl.store(s_ptr + b * ss_b + rows * ss_m + pid_n, scale, mask=rows < M)


@triton.jit
def _quantize_rows_in_chunks(x_ptr, sx_m, d_ptr, sd_m, s_ptr, ss_m, pid_m, M, N,
                             ROWS: tl.constexpr, CHUNK: tl.constexpr, POW2: tl.constexpr,
                             IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr,
                             SCALE_AT_EPS: tl.constexpr):
    """``ROWS`` whole rows (one scale each), ``CHUNK`` columns at a time: their amax over
    every chunk, then each chunk read again, encoded and stored."""
    rows = (pid_m * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    running = tl.zeros([ROWS, CHUNK], tl.uint32)  # reduced once, after the loop
    for c0 in range(0, N, CHUNK):
        cols = (c0 + tl.arange(0, CHUNK))[None, :]
        abs_bits, _ = _load_abs_sign(x_ptr + rows * sx_m + cols, (rows < M) & (cols < N), IN_BF16)
        running = tl.maximum(running, abs_bits)
    amax = tl.max(running, axis=1, keep_dims=True)
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
    for c0 in range(0, N, CHUNK):
        cols = (c0 + tl.arange(0, CHUNK))[None, :]
        mask = (rows < M) & (cols < N)
        abs_bits, sign = _load_abs_sign(x_ptr + rows * sx_m + cols, mask, IN_BF16)
        tl.store(d_ptr + rows * sd_m + cols, _encode(abs_bits, sign, scale), mask=mask)
    tl.store(s_ptr + rows * ss_m, scale, mask=rows < M)


@triton.jit
def _quantize_square_in_chunks(x_ptr, sx_m, d_ptr, sd_m, s_ptr, pid_m, pid_n, M, N, n_scales,
                               dt_ptr, sdt_m, st_ptr, sst_m,
                               ROWS: tl.constexpr, BN: tl.constexpr, GROUPS: tl.constexpr,
                               CHUNK: tl.constexpr, POW2: tl.constexpr, IN_BF16: tl.constexpr,
                               EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr,
                               TRANSPOSE: tl.constexpr):
    """``GROUPS`` square blocks side by side, ``CHUNK`` rows at a time: their amax over
    every chunk, then each chunk read again, encoded and stored; ``s_ptr`` points at the
    blocks' row of scales (``st_ptr`` at their column of the transposed scales)."""
    cols = (pid_n * GROUPS * BN + tl.arange(0, GROUPS * BN))[None, :]
    running = tl.zeros([CHUNK, GROUPS * BN], tl.uint32)  # reduced once, after the loop
    for r0 in range(0, ROWS, CHUNK):
        rows = (pid_m * ROWS + r0 + tl.arange(0, CHUNK)).to(tl.int64)[:, None]
        abs_bits, _ = _load_abs_sign(x_ptr + rows * sx_m + cols, (rows < M) & (cols < N), IN_BF16)
        running = tl.maximum(running, abs_bits)
    amax = tl.max(tl.max(tl.reshape(running, (CHUNK, GROUPS, BN)), axis=2), axis=0)
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)  # [GROUPS]
    spread = tl.reshape(tl.broadcast_to(scale[None, :, None], (CHUNK, GROUPS, BN)),
                        (CHUNK, GROUPS * BN))
    for r0 in range(0, ROWS, CHUNK):
        rows = (pid_m * ROWS + r0 + tl.arange(0, CHUNK)).to(tl.int64)[:, None]
        mask = (rows < M) & (cols < N)
        abs_bits, sign = _load_abs_sign(x_ptr + rows * sx_m + cols, mask, IN_BF16)
        codes = _encode(abs_bits, sign, spread)
        tl.store(d_ptr + rows * sd_m + cols, codes, mask=mask)
        if TRANSPOSE:
            _store_transposed(dt_ptr, sdt_m, codes, rows, cols, mask)
    groups = pid_n * GROUPS + tl.arange(0, GROUPS)
    tl.store(s_ptr + groups, scale, mask=groups < n_scales)
    if TRANSPOSE:
        tl.store(st_ptr + groups * sst_m, scale, mask=groups < n_scales)


@triton.jit
def _store_transposed(dt_ptr, sdt_m, codes, rows, cols, mask):
    """Store ``codes`` (at ``rows [R, 1]`` and ``cols [1, C]`` of the source) at the swapped
    coordinates of the ``[N, M]`` transpose, rows of the transpose contiguous."""
    tl.store(dt_ptr + tl.trans(cols).to(tl.int64) * sdt_m + tl.trans(rows), tl.trans(codes),
             mask=tl.trans(mask))


@triton.jit
def _encode_column_rows(x_ptr, sx_m, slots, p_start, start, end, cols, col_ok, scale,
                        IN_BF16: tl.constexpr):
    """E4M3 bytes (uint32) of the rows at ``slots`` of a strip, zero in the padding."""
    rows = start + slots - p_start
    mask = (rows < end)[:, None] & col_ok[None, :]
    abs_bits, sign = _load_abs_sign(x_ptr + rows[:, None] * sx_m + cols[None, :], mask, IN_BF16)
    return tl.where(mask, _encode(abs_bits, sign, scale[None, :]), 0).to(tl.uint32)


@triton.jit
def _group_columns_kernel(
    x_ptr, sx_m, offs_ptr, pends_ptr, order_ptr, d_ptr, sd_n, s_ptr, N,
    BR: tl.constexpr, BN: tl.constexpr, REVERSE: tl.constexpr,
    ORDERED: tl.constexpr, POW2: tl.constexpr, IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr,
    SCALE_AT_EPS: tl.constexpr,
):
    pid_n, e = tl.program_id(0), tl.program_id(1)
    if ORDERED:  # the GPU starts programs in index order: the longest experts first
        e = tl.load(order_ptr + e)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    p_start = tl.load(pends_ptr + e - 1, mask=e > 0, other=0)
    p_end = tl.load(pends_ptr + e)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    running = tl.zeros([BR, BN], tl.uint32)  # reduced once, after the loop
    for r0 in range(start, end, BR):
        rows = (r0 + tl.arange(0, BR)).to(tl.int64)
        mask = (rows < end)[:, None] & col_ok[None, :]
        abs_bits, _ = _load_abs_sign(x_ptr + rows[:, None] * sx_m + cols[None, :], mask, IN_BF16)
        running = tl.maximum(running, abs_bits)
    amax = tl.max(running, axis=0)
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(s_ptr + e.to(tl.int64) * N + cols, scale, mask=col_ok)
    # The encoding pass; REVERSE walks the tiles last first, so it starts on the rows the
    # amax pass read last (the likeliest still in L2).
    n_tiles = tl.cdiv(p_end - p_start, BR)
    for t in range(0, n_tiles):
        p0 = p_start + (n_tiles - 1 - t if REVERSE else t) * BR
        # Four consecutive slots' bytes in one 32-bit word (little-endian: the first slot
        # lowest), so the transpose moves words, not bytes; d_ptr is the uint32 view of the
        # output (16-aligned group starts and width keep every word inside one group).
        words = (p0 // 4 + tl.arange(0, BR // 4)).to(tl.int64)
        w = tl.zeros([BR // 4, BN], tl.uint32)
        for j in tl.static_range(4):
            q = _encode_column_rows(x_ptr, sx_m, words * 4 + j, p_start, start, end, cols,
                                    col_ok, scale, IN_BF16)
            w = w | (q << (8 * j))
        ptrs = d_ptr + cols.to(tl.int64)[:, None] * (sd_n // 4) + words[None, :]
        tl.store(ptrs, tl.trans(w).to(tl.int32, bitcast=True),
                 mask=col_ok[:, None] & (words < p_end // 4)[None, :])


@triton.jit
def _group_column_blocks_kernel(
    x_ptr, sx_m, offs_ptr, pends_ptr, d_ptr, sd_n, s_ptr, N, E,
    E_BLOCK: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, POW2: tl.constexpr,
    IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr,
):
    j, pid_n = tl.program_id(0), tl.program_id(1)
    slot = j * BT
    # the expert whose padded slot holds this block: groups before it end at or before it
    experts = tl.arange(0, E_BLOCK)
    ends = tl.load(pends_ptr + experts, mask=experts < E, other=2**31 - 1)
    e = tl.sum((ends <= slot).to(tl.int32), axis=0)
    p_start = tl.load(pends_ptr + e - 1, mask=e > 0, other=0)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.where(e < E, tl.load(offs_ptr + e, mask=e < E, other=0), start)  # past the last: none
    rows = (start + slot - p_start + tl.arange(0, BT)).to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    abs_bits, sign = _load_abs_sign(x_ptr + rows[:, None] * sx_m + cols[None, :], mask, IN_BF16)
    scale = _scale(tl.max(abs_bits, axis=0), POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(s_ptr + j.to(tl.int64) * N + cols, scale, mask=cols < N)
    codes = tl.where(mask, _encode(abs_bits, sign, scale[None, :]), 0).to(tl.uint8)
    slots = (slot + tl.arange(0, BT)).to(tl.int64)[:, None]
    _store_transposed(d_ptr, sd_n, codes, slots, cols[None, :], (cols < N)[None, :])


@triton.jit
def _load_two_parts(a_ptr, sa_m, b_ptr, sb_m, M_A, rows, cols, mask, IN_BF16: tl.constexpr):
    """``|x|`` bits and signs at ``rows`` x ``cols`` of two parts stacked along the rows
    (rows below ``M_A`` from the first); masked loads, so each element is read once."""
    in_a = (rows < M_A)[:, None]
    abs_a, sign_a = _load_abs_sign(a_ptr + rows[:, None] * sa_m + cols[None, :], mask & in_a,
                                   IN_BF16)
    rows_b = tl.maximum(rows - M_A, 0)
    abs_b, sign_b = _load_abs_sign(b_ptr + rows_b[:, None] * sb_m + cols[None, :],
                                   mask & ~in_a, IN_BF16)
    return tl.where(in_a, abs_a, abs_b), tl.where(in_a, sign_a, sign_b)


@triton.jit
def _weight_columns_kernel(
    a_ptr, sa_b, sa_m, b_ptr, sb_b, sb_m, M_A, d_ptr, sd_b, sd_k, s_ptr, ss_b, M, K,
    BR: tl.constexpr, BN: tl.constexpr, REVERSE: tl.constexpr, WORDS: tl.constexpr,
    POW2: tl.constexpr, IN_BF16: tl.constexpr, EPS_BITS: tl.constexpr,
    SCALE_AT_EPS: tl.constexpr,
):
    pid_k, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    a_ptr += b * sa_b
    b_ptr += b * sb_b
    cols = pid_k * BN + tl.arange(0, BN)
    col_ok = cols < K
    running = tl.zeros([BR, BN], tl.uint32)  # reduced once, after the loop
    for r0 in range(0, M, BR):
        rows = (r0 + tl.arange(0, BR)).to(tl.int64)
        mask = (rows < M)[:, None] & col_ok[None, :]
        abs_bits, _ = _load_two_parts(a_ptr, sa_m, b_ptr, sb_m, M_A, rows, cols, mask, IN_BF16)
        running = tl.maximum(running, abs_bits)
    scale = _scale(tl.max(running, axis=0), POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(s_ptr + b * ss_b + cols, scale, mask=col_ok)
    n_tiles = tl.cdiv(M, BR)
    for t in range(0, n_tiles):
        r0 = (n_tiles - 1 - t if REVERSE else t) * BR
        if WORDS:  # four rows' bytes per 32-bit word, as _group_columns_kernel's
            words = (r0 // 4 + tl.arange(0, BR // 4)).to(tl.int64)
            w = tl.zeros([BR // 4, BN], tl.uint32)
            for j in tl.static_range(4):
                rows = words * 4 + j
                mask = (rows < M)[:, None] & col_ok[None, :]
                abs_bits, sign = _load_two_parts(a_ptr, sa_m, b_ptr, sb_m, M_A, rows, cols,
                                                 mask, IN_BF16)
                q = tl.where(mask, _encode(abs_bits, sign, scale[None, :]), 0).to(tl.uint32)
                w = w | (q << (8 * j))
            ptrs = (d_ptr + b * (sd_b // 4) + cols.to(tl.int64)[:, None] * (sd_k // 4)
                    + words[None, :])
            tl.store(ptrs, tl.trans(w).to(tl.int32, bitcast=True),
                     mask=col_ok[:, None] & (words < M // 4)[None, :])
        else:
            rows = (r0 + tl.arange(0, BR)).to(tl.int64)
            mask = (rows < M)[:, None] & col_ok[None, :]
            abs_bits, sign = _load_two_parts(a_ptr, sa_m, b_ptr, sb_m, M_A, rows, cols, mask,
                                             IN_BF16)
            q = _encode(abs_bits, sign, scale[None, :])
            tl.store(d_ptr + b * sd_b + cols.to(tl.int64)[:, None] * sd_k + rows[None, :],
                     tl.trans(q), mask=col_ok[:, None] & (rows < M)[None, :])


_CONSTS = dict(EPS_BITS=_EPS_BITS, SCALE_AT_EPS=_SCALE_AT_EPS)
_EPS_BITS_C = tl.constexpr(_EPS_BITS)
_SCALE_AT_EPS_C = tl.constexpr(_SCALE_AT_EPS)


# Device functions of a rowwise encoding done inside another package's kernel
# (``row_codes.RowCodes``, served by moe_model's kernels): the same
# scale and E4M3 encoding as ``quantize_blocks``, from a row's FP32 ``amax`` given by the
# caller. Kernels calling them must launch with ``enable_fp_fusion=False`` (module notes).


@triton.jit
def row_scale_pow2(amax):
    """Power-of-two scale of a row whose largest magnitude is FP32 ``amax`` (NaN: NaN)."""
    return _scale(amax.to(tl.uint32, bitcast=True), True, _EPS_BITS_C, _SCALE_AT_EPS_C)


@triton.jit
def row_scale_fp32(amax):
    """FP32 scale of a row whose largest magnitude is FP32 ``amax`` (NaN: NaN)."""
    return _scale(amax.to(tl.uint32, bitcast=True), False, _EPS_BITS_C, _SCALE_AT_EPS_C)


@triton.jit
def encode_e4m3(values, scale):
    """E4M3 bytes (uint8) of FP32 ``values * scale``, as ``quantize_blocks`` encodes."""
    bits = values.to(tl.uint32, bitcast=True)
    return _encode(bits & 0x7FFFFFFF, (bits >> 24) & 0x80, scale)


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
class ColumnTile:
    """Launch shape of ``quantize_group_columns_t``: ``rows`` x ``cols`` tiles, ``warps``;
    ``reverse``: the encoding pass walks the tiles last first; ``longest_first``: the
    experts with the most rows get the first programs (one program walks a whole expert,
    so under skewed routing the busiest expert's programs set the kernel's end unless
    they start first)."""

    rows: int
    cols: int
    warps: int
    reverse: bool = False
    longest_first: bool = False


# Tuned on one H200 at the bench shapes (rows [131072, 2048] BF16, weight [64, 2048, 2048],
# Zipf group offsets) by tools/bench_fp8_experts.py's tile sweep, which checks each
# candidate bit-exact first (docs/performance.md, FP8 experts): rows 3.27 TB/s at
# (2048, 2) against 3.04 at (4096, 4); 1x128 tiles 3.04 TB/s at 8 groups per program on
# one warp against 2.96 at 16 groups on 2 warps and 2.55 at one group (`--no-blockwise
# --routing balanced`, commit 27d8ba2); 128x128 blocks 2.69 TB/s one per program on eight
# warps in two passes of 64-row chunks, against 2.58 in 32-row chunks, 2.41 on four warps
# in 32-row chunks and 2.36 whole in registers at two per program on 16 warps (`--parts
# kernels,tiles,layers --no-blockwise`, commit c2a11b3). Per-expert columns on one H100
# (`--parts tiles --no-blockwise --routing zipf`, commit e1b7204, device copy 2.97 TB/s;
# Zipf / balanced routing): 1.37 / 1.50 TB/s at (512, 32, 8) with the reversed pass and
# the longest experts first, against 0.98 / 1.21 for byte stores at (128, 64, 8) in order,
# 1.11 / 1.55 reversed with word stores at (128, 64, 8), 1.41 / 1.43 at (256, 64, 8)
# longest first.
_TILES: dict[str, BlockTile | ColumnTile] = {
    "rows": BlockTile(2048, 2),  # one scale per row
    "tiles": BlockTile(1024, 1, 8),  # 1x128
    "blocks": BlockTile(128 * 128, 8, 1, 64),  # 128x128
    "group_columns": ColumnTile(512, 32, 8, True, True),
    # 128 tokens of 32 columns per program (32 elements a thread): a first choice, not yet
    # swept on a GPU (`--parts tiles --tile-kinds column_blocks` sweeps it)
    "column_blocks": ColumnTile(128, 32, 4),
    # rows wider than ROW_WIDTH_MAX, one per program in chunks of ``elements``: on one H100
    # every "wide_rows" candidate of the sweep (an LM head's output gradient, [8192, 100352])
    # ran at 1.66-1.82 TB/s, this one 1.78 (`--parts tiles --tile-kinds wide_rows`, commit
    # 92fc999): the launch shape does not limit it. Nor do the rows in flight: persistent
    # grids of 1 to 4 programs per SM walking the rows (measured at 3ea7c20, reverted) ran
    # at 1.29-1.89 TB/s, and the best of them left the FP8 head step where it was
    "wide_rows": BlockTile(4096, 4),
}


# Rowwise scales of rows wider than this many elements (an LM head's output gradient: the
# vocabulary) walk each row twice in chunks (``_TILES["wide_rows"]``), one row per program,
# instead of holding it whole in registers (a bench-1gpu step with the head in FP8, whose
# 100352-wide rows took 131072 elements per program, did not finish in two minutes).
ROW_WIDTH_MAX = 16384


def _block_kind(block: tuple[int, int]) -> str:
    return "blocks" if block[0] > 1 else "rows" if block[1] == 0 else "tiles"


def quantize_blocks(x: torch.Tensor, block: tuple[int, int], pow2: bool,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    out_t: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., M, N]`` -> (E4M3 data, FP32 scales ``[..., ceil(M/bm), ceil(N/bn)]``);
    ``out``: write into these (views of those shapes whose leading dims merge, e.g. rows
    of a larger copy) and return them. ``out_t`` (square blocks only): also write the
    transposes, data ``[..., N, M]`` and scales ``[..., ceil(N/bn), ceil(M/bm)]`` (views as
    ``out``'s), in the same pass: the codes and scales of ``x.mT``, bit for bit."""
    bm, bn = block
    x = x.contiguous()
    M, N = x.shape[-2:]
    B = math.prod(x.shape[:-2])
    n_cols = -(-N // bn) if bn else 1
    if out_t is not None and bm == 1:
        raise ValueError(f"quantize_blocks: out_t needs square blocks, got {block}")
    if out is None:
        data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        scale = torch.empty(*x.shape[:-2], -(-M // bm), n_cols, dtype=torch.float32, device=x.device)
    else:
        data, scale = out[0].view(torch.uint8), out[1]
    if x.numel() == 0:
        return data.view(torch.float8_e4m3fn), scale.fill_(_SCALE_AT_EPS if M and not N else 0)
    tile = _TILES[_block_kind(block)]
    width = bn or triton.next_power_of_2(N)
    groups = tile.groups if bn else 1  # a whole row is one group
    rows = bm if bm > 1 else max(1, tile.elements // (groups * width))
    chunk = tile.chunk_rows if bm > 1 else 0
    if not bn and width > ROW_WIDTH_MAX:  # a whole row no longer fits a program's registers
        tile = _TILES["wide_rows"]
        width, rows, chunk = tile.elements, 1, tile.elements
    # views: a reshape that copied would drop the writes into ``out``
    x3, d3, s3 = (t.view(B, t.shape[-2], t.shape[-1]) for t in (_bits_view(x), data, scale))
    dt3, st3 = (d3, s3) if out_t is None else (
        t.view(B, t.shape[-2], t.shape[-1]) for t in (out_t[0].view(torch.uint8), out_t[1]))
    grid = (triton.cdiv(M, rows), triton.cdiv(n_cols, groups), B)
    _quantize_blocks_kernel[grid](
        x3, x3.stride(0), x3.stride(1), d3, d3.stride(0), d3.stride(1),
        s3, s3.stride(0), s3.stride(1), M, N, n_cols,
        dt3, dt3.stride(0), dt3.stride(1), st3, st3.stride(0), st3.stride(1),
        ROWS=rows, BN=width, GROUPS=groups, SQUARE=bm > 1, CHUNK=chunk, POW2=pow2,
        IN_BF16=x.dtype == torch.bfloat16, TRANSPOSE=out_t is not None,
        num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
    )
    return data.view(torch.float8_e4m3fn), scale


def group_columns_program_order(offsets: torch.Tensor) -> torch.Tensor | None:
    """The groups in the order ``quantize_group_columns_t``'s programs take them: the
    largest first (int32 ``[E]``, on the device) where the tile says so, else ``None``."""
    if not _TILES["group_columns"].longest_first:
        return None
    sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return torch.argsort(sizes, descending=True, stable=True).to(torch.int32)


def quantize_group_columns_t(x: torch.Tensor, offsets: torch.Tensor, padded_ends: torch.Tensor,
                             order: torch.Tensor | None, width: int, pow2: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``moe_mxfp8.fp8.quantize_group_columns``; ``order``: ``group_columns_program_order``'s
    (``None``: by index); returns ``(data_t [N, width], scale [E, N])``."""
    x = x.contiguous()
    R, N = x.shape
    E = offsets.shape[0]
    data_t = torch.empty(N, width, dtype=torch.uint8, device=x.device)
    scale = torch.empty(E, N, dtype=torch.float32, device=x.device)
    if N and E:
        tile = _TILES["group_columns"]
        _group_columns_kernel[(triton.cdiv(N, tile.cols), E)](
            _bits_view(x), x.stride(0), offsets, padded_ends, order, data_t.view(torch.int32),
            data_t.stride(0), scale, N, BR=tile.rows, BN=tile.cols, REVERSE=tile.reverse,
            ORDERED=order is not None, POW2=pow2,
            IN_BF16=x.dtype == torch.bfloat16,
            num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
        )
    return data_t.view(torch.float8_e4m3fn), scale


def quantize_group_column_blocks_t(x: torch.Tensor, offsets: torch.Tensor, padded_ends: torch.Tensor,
                                   width: int, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``moe_mxfp8.fp8.quantize_group_column_blocks``; returns ``(data_t [N, width],
    scale [width / 128, N])``."""
    x = x.contiguous()
    N = x.shape[1]
    E = offsets.shape[0]
    data_t = torch.empty(N, width, dtype=torch.uint8, device=x.device)
    scale = torch.empty(width // TOKEN_BLOCK, N, dtype=torch.float32, device=x.device)
    if N and width:
        tile = _TILES["column_blocks"]
        _group_column_blocks_kernel[(width // TOKEN_BLOCK, triton.cdiv(N, tile.cols))](
            _bits_view(x), x.stride(0), offsets, padded_ends, data_t, data_t.stride(0), scale,
            N, E, E_BLOCK=triton.next_power_of_2(max(E, 1)), BT=TOKEN_BLOCK, BN=tile.cols,
            POW2=pow2, IN_BF16=x.dtype == torch.bfloat16,
            num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
        )
    return data_t.view(torch.float8_e4m3fn), scale


# Fewer programs than this (one per column strip and stacked matrix) leave most SMs idle
# while each walks a whole strip: an LM head [100352, 2048] would get 64. Such weights take
# the transposed copy and the row kernel instead (quantize_weight_cols_t returns False).
WEIGHT_COLUMNS_MIN_PROGRAMS = 256


def quantize_weight_cols_t(parts: list[torch.Tensor], data: torch.Tensor, scale: torch.Tensor,
                           pow2: bool) -> bool:
    """``cat(parts, dim=-2)`` (one or two ``[..., M_i, K]``) scaled per column along its
    ``M`` rows, written transposed into ``data [..., K, M]`` and ``scale [..., K, 1]``
    (views whose leading dims merge) without building the concatenation or the transpose.
    Returns False, writing nothing, where the weight has too few column strips for this
    kernel (``WEIGHT_COLUMNS_MIN_PROGRAMS``) or no elements."""
    a, b = parts[0].contiguous(), parts[-1].contiguous()
    M_A, K = a.shape[-2], a.shape[-1]
    M = M_A + (b.shape[-2] if len(parts) == 2 else 0)
    B = math.prod(a.shape[:-2])
    tile = _TILES["group_columns"]
    if B * triton.cdiv(K, tile.cols) < WEIGHT_COLUMNS_MIN_PROGRAMS or M * K == 0:
        return False
    a3, b3 = (_bits_view(t).view(B, t.shape[-2], K) for t in (a, b))
    d3, s3 = data.view(torch.uint8).view(B, K, M), scale.view(B, K)
    words = (M % 4 == 0 and d3.stride(0) % 4 == 0 and d3.stride(1) % 4 == 0
             and d3.data_ptr() % 4 == 0)
    _weight_columns_kernel[(triton.cdiv(K, tile.cols), B)](
        a3, a3.stride(0), a3.stride(1), b3, b3.stride(0), b3.stride(1), M_A if len(parts) == 2 else M,
        d3.view(torch.int32) if words else d3, d3.stride(0), d3.stride(1), s3, s3.stride(0), M, K,
        BR=tile.rows, BN=tile.cols, REVERSE=tile.reverse, WORDS=words, POW2=pow2,
        IN_BF16=a.dtype == torch.bfloat16,
        num_warps=tile.warps, enable_fp_fusion=False, **_CONSTS,
    )
    return True
