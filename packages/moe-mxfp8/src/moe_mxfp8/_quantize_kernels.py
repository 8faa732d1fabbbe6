"""Triton kernels for MXFP8 quantization, bit-identical to the torch reference.

Imported lazily (only when a Triton backend is used), so the package imports on
machines without Triton.

Every tensor is viewed as ``[B, M, N]`` with a contiguous last dim. "Row" blocks run
along N (the contiguous dim), "column" blocks along M. One kernel does every
quantization: a program loops over ``steps`` consecutive tiles (Triton may pipeline
the loop's loads, ``stages``) and writes any of: row data+scales, row dequantized
values, column data+scales, and for column tiles also row data+scales from the same
read (weight caches); the emulated GEMM's activation operand uses row data and its
dequantization in one pass. The launch shape of each kind is a ``Tile`` in
``_TILES`` (``tools/bench_mxfp8.py --tile-sweep`` measures candidates).

Tiles are numbered in memory order. Blocks along N: a tile is ``size`` blocks of
BLOCK contiguous elements (block g = row g // NB, block g % NB, so rows of any width
pack into full tiles). Blocks along M: a tile is one BLOCK-tall block-row by ``size``
columns, column tiles of one block-row consecutive; a program's tiles never leave
its block-row, so its loop walks along contiguous rows. Whole tiles (the common
case) are loaded and stored without masks.

Why this design (measured on an H200, [131072, 2048] BF16). A kernel that only loads
such column tiles and stores one byte per element runs at the device-copy rate, so
the loss was in the arithmetic and its latency: the old column kernel (one-warp
32x128 tiles, one tile per program) needed 255 registers (spills, 8 warps per SM)
and hid too little latency (60% of copy); "both" ran at 40%. Now: the E4M3 encoding
below takes ~8 instructions per element instead of ~12 (no FP8 conversion, no
per-element NaN test and select, no byte unpacking for them); column kinds use
32x64 one-warp tiles (64 elements and ~90 registers per thread, the column amax
in-thread plus three shuffles; tiles over several warps were slower, their reduction
goes through shared memory and a barrier); a program loops over consecutive tiles
(walking down a column strip instead was slower: programs far apart in memory).
Columns now reach ~75% of copy, rows ~80%; "both" (~60%) stays bound by issuing two
quantizations per element (~32 instructions) with ~210 registers per thread.

Exactness notes:
- ``amax`` is an integer max over ``|x|`` bit patterns (NaN sorts above inf), so no
  float comparison or NaN-propagation mode is involved.
- Elements are scaled by an exact power-of-two reciprocal (``x * 2**-k`` rounds the
  same as ``x / 2**k``) to ``a``. With ``E`` the biased FP32 exponent of ``a`` floored
  at 121 (2**-6, E4M3's subnormal floor), ``C = 2**(E-127+20)`` has an FP32 ulp equal
  to the E4M3 quantum at ``a``, so ``s = a + C`` rounds ``a`` to E4M3 (nearest-even,
  subnormals included) and its bits are ``bits(C) + m`` with ``m`` the rounded value
  in quanta. The E4M3 code is then ``m + 8*(E-121)`` = ``bits(s) - T(E)`` with
  ``T(E) = bits(C) - 8*(E-121)``, one integer multiply-add. An unsigned ``min`` with
  126 (448) saturates; inf/NaN give huge unsigned codes (whatever NaN bit pattern the
  hardware or the interpreter makes), so the same ``min`` with 127 in NaN blocks
  yields NaN. No FP8 conversion is used, so nothing depends on how the hardware (or
  the interpreter) rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_mxfp8.format import n_blocks


@triton.jit
def _block_scale(amax_bits):
    """Biased E8M0 scale (int32), the exact reciprocal used for scaling (0 for NaN
    blocks) and the largest E4M3 code of the block (126 = 448, or 127 = NaN)."""
    e = amax_bits >> 23
    nan = amax_bits > 0x7F800000
    scale = tl.where(nan, 255, tl.maximum(e - 8, 0))
    # 1 / max(2**(scale-127), 2**-126) = 2**(254 - max(scale, 1)) = 2**(262 - max(e, 9) - 127)
    recip = tl.where(nan, 0, (262 - tl.maximum(e, 9)) << 23).to(tl.float32, bitcast=True)
    return scale, recip, (126 + nan).to(tl.uint32)


@triton.jit
def _scale_value(scale):
    """FP32 ``2**(s-127)`` of a biased scale: 2**-127 for 0, NaN for 255."""
    bits = tl.where(scale == 0, 0x00400000, scale << 23)
    return tl.where(scale == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(abs_bits, sign, recip, sat):
    """E4M3 bytes of ``x`` (``|x|`` bits, sign byte 0/0x80) in a block with ``recip``/``sat``,
    and ``|q|`` in FP32 (the rounded magnitude before saturation, for dequantized outputs).
    """
    a = abs_bits.to(tl.float32, bitcast=True) * recip
    e = tl.maximum(a.to(tl.uint32, bitcast=True) >> 23, 121)  # a >= 0: its biased exponent
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)
    s = a + c
    code = tl.minimum(s.to(tl.uint32, bitcast=True) - (e * 8388600 + 167773128), sat)  # T(E)
    return (code | sign).to(tl.uint8), s - c


@triton.jit
def _load_abs_sign(ptr, mask, IS_BF16: tl.constexpr):
    """``|x|`` as FP32 bits (uint32) and the sign as an E4M3 sign byte (uint32 0 or 0x80).

    BF16 arrives as int16 bits and widens by a shift (exact, denormals too).
    """
    raw = tl.load(ptr, mask=mask, other=0)
    if IS_BF16:
        w = raw.to(tl.uint16, bitcast=True).to(tl.uint32)
        abs_bits = (w << 16) & 0x7FFFFFFF
        sign = (w >> 8) & 0x80
    else:
        bits = raw.to(tl.float32).to(tl.uint32, bitcast=True)
        abs_bits = bits & 0x7FFFFFFF
        sign = (bits >> 24) & 0x80
    return abs_bits, sign


# Whether the kernels round FP32 to BF16 with the GPU's conversion instruction
# (``cvt.rn.bf16.f32``: nearest-even, subnormals kept, as torch rounds) or by integer
# operations. Compiled kernels take the instruction: fewer operations per element, which
# the FP8 SwiGLU kernels, bound by their arithmetic, turn into bandwidth
# (docs/performance.md, FP8 experts). Triton's interpreter converts subnormals and ties its
# own way, so there the integer form gives the same bits as the GPU. Read once, as
# ``triton.jit`` reads it to decide whether kernels are interpreted. (E4M3 keeps the
# integer encoding everywhere: ``moe_mxfp8._fp8_kernels``' notes.)
_NATIVE_BF16 = tl.constexpr(not triton.knobs.runtime.interpret)


@triton.jit
def _bf16_bits(v):
    """BF16 bits (int32, sign-extended) of FP32 ``v`` rounded to nearest-even; NaN -> 0x7FC0
    (torch's NaN, whatever NaN the conversion makes)."""
    if _NATIVE_BF16:
        rounded = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, rounded)


