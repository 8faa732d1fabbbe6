"""Triton kernels for MXFP8 quantization, bit-identical to the torch reference.

Imported lazily (only when a Triton backend is used), so the package imports on
machines without Triton.

Every tensor is viewed as ``[B, M, N]`` with a contiguous last dim. "Row" blocks run
along N (the contiguous dim), "column" blocks along M. One program loads a
``TILE_M x TILE_N`` tile once and writes any of: row data+scales, row dequantized
values, column data+scales. Weight caches use row+column from one read; the
emulated GEMM's activation operand uses row data and its dequantization in one pass.

Exactness notes:
- ``amax`` is an integer max over ``|x|`` bit patterns (NaN sorts above inf), so no
  float comparison or NaN-propagation mode is involved.
- Elements are scaled by an exact power-of-two reciprocal (``x * 2**-k`` rounds the
  same as ``x / 2**k``), then rounded to E4M3 by ``(a + C) - C`` with ``C`` a power of
  two whose FP32 ulp is the E4M3 quantum at ``a``'s exponent (subnormals included):
  the value handed to the FP8 conversion is already representable, so the result does
  not depend on how the hardware (or the interpreter) rounds.
"""

from __future__ import annotations

import math

import torch

import triton
import triton.language as tl

from moe_mxfp8.format import n_blocks

