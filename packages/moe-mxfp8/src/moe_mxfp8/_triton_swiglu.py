"""Fused SwiGLU kernels (see ``moe_mxfp8.swiglu``): FP32 inside, one rounding on output.

Imported lazily. A program takes a ``[ROWS, COLS]`` tile of ``h`` and the matching
tiles of ``h1`` and ``h3`` (columns ``c`` and ``F + c`` of ``h13``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ROWS, _COLS = 16, 128


@triton.jit
def _swiglu_fwd_kernel(h_ptr, o_ptr, R, F, s_h, s_o, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS))[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    tl.store(o_ptr + rows * s_o + cols, (g * sig * u).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, dh_ptr, o_ptr, R, F, s_h, s_dh, s_o,
                       ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * COLS + tl.arange(0, COLS))[None, :]
    mask = (rows < R) & (cols < F)
    g = tl.load(h_ptr + rows * s_h + cols, mask=mask, other=0).to(tl.float32)
    u = tl.load(h_ptr + rows * s_h + F + cols, mask=mask, other=0).to(tl.float32)
    dh = tl.load(dh_ptr + rows * s_dh + cols, mask=mask, other=0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dh * u * sig * (1 + g * (1 - sig))
    du = dh * g * sig
    out = o_ptr.dtype.element_ty
    tl.store(o_ptr + rows * s_o + cols, dg.to(out), mask=mask)
    tl.store(o_ptr + rows * s_o + F + cols, du.to(out), mask=mask)


def _grid(R: int, F: int) -> tuple[int, int]:
    return triton.cdiv(R, _ROWS), triton.cdiv(F, _COLS)


def swiglu_forward(h13: torch.Tensor) -> torch.Tensor:
    h13 = h13.contiguous()
    R, F = h13.shape[0], h13.shape[1] // 2
    out = torch.empty(R, F, dtype=h13.dtype, device=h13.device)
    if out.numel():
        _swiglu_fwd_kernel[_grid(R, F)](h13, out, R, F, h13.stride(0), out.stride(0),
                                        ROWS=_ROWS, COLS=_COLS)
    return out


def swiglu_backward(h13: torch.Tensor, dh: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    h13, dh = h13.contiguous(), dh.contiguous()
    R, F = dh.shape
    out = torch.empty(R, 2 * F, dtype=dtype, device=h13.device)
    if out.numel():
        _swiglu_bwd_kernel[_grid(R, F)](h13, dh, out, R, F, h13.stride(0), dh.stride(0),
                                        out.stride(0), ROWS=_ROWS, COLS=_COLS)
    return out
