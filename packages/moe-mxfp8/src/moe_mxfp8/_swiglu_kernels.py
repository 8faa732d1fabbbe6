"""Fused SwiGLU kernels (see ``moe_mxfp8.swiglu``): FP32 inside, one rounding on output.

Imported lazily. The plain kernels take a ``[ROWS, COLS]`` tile of ``h`` and the matching
tiles of ``h1`` and ``h3`` (columns ``c`` and ``F + c`` of ``h13``). The quantizing ones
take whole rows (the rowwise scale needs the row's amax) and also write the result
quantized rowwise (``moe_mxfp8.fp8`` numerics), so ``h`` never goes to memory in the
forward and ``dh13`` is read once less in the backward. The backward kernels can also
write ``h`` (what the down projection's weight gradient reads), from the values they
hold anyway, instead of a separate forward kernel reading ``h13`` again.

BF16 results are rounded to nearest-even (the conversion instruction on the GPU, integer
operations under the interpreter: ``moe_mxfp8._quantize_kernels._bf16_bits``) and stored
as their bits, and the quantizing kernels quantize exactly those BF16 values, so a fused
result equals the unfused kernels' output quantized by ``moe_mxfp8._fp8_kernels``, bit for
bit, on the GPU and under ``TRITON_INTERPRET=1`` (all launch with
``enable_fp_fusion=False``: the same FP32 roundings in every kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_mxfp8._fp8_kernels import _CONSTS, BlockTile, _encode, _scale
from moe_mxfp8._quantize_kernels import _bf16_bits, _bits_view, _store_from_f32

_ROWS, _COLS = 16, 128

# Launch shapes of the quantizing kernels, which hold whole rows: about ``elements`` per
# program (at least one row), ``warps`` (``BlockTile``'s first two fields). Tuned by
# ``tools/from_source.sh python3 tools/bench_fp8_experts.py --parts tiles --tile-kinds
# swiglu swiglu_backward`` (each candidate checked bit for bit against this default's
# output first). On one H100 (commit db21e84, copy 2.98 TB/s, rows [131072, 2048],
# `bench_fp8_swiglu_tiles_h100.json`) these run at 2.62 (forward) and 2.75 TB/s
# (backward), 88% and 92% of copy; the best candidates reach 2.74 at (1024, 2) and 2.84
# at (1024, 4), within the spread between runs, so the shapes stay as written.
_TILES: dict[str, BlockTile] = {
    "swiglu": BlockTile(2048, 4),
    "swiglu_backward": BlockTile(2048, 4),
}


@triton.jit
def _sigmoid(g):
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _as_stored(v, TO_BF16: tl.constexpr):
    """``v`` as it will be stored (BF16 bits as int32, or FP32), with ``|v|`` FP32 bits
    (uint32) and its E4M3 sign byte (uint32 0 or 0x80) for quantizing the stored value."""
    if TO_BF16:
        out = _bf16_bits(v)
        wide = (out << 16).to(tl.uint32, bitcast=True)
    else:
        out = v
        wide = v.to(tl.uint32, bitcast=True)
    return out, wide & 0x7FFFFFFF, (wide >> 24) & 0x80


@triton.jit
def _swiglu_fwd_kernel(h_ptr, o_ptr, R, F, s_h, s_o, OUT_BF16: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS))[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    _store_from_f32(o_ptr + rows * s_o + cols, g * _sigmoid(g) * u, mask, OUT_BF16)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, dh_ptr, o_ptr, fwd_ptr, R, F, s_h, s_dh, s_o, s_fwd,
                       OUT_BF16: tl.constexpr, FWD: tl.constexpr, FWD_BF16: tl.constexpr,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS))[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    dh = tl.load(dh_ptr + rows * s_dh + cols, mask=mask, other=0).to(tl.float32)
    sig = _sigmoid(g)
    _store_from_f32(o_ptr + rows * s_o + cols, dh * u * sig * (1 + g * (1 - sig)), mask, OUT_BF16)
    _store_from_f32(o_ptr + rows * s_o + F + cols, dh * g * sig, mask, OUT_BF16)
    if FWD:  # the forward's value, as _swiglu_fwd_kernel computes and stores it
        _store_from_f32(fwd_ptr + rows * s_fwd + cols, g * sig * u, mask, FWD_BF16)


@triton.jit
def _swiglu_quant_kernel(h_ptr, d_ptr, s_ptr, R, F, s_h, s_d, POW2: tl.constexpr,
                         BF16: tl.constexpr, ROWS: tl.constexpr, BF: tl.constexpr,
                         EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BF)[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    _, abs_bits, sign = _as_stored(g * _sigmoid(g) * u, BF16)  # masked: silu(0) * 0 = 0
    scale = _scale(tl.max(abs_bits, axis=1, keep_dims=True), POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(d_ptr + rows * s_d + cols, _encode(abs_bits, sign, scale), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < R)


@triton.jit
def _swiglu_bwd_quant_kernel(h_ptr, dh_ptr, o_ptr, d_ptr, s_ptr, fwd_ptr, R, F, s_h, s_dh, s_o,
                             s_d, s_fwd, POW2: tl.constexpr, BF16: tl.constexpr,
                             FWD: tl.constexpr, ROWS: tl.constexpr, BF: tl.constexpr,
                             EPS_BITS: tl.constexpr, SCALE_AT_EPS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BF)[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    dh = tl.load(dh_ptr + rows * s_dh + cols, mask=mask, other=0).to(tl.float32)
    sig = _sigmoid(g)
    out_g, abs_g, sign_g = _as_stored(dh * u * sig * (1 + g * (1 - sig)), BF16)
    out_u, abs_u, sign_u = _as_stored(dh * g * sig, BF16)
    tl.store(o_ptr + rows * s_o + cols, out_g.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + rows * s_o + F + cols, out_u.to(o_ptr.dtype.element_ty), mask=mask)
    amax = tl.maximum(tl.max(abs_g, axis=1, keep_dims=True), tl.max(abs_u, axis=1, keep_dims=True))
    scale = _scale(amax, POW2, EPS_BITS, SCALE_AT_EPS)
    tl.store(d_ptr + rows * s_d + cols, _encode(abs_g, sign_g, scale), mask=mask)
    tl.store(d_ptr + rows * s_d + F + cols, _encode(abs_u, sign_u, scale), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < R)
    if FWD:  # the forward's value, as _swiglu_fwd_kernel computes and stores it
        _store_from_f32(fwd_ptr + rows * s_fwd + cols, g * sig * u, mask, BF16)


def _grid(R: int, F: int) -> tuple[int, int]:
    return triton.cdiv(R, _ROWS), triton.cdiv(F, _COLS)


def _row_tile(kind: str, F: int) -> tuple[int, int, int]:
    """(rows per program, padded row width, warps) of quantizing kernel ``kind``: whole rows."""
    tile = _TILES[kind]
    width = triton.next_power_of_2(F)
    return max(1, tile.elements // width), width, tile.warps


def swiglu_forward(h13: torch.Tensor) -> torch.Tensor:
    h13 = h13.contiguous()
    R, F = h13.shape[0], h13.shape[1] // 2
    out = torch.empty(R, F, dtype=h13.dtype, device=h13.device)
    if out.numel():
        _swiglu_fwd_kernel[_grid(R, F)](h13, _bits_view(out), R, F, h13.stride(0), out.stride(0),
                                        OUT_BF16=out.dtype == torch.bfloat16, ROWS=_ROWS,
                                        COLS=_COLS, enable_fp_fusion=False)
    return out


def swiglu_backward(h13: torch.Tensor, dh: torch.Tensor, dtype: torch.dtype,
                    h_out: torch.Tensor | None = None) -> torch.Tensor:
    """``dh13`` in ``dtype``; ``h_out``: ``[R, F]`` in ``h13``'s dtype (row stride free,
    unit column stride) to receive ``swiglu(h13)`` as well."""
    h13, dh = h13.contiguous(), dh.contiguous()
    R, F = dh.shape
    out = torch.empty(R, 2 * F, dtype=dtype, device=h13.device)
    if out.numel():
        fwd = out if h_out is None else _bits_view(h_out)
        _swiglu_bwd_kernel[_grid(R, F)](h13, dh, _bits_view(out), fwd, R, F, h13.stride(0),
                                        dh.stride(0), out.stride(0), fwd.stride(0),
                                        OUT_BF16=dtype == torch.bfloat16, FWD=h_out is not None,
                                        FWD_BF16=h13.dtype == torch.bfloat16, ROWS=_ROWS,
                                        COLS=_COLS, enable_fp_fusion=False)
    return out


def swiglu_quantize_rows(h13: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise E4M3 of ``swiglu(h13)`` (BF16 or FP32 ``h13``): ``(data [R, F], scale [R, 1])``."""
    h13 = h13.contiguous()
    R, F = h13.shape[0], h13.shape[1] // 2
    data = torch.empty(R, F, dtype=torch.uint8, device=h13.device)
    scale = torch.empty(R, 1, dtype=torch.float32, device=h13.device)
    if R:
        rows, width, warps = _row_tile("swiglu", F)
        _swiglu_quant_kernel[(triton.cdiv(R, rows),)](
            h13, data, scale, R, F, h13.stride(0), data.stride(0), POW2=pow2,
            BF16=h13.dtype == torch.bfloat16, ROWS=rows, BF=width, num_warps=warps,
            enable_fp_fusion=False, **_CONSTS)
    return data.view(torch.float8_e4m3fn), scale