@triton.jit
def _scale_and_reciprocal(amax_bits):
    """Biased E8M0 scale, its FP32 value and the exact reciprocal used for scaling."""
    scale = tl.maximum((amax_bits >> 23) - 8, 0)
    scale = tl.where(amax_bits > 0x7F800000, 255, scale)
    recip_bits = tl.where(scale == 255, 0, (254 - tl.maximum(scale, 1)) << 23)
    value_bits = tl.where(scale == 0, 0x00400000, scale << 23)
    value_bits = tl.where(scale == 255, 0x7FC00000, value_bits)
    return scale, value_bits.to(tl.float32, bitcast=True), recip_bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3(a, sign_bits):
    """Round a scaled magnitude ``a >= 0`` to E4M3 (nearest-even, saturating at 448).

    Returns the signed result as an exact FP32 value and its E4M3 bits (NaN -> 0x7F).
    The E4M3 quantum at exponent e (>= -6, the subnormal floor) is 2**(e-3), the FP32
    ulp of C = 2**(e+20), so ``(a + C) - C`` rounds exactly. ``min`` may turn NaN into
    448; the select restores NaN in the bits, and the block's NaN scale makes every
    dequantized value NaN anyway.
    """
    is_nan = a != a
    a = tl.minimum(a, 448.0)
    c_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 121 << 23) + (20 << 23)
    c = c_bits.to(tl.float32, bitcast=True)
    q = (((a + c) - c).to(tl.int32, bitcast=True) | sign_bits).to(tl.float32, bitcast=True)
    bits = tl.where(is_nan, tl.full(q.shape, 0x7F, tl.uint8),
                    q.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    return q, bits


@triton.jit
def _load_f32(ptr, mask, IS_BF16: tl.constexpr):
    """Load as FP32; BF16 arrives as int16 bits and widens by a shift (exact, denormals too)."""
    raw = tl.load(ptr, mask=mask, other=0)
    if IS_BF16:
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return raw.to(tl.float32)


@triton.jit
def _store_from_f32(ptr, v, mask, IS_BF16: tl.constexpr):
    """Store FP32 ``v`` rounded to nearest-even; BF16 goes out as int16 bits (NaN -> 0x7FC0)."""
    if IS_BF16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptr, tl.where(v != v, 0x7FC0, rounded).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tile(M, N, NB, ALONG_N: tl.constexpr, EVEN_N: tl.constexpr, BLOCK: tl.constexpr,
          TILE: tl.constexpr):
    """Row/column indices of this program's tile of [M, N] and their mask.

    ALONG_N: TILE blocks of BLOCK contiguous elements, block g = (row g // NB, g % NB),
    so rows of any width (partial last block included) pack into full tiles.
    Otherwise: one BLOCK-tall block-row of TILE columns. Returns rows [T, 1] or
    [BLOCK, 1], cols [T, BLOCK] or [1, TILE], the element mask, and the scale
    offsets within a [M, NB] (or [ceil(M/BLOCK), N]) scale matrix with its mask.
    """
    if ALONG_N:
        g = tl.program_id(0) * TILE + tl.arange(0, TILE)  # int32: the launcher checks M * NB
        rows = (g // NB).to(tl.int64)[:, None]
        s_cols = (g % NB)[:, None]
        cols = s_cols * BLOCK + tl.arange(0, BLOCK)[None, :]
        s_mask = (g < M * NB)[:, None]
        # Whole blocks need no per-element mask, which keeps the loads vectorized.
        mask = s_mask if EVEN_N else s_mask & (cols < N)
        s_rows = rows
    else:
        rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)[:, None]
        cols = (tl.program_id(1) * TILE + tl.arange(0, TILE))[None, :]
        mask = (rows < M) & (cols < N)
        s_rows = tl.zeros([1, 1], dtype=tl.int64) + tl.program_id(0)
        s_cols = cols
        s_mask = cols < N
    return rows, cols, mask, s_rows, s_cols, s_mask


@triton.jit
def _quantize_kernel(
    x_ptr, M, N, NB, sx_b, sx_m,
    d_ptr, sd_b, sd_m, s_ptr, ss_b, ss_m, q_ptr, sq_b, sq_m,
    rd_ptr, rd_b, rd_m, rs_ptr, rs_b, rs_m,
    ALONG_N: tl.constexpr, EVEN_N: tl.constexpr, STORE_MX: tl.constexpr, STORE_DEQ: tl.constexpr,
    ROWS_TOO: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """Quantize [B, M, N] with blocks along N (ALONG_N) or along M.

    Outputs: data+scales (STORE_MX), dequantized values (STORE_DEQ), and, for blocks
    along M, also data+scales blocked along N from the same tile (ROWS_TOO).
    """
    b = tl.program_id(2).to(tl.int64)
    rows, cols, mask, s_rows, s_cols, s_mask = _tile(M, N, NB, ALONG_N, EVEN_N, BLOCK, TILE)
    x = _load_f32(x_ptr + b * sx_b + rows * sx_m + cols, mask, IN_BF16)
    x_bits = x.to(tl.int32, bitcast=True)
    abs_bits = x_bits & 0x7FFFFFFF
    sign_bits = x_bits & -2147483648
    if ALONG_N:
        amax = tl.max(abs_bits, axis=1)[:, None]
    else:
        amax = tl.max(abs_bits, axis=0)[None, :]
    scale, scale_f, recip = _scale_and_reciprocal(amax)
    # |x| * recip: the reciprocal is an exact power of two (or 0 for NaN blocks).
    q, q_bits = _round_to_e4m3(abs_bits.to(tl.float32, bitcast=True) * recip, sign_bits)
    if STORE_MX:
        tl.store(d_ptr + b * sd_b + rows * sd_m + cols, q_bits, mask=mask)
        tl.store(s_ptr + b * ss_b + s_rows * ss_m + s_cols, scale.to(tl.uint8), mask=s_mask)
    if STORE_DEQ:
        _store_from_f32(q_ptr + b * sq_b + rows * sq_m + cols, q * scale_f, mask, OUT_BF16)
    if ROWS_TOO:
        RB: tl.constexpr = TILE // BLOCK
        abs_r = tl.reshape(abs_bits, (BLOCK, RB, BLOCK))
        scale_r, _, recip_r = _scale_and_reciprocal(tl.max(abs_r, axis=2))
        _, q_r_bits = _round_to_e4m3(abs_r.to(tl.float32, bitcast=True) * recip_r[:, :, None],
                                     tl.reshape(sign_bits, (BLOCK, RB, BLOCK)))
        tl.store(rd_ptr + b * rd_b + rows * rd_m + cols, tl.reshape(q_r_bits, (BLOCK, TILE)),
                 mask=mask)
        offs_rb = (tl.program_id(1) * RB + tl.arange(0, RB))[None, :]
        tl.store(rs_ptr + b * rs_b + rows * rs_m + offs_rb, scale_r.to(tl.uint8),
                 mask=(rows < M) & (offs_rb < NB))


@triton.jit
def _dequantize_kernel(
    d_ptr, M, N, NB, sd_b, sd_m, s_ptr, ss_b, ss_m, o_ptr, so_b, so_m,
    ALONG_N: tl.constexpr, EVEN_N: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
):
    """``data * 2**(s-127)`` in FP32, rounded once to the output dtype; one scale load per block."""
    b = tl.program_id(2).to(tl.int64)
    rows, cols, mask, s_rows, s_cols, s_mask = _tile(M, N, NB, ALONG_N, EVEN_N, BLOCK, TILE)
    d = tl.load(d_ptr + b * sd_b + rows * sd_m + cols, mask=mask, other=0)
    d = d.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    s = tl.load(s_ptr + b * ss_b + s_rows * ss_m + s_cols, mask=s_mask, other=0).to(tl.int32)
    bits = tl.where(s == 0, 0x00400000, s << 23)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    _store_from_f32(o_ptr + b * so_b + rows * so_m + cols, d * bits.to(tl.float32, bitcast=True),
                    mask, OUT_BF16)


# --- launchers ------------------------------------------------------------------------

# (tile, warps), measured on an H200 at [131072, 2048] BF16. Blocks along N: a tile is
# 128 blocks (4096 elements) per program; along M: one block-row of 128 columns.
_TILES = {"rows": (128, 4), "cols": (128, 1), "both": (128, 2)}


def _check_block(block_size: int) -> None:
    if block_size & (block_size - 1) or not 2 <= block_size <= _TILES["both"][0]:
        raise ValueError(
            "the Triton kernels need block_size a power of two in "
            f"[2, {_TILES['both'][0]}], got {block_size}"
        )


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


def _grid(B: int, M: int, N: int, along_n: bool, block_size: int, tile: int):
    if along_n:
        if M * n_blocks(N, block_size) >= 2**31:
            raise ValueError(f"{M} rows x {N} columns exceed the kernels' int32 block index")
        return triton.cdiv(M * n_blocks(N, block_size), tile), 1, B
    return triton.cdiv(M, block_size), triton.cdiv(N, tile), B


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
    tile, warps = _TILES["rows" if along_n else "cols" if rows_too is None else "both"]
    d, sc = mx if mx is not None else (None, None)
    rd, rs = rows_too if rows_too is not None else (None, None)
    x_arg = _bits_view(x3)
    _quantize_kernel[_grid(B, M, N, along_n, block_size, tile)](
        x_arg, M, N, n_blocks(N, block_size), *_bs(x3),
        x_arg if d is None else d, *_bs(d), x_arg if sc is None else sc, *_bs(sc),
        x_arg if deq is None else _bits_view(deq), *_bs(deq),
        x_arg if rd is None else rd, *_bs(rd), x_arg if rs is None else rs, *_bs(rs),
        ALONG_N=along_n, EVEN_N=N % block_size == 0, STORE_MX=mx is not None, STORE_DEQ=deq is not None,
        ROWS_TOO=rows_too is not None, IN_BF16=x3.dtype == torch.bfloat16,
        OUT_BF16=deq is not None and deq.dtype == torch.bfloat16,
        BLOCK=block_size, TILE=tile, num_warps=warps,
    )


def _launch_dequantize(
    d3: torch.Tensor, s3: torch.Tensor, out3: torch.Tensor, along_n: bool, block_size: int
) -> None:
    _check_block(block_size)
    B, M, N = d3.shape
    if d3.numel() == 0:
        return
    tile, warps = _TILES["rows" if along_n else "cols"]
    _dequantize_kernel[_grid(B, M, N, along_n, block_size, tile)](
        d3, M, N, n_blocks(N, block_size), *_bs(d3), s3, *_bs(s3), _bits_view(out3), *_bs(out3),
        ALONG_N=along_n, EVEN_N=N % block_size == 0, OUT_BF16=out3.dtype == torch.bfloat16, BLOCK=block_size,
        TILE=tile, num_warps=warps,
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
