"""Triton kernels for ``FP8RowCodec``'s packed rows (``moe_mxfp8.codec``), one pass each way,
bit-identical to its torch reference on the GPU and under ``TRITON_INTERPRET=1``.

Imported lazily, like ``moe_mxfp8._fp8_kernels`` (whose scale and E4M3 encoding the encoder
shares). A packed row is ``uint8[D + 4]``: the E4M3 codes, then the FP32 row scale's bytes
(little-endian). One program handles ``ROWS`` whole rows (``BN`` = ``D`` rounded up to a
power of two, masked):

- ``encode_rows_into``: row amax (an integer max over ``|x|`` bit patterns), the
  power-of-two scale, the E4M3 codes and the scale's four bytes, written straight into the
  packed rows (the scale lands at byte ``D`` of a row, which need not be 4-aligned, so it
  goes out as bytes).
- ``decode_rows``: the codes and the four scale bytes of a row in one read; the value is
  ``fp32(code) * (1 / scale)`` (NaN codes selected explicitly) as the reference computes it: the reciprocal is an FP64
  division rounded once to FP32 (IEEE on the GPU: ``div.rn.f64``; FP64 has more than 2 x 24
  + 2 bits, so that double rounding equals FP32's correctly rounded reciprocal, subnormal
  results included), and the product is rounded once to the output dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_mxfp8._fp8_kernels import _CONSTS, _encode, _scale
from moe_mxfp8._quantize_kernels import _bits_view, _load_abs_sign, _store_from_f32

SCALE_BYTES = 4


@triton.jit
def _encode_rows_kernel(
    x_ptr, sx_m, p_ptr, sp_m, M, D,
    ROWS: tl.constexpr, BN: tl.constexpr, IN_BF16: tl.constexpr,
    EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BN)[None, :]
    row_ok = rows < M
    mask = row_ok & (cols < D)
    abs_bits, sign = _load_abs_sign(x_ptr + rows * sx_m + cols, mask, IN_BF16)
    amax = tl.max(abs_bits, axis=1, keep_dims=True)
    scale = _scale(amax, True, EPS_BITS, SCALE_AT_EPS)
    tl.store(p_ptr + rows * sp_m + cols, _encode(abs_bits, sign, scale), mask=mask)
    k = tl.arange(0, 4)[None, :]
    scale_bytes = (scale.to(tl.uint32, bitcast=True) >> (k * 8).to(tl.uint32)) & 0xFF
    tl.store(p_ptr + rows * sp_m + D + k, scale_bytes.to(tl.uint8), mask=row_ok & (k < 4))


@triton.jit
def _decode_rows_kernel(
    p_ptr, sp_m, o_ptr, so_m, M, D,
    ROWS: tl.constexpr, BN: tl.constexpr, OUT_BF16: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BN)[None, :]
    row_ok = rows < M
    mask = row_ok & (cols < D)
    code = tl.load(p_ptr + rows * sp_m + cols, mask=mask, other=0)
    k = tl.arange(0, 4)[None, :]
    scale_bytes = tl.load(p_ptr + rows * sp_m + D + k, mask=row_ok & (k < 4), other=0)
    bits = tl.sum(scale_bytes.to(tl.uint32) << (k * 8).to(tl.uint32), axis=1, keep_dims=True)
    inv = (1.0 / bits.to(tl.float32, bitcast=True).to(tl.float64)).to(tl.float32)
    # E4M3 has no infinity: codes 0x7F / 0xFF are NaN (the interpreter's conversion makes
    # them infinities, so the select is explicit)
    data = tl.where((code & 0x7F) == 0x7F, float("nan"), code.to(tl.float8e4nv, bitcast=True).to(tl.float32))
    value = data * inv
    _store_from_f32(o_ptr + rows * so_m + cols, value, mask, OUT_BF16)


@dataclass(frozen=True)
class RowTile:
    """Launch shape: about ``elements`` per program (whole rows, at least one) on ``warps``
    warps; a row wider than ``elements`` gets proportionally more warps (up to 16), so a
    thread holds about as many elements at any width."""

    elements: int
    warps: int


# Untuned starting points (the encoder's is the rowwise quantizer's tuned tile,
# moe_mxfp8._fp8_kernels._TILES["rows"]); tools/bench_fp8_experts.py sweeps both
# (CODEC_TILE_CANDIDATES) and checks every candidate bit-exact first.
_TILES: dict[str, RowTile] = {
    "encode": RowTile(2048, 2),
    "decode": RowTile(2048, 2),
}


def _launch(kind: str, M: int, D: int) -> tuple[tuple[int], dict]:
    tile = _TILES[kind]
    width = triton.next_power_of_2(D)
    rows = max(1, tile.elements // width)
    warps = min(16, tile.warps * max(1, width // tile.elements))
    return (triton.cdiv(M, rows),), dict(ROWS=rows, BN=width, num_warps=warps)


def _row_strided(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def encode_rows_into(rows: torch.Tensor, packed: torch.Tensor) -> None:
    """Encode ``rows [R, D]`` (FP32/BF16/FP16) into ``packed`` uint8 ``[R, D + 4]`` (any row
    stride)."""
    rows = rows.contiguous()
    M, D = rows.shape
    if M == 0:
        return
    grid, meta = _launch("encode", M, D)
    _encode_rows_kernel[grid](
        _bits_view(rows), rows.stride(0), packed, packed.stride(0), M, D,
        IN_BF16=rows.dtype == torch.bfloat16, enable_fp_fusion=False, **meta, **_CONSTS,
    )


def decode_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decode uint8 ``packed [R, D + 4]`` (any row stride) into ``[R, D]`` of ``dtype``."""
    packed = _row_strided(packed)
    M, D = packed.shape[0], packed.shape[1] - SCALE_BYTES
    out = torch.empty(M, D, dtype=dtype, device=packed.device)
    if M == 0:
        return out
    grid, meta = _launch("decode", M, D)
    _decode_rows_kernel[grid](
        packed, packed.stride(0), _bits_view(out), out.stride(0), M, D,
        OUT_BF16=dtype == torch.bfloat16, enable_fp_fusion=False, **meta,
    )
    return out