def swiglu_backward_quantize_rows(h13: torch.Tensor, dh: torch.Tensor, pow2: bool,
                                  h_out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh13`` in ``h13``'s dtype (BF16 or FP32) and its rowwise E4M3 ``(data, scale)``;
    ``h_out`` as :func:`swiglu_backward`'s."""
    h13, dh = h13.contiguous(), dh.contiguous()
    R, F = dh.shape
    out = torch.empty(R, 2 * F, dtype=h13.dtype, device=h13.device)
    data = torch.empty(R, 2 * F, dtype=torch.uint8, device=h13.device)
    scale = torch.empty(R, 1, dtype=torch.float32, device=h13.device)
    if R:
        rows, width, warps = _row_tile("swiglu_backward", F)
        fwd = out if h_out is None else _bits_view(h_out)
        _swiglu_bwd_quant_kernel[(triton.cdiv(R, rows),)](
            h13, dh, _bits_view(out), data, scale, fwd, R, F, h13.stride(0), dh.stride(0),
            out.stride(0), data.stride(0), fwd.stride(0), POW2=pow2,
            BF16=h13.dtype == torch.bfloat16, FWD=h_out is not None, ROWS=rows, BF=width,
            num_warps=warps, enable_fp_fusion=False, **_CONSTS)
    return out, data.view(torch.float8_e4m3fn), scale