@triton.jit
def _store_from_f32(ptr, v, mask, IS_BF16: tl.constexpr):
    """Store FP32 ``v`` rounded to nearest-even; BF16 goes out as int16 bits (NaN -> 0x7FC0)."""
    if IS_BF16:
        tl.store(ptr, _bf16_bits(v).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _steps(M, N, NB, ALONG_N: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
           STEPS: tl.constexpr):
    """This program's first tile and how many of its STEPS consecutive tiles exist.

    Tiles are numbered in memory order: along N, TILE-block runs of the flattened
    block grid; along M, block-row by block-row, column tiles within. A program's
    tiles never cross a block-row, so its loop walks along contiguous memory.
    """
    pid = tl.program_id(0)
    if ALONG_N:
        first = pid * STEPS
        end = tl.cdiv(M * NB, TILE)
    else:
        col_tiles = tl.cdiv(N, TILE)
        chunks = tl.cdiv(col_tiles, STEPS)
        block_row = pid // chunks
        first = block_row * col_tiles + (pid % chunks) * STEPS
        end = (block_row + 1) * col_tiles
    return first, tl.minimum(end - first, STEPS)


@triton.jit
def _all(KNOWN: tl.constexpr, cond):
    """``cond``, or a constant true when KNOWN (constant masks compile to unmasked accesses)."""
    if KNOWN:
        cond = tl.full(cond.shape, 1, tl.int1)
    return cond


@triton.jit
def _tile(t, M, N, NB, ALONG_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
          BLOCK: tl.constexpr, TILE: tl.constexpr):
    """Row/column indices of tile ``t`` of [M, N] and their mask.

    ALONG_N: TILE blocks of BLOCK contiguous elements (block g = row g // NB, block
    g % NB, so rows of any width pack into full tiles); rows [T, 1], cols [T, BLOCK].
    Otherwise: one BLOCK-tall block-row by TILE columns; rows [BLOCK, 1], cols [1, TILE].
    Also returns the scale offsets within a [M, NB] (or [ceil(M/BLOCK), N]) scale
    matrix with their mask. EVEN_M / EVEN_N: no tile is cut by the last row / column.
    """
    if ALONG_N:
        g = t * TILE + tl.arange(0, TILE)  # int32: the launcher checks M * NB
        rows = (g // NB).to(tl.int64)[:, None]
        s_cols = (g % NB)[:, None]
        cols = s_cols * BLOCK + tl.arange(0, BLOCK)[None, :]
        s_rows = rows
        s_mask = _all(EVEN_M, (g < M * NB)[:, None])
        # Whole blocks need no per-element mask, which keeps the loads vectorized.
        mask = s_mask & _all(EVEN_N, cols < N)
    else:
        col_tiles = tl.cdiv(N, TILE)
        block_row = t // col_tiles
        cols = ((t % col_tiles) * TILE + tl.arange(0, TILE))[None, :]
        rows = (block_row.to(tl.int64) * BLOCK + tl.arange(0, BLOCK))[:, None]
        s_rows = tl.zeros([1, 1], dtype=tl.int64) + block_row
        s_cols = cols
        s_mask = _all(EVEN_N, cols < N)
        mask = _all(EVEN_M, rows < M) & s_mask
    return rows, cols, mask, s_rows, s_cols, s_mask


@triton.jit
def _quantize_kernel(
    x_ptr, M, N, NB, sx_b, sx_m,
    d_ptr, sd_b, sd_m, s_ptr, ss_b, ss_m, q_ptr, sq_b, sq_m,
    rd_ptr, rd_b, rd_m, rs_ptr, rs_b, rs_m,
    ALONG_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, STORE_MX: tl.constexpr,
    STORE_DEQ: tl.constexpr, ROWS_TOO: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr,
):
    """Quantize [B, M, N] with blocks along N (ALONG_N) or along M.

    Outputs: data+scales (STORE_MX), dequantized values (STORE_DEQ), and, for blocks
    along M, also data+scales blocked along N from the same tile (ROWS_TOO).
    """
    b = tl.program_id(2).to(tl.int64)
    first, count = _steps(M, N, NB, ALONG_N, BLOCK, TILE, STEPS)
    for i in tl.range(0, count, num_stages=STAGES):
        rows, cols, mask, s_rows, s_cols, s_mask = _tile(first + i, M, N, NB, ALONG_N, EVEN_M,
                                                         EVEN_N, BLOCK, TILE)
        abs_bits, sign = _load_abs_sign(x_ptr + b * sx_b + rows * sx_m + cols, mask, IN_BF16)
        amax = tl.max(abs_bits, axis=1 if ALONG_N else 0, keep_dims=True)
        scale, recip, sat = _block_scale(amax.to(tl.int32, bitcast=True))
        q_bits, q = _e4m3(abs_bits, sign, recip, sat)
        if STORE_MX:
            tl.store(d_ptr + b * sd_b + rows * sd_m + cols, q_bits, mask=mask)
            tl.store(s_ptr + b * ss_b + s_rows * ss_m + s_cols, scale.to(tl.uint8), mask=s_mask)
        if STORE_DEQ:
            v = (tl.minimum(q, 448.0) * _scale_value(scale)).to(tl.uint32, bitcast=True)
            v = (v | (sign << 24)).to(tl.float32, bitcast=True)
            _store_from_f32(q_ptr + b * sq_b + rows * sq_m + cols, v, mask, OUT_BF16)
        if ROWS_TOO:
            RB: tl.constexpr = TILE // BLOCK
            abs_r = tl.reshape(abs_bits, (BLOCK, RB, BLOCK))
            amax_r = tl.max(abs_r, axis=2).to(tl.int32, bitcast=True)
            scale_r, recip_r, sat_r = _block_scale(amax_r)
            r_bits, _ = _e4m3(abs_r, tl.reshape(sign, (BLOCK, RB, BLOCK)), recip_r[:, :, None],
                              sat_r[:, :, None])
            tl.store(rd_ptr + b * rd_b + rows * rd_m + cols, tl.reshape(r_bits, (BLOCK, TILE)),
                     mask=mask)
            offs_rb = (((first + i) % tl.cdiv(N, TILE)) * RB + tl.arange(0, RB))[None, :]
            rs_mask = _all(EVEN_M, rows < M) & _all(EVEN_N, offs_rb < NB)
            tl.store(rs_ptr + b * rs_b + rows * rs_m + offs_rb, scale_r.to(tl.uint8), mask=rs_mask)


@triton.jit
def _dequantize_kernel(
    d_ptr, M, N, NB, sd_b, sd_m, s_ptr, ss_b, ss_m, o_ptr, so_b, so_m,
    ALONG_N: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr,
):
    """``data * 2**(s-127)`` in FP32, rounded once to the output dtype; one scale load per block."""
    b = tl.program_id(2).to(tl.int64)
    first, count = _steps(M, N, NB, ALONG_N, BLOCK, TILE, STEPS)
    for i in tl.range(0, count, num_stages=STAGES):
        rows, cols, mask, s_rows, s_cols, s_mask = _tile(first + i, M, N, NB, ALONG_N, EVEN_M,
                                                         EVEN_N, BLOCK, TILE)
        d = tl.load(d_ptr + b * sd_b + rows * sd_m + cols, mask=mask, other=0)
        d = d.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(s_ptr + b * ss_b + s_rows * ss_m + s_cols, mask=s_mask, other=0).to(tl.int32)
        _store_from_f32(o_ptr + b * so_b + rows * so_m + cols, d * _scale_value(s), mask, OUT_BF16)


# --- launchers ------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """Launch shape of one kernel kind.

    size: blocks per tile (blocks along N) or columns per tile (blocks along M, a
    multiple of the block size); warps: num_warps; steps: tiles per program (a loop);
    stages: software-pipelining depth of that loop (1: none).
    """

    size: int
    warps: int
    steps: int = 1
    stages: int = 1


# From tools/bench_mxfp8.py --tile-sweep on an H200 at [131072, 2048] BF16 (three runs,
# copy 4.11-4.18 TB/s): rows 79-83% of copy, columns 74-77%, both 59-61%, quantize +
# dequantize ("qdq", the GEMM operand) 75-77%, dequantize rows 89%, columns 85-88%.
_TILES = {
    "rows": Tile(64, 1, steps=8, stages=2),
    "cols": Tile(64, 1, steps=4),
    "both": Tile(64, 1),
    "qdq": Tile(32, 1, steps=4),
    "dequant_rows": Tile(32, 1, steps=4),
    "dequant_cols": Tile(128, 1),
}


def _check_block(block_size: int) -> None:
    if block_size & (block_size - 1) or not 2 <= block_size <= 128:
        raise ValueError(f"the Triton kernels need block_size a power of two in [2, 128], got {block_size}")


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """BF16 travels as int16 bits: the kernels convert it exactly themselves."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _bs(t: torch.Tensor | None) -> tuple[int, int]:
    """(batch, row) strides of a [B, M, N] view; the last dim must be contiguous."""
    if t is None:
        return 0, 0
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError("MXFP8 kernels need a contiguous last dim")
    return t.stride(0), t.stride(1)


def _launch_args(kind: str, B: int, M: int, N: int, along_n: bool, block_size: int):
    """Grid and meta-parameters of one launch, read from ``_TILES[kind]``."""
    tile = _TILES[kind]
    steps = max(1, tile.steps)
    nb = n_blocks(N, block_size)
    if along_n:
        size = tile.size
        if M * nb + steps * size >= 2**31:
            raise ValueError(f"{M} rows x {N} columns exceed the kernels' int32 block index")
        grid = (triton.cdiv(triton.cdiv(M * nb, size), steps), 1, B)
        even_m, even_n = (M * nb) % size == 0, N % block_size == 0
    else:
        size = max(tile.size, block_size)  # a tile holds whole row blocks
        col_tiles = triton.cdiv(N, size)
        grid = (triton.cdiv(M, block_size) * triton.cdiv(col_tiles, steps), 1, B)
        even_m, even_n = M % block_size == 0, N % size == 0
    meta = dict(EVEN_M=even_m, EVEN_N=even_n, BLOCK=block_size, TILE=size, STEPS=steps,
                STAGES=tile.stages, num_warps=tile.warps)
    return grid, meta


def _launch_quantize(
    x3: torch.Tensor,
    along_n: bool,
    block_size: int,
    mx: tuple[torch.Tensor, torch.Tensor] | None = None,
    deq: torch.Tensor | None = None,
    rows_too: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Quantize ``x3`` [B, M, N] into any of the given outputs (uint8 data and scales).

    ``mx`` and ``deq`` follow the ``along_n`` orientation; ``rows_too`` (only with
    blocks along M) gets the blocks along N from the same read.
    """
    _check_block(block_size)
    B, M, N = x3.shape
    if x3.numel() == 0:
        return
    if along_n and B != 1:
        raise ValueError("blocks along N take a [1, rows, N] view")

    if rows_too is not None and along_n:
        raise ValueError("rows_too only applies to blocks along M")
    kind = ("qdq" if deq is not None else "rows") if along_n else "cols" if rows_too is None else "both"
    grid, meta = _launch_args(kind, B, M, N, along_n, block_size)
    d, sc = mx if mx is not None else (None, None)
    rd, rs = rows_too if rows_too is not None else (None, None)
    x_arg = _bits_view(x3)
    _quantize_kernel[grid](
        x_arg, M, N, n_blocks(N, block_size), *_bs(x3),
        x_arg if d is None else d, *_bs(d), x_arg if sc is None else sc, *_bs(sc),
        x_arg if deq is None else _bits_view(deq), *_bs(deq),
        x_arg if rd is None else rd, *_bs(rd), x_arg if rs is None else rs, *_bs(rs),
        ALONG_N=along_n, STORE_MX=mx is not None, STORE_DEQ=deq is not None,
        ROWS_TOO=rows_too is not None, IN_BF16=x3.dtype == torch.bfloat16,
        OUT_BF16=deq is not None and deq.dtype == torch.bfloat16, **meta,
    )


def _launch_dequantize(
    d3: torch.Tensor, s3: torch.Tensor, out3: torch.Tensor, along_n: bool, block_size: int
) -> None:
    _check_block(block_size)
    B, M, N = d3.shape
    if d3.numel() == 0:
        return
    grid, meta = _launch_args("dequant_rows" if along_n else "dequant_cols", B, M, N, along_n,
                              block_size)
    _dequantize_kernel[grid](
        d3, M, N, n_blocks(N, block_size), *_bs(d3), s3, *_bs(s3), _bits_view(out3), *_bs(out3),
        ALONG_N=along_n, OUT_BF16=out3.dtype == torch.bfloat16, **meta,
    )


def _as_bmn(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, bool]:
    """View contiguous ``t`` as [B, M, N] with the blocked ``axis`` as N (last) or M."""
    shape = t.shape
    if axis == t.dim() - 1:
        return t.reshape(1, math.prod(shape[:-1]), shape[-1]), True
    return t.reshape(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])), False


def _new_pair(shape: tuple[int, ...], axis: int, block_size: int, device: torch.device):
    s_shape = list(shape)
    s_shape[axis] = n_blocks(shape[axis], block_size)
    data = torch.empty(shape, dtype=torch.uint8, device=device)
    scales = torch.empty(s_shape, dtype=torch.uint8, device=device)
    return data, scales


def _typed(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return pair[0].view(torch.float8_e4m3fn), pair[1].view(torch.float8_e8m0fnu)


def quantize_along(x: torch.Tensor, axis: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    data, scales = _new_pair(tuple(x.shape), axis, block_size, x.device)
    x3, along_n = _as_bmn(x, axis)
    pair = (_as_bmn(data, axis)[0], _as_bmn(scales, axis)[0])
    _launch_quantize(x3, along_n, block_size, mx=pair)
    return _typed((data, scales))


def quantize_both(x: torch.Tensor, block_size: int):
    """Blocks along -1 and along -2 of a contiguous [..., M, N] tensor, from one read."""
    x = x.contiguous()
    shape, last = tuple(x.shape), x.dim() - 1
    row = _new_pair(shape, last, block_size, x.device)
    col = _new_pair(shape, last - 1, block_size, x.device)

    def bmn(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])

    _launch_quantize(bmn(x), False, block_size, mx=(bmn(col[0]), bmn(col[1])),
                     rows_too=(bmn(row[0]), bmn(row[1])))
    return _typed(row), _typed(col)


def quantize_dequantize_rows(x: torch.Tensor, dtype: torch.dtype, keep: bool, block_size: int):
    x = x.contiguous()
    last = x.dim() - 1
    deq = torch.empty(x.shape, dtype=dtype, device=x.device)
    pair = _new_pair(tuple(x.shape), last, block_size, x.device) if keep else None
    mx = (_as_bmn(pair[0], last)[0], _as_bmn(pair[1], last)[0]) if keep else None
    _launch_quantize(_as_bmn(x, last)[0], True, block_size, mx=mx, deq=_as_bmn(deq, last)[0])
    return deq, (_typed(pair) if keep else None)


def dequantize_along(
    data: torch.Tensor, scales: torch.Tensor, axis: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    data, scales = data.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    d3, along_n = _as_bmn(data, axis)
    _launch_dequantize(d3, _as_bmn(scales, axis)[0], _as_bmn(out, axis)[0], along_n, block_size)
    return out


def quantize_rows_into(
    x: torch.Tensor, data_u8: torch.Tensor, scales_u8: torch.Tensor, block_size: int
) -> None:
    """Quantize 2-D ``x`` along its rows into uint8 views whose row strides may differ."""
    _launch_quantize(x.contiguous().unsqueeze(0), True, block_size,
                     mx=(data_u8.unsqueeze(0), scales_u8.unsqueeze(0)))


def dequantize_rows_from(
    data_u8: torch.Tensor, scales_u8: torch.Tensor, dtype: torch.dtype, block_size: int
) -> torch.Tensor:
    """Dequantize 2-D uint8 views (row strides may differ) blocked along rows."""
    out = torch.empty(data_u8.shape, dtype=dtype, device=data_u8.device)
    _launch_dequantize(data_u8.unsqueeze(0), scales_u8.unsqueeze(0), out.unsqueeze(0), True,
                       block_size)
    return out
