"""Rotary embeddings in one Triton kernel (forward and backward), for CUDA tensors.

Shape legend: B batch, H heads, S sequence, Dh head dim (even), half = Dh / 2.

The eager form (``layers.apply_rope``: slice, concatenate, two FP32 upcasts, two
multiplies, an add and a downcast, and as many kernels again in the backward) moves
about 12 bytes per element through memory several times over; at 8192 tokens x 16
heads x 128 that is ~2.7 GB per layer and microbatch for q and k. Here each element
is read once and written once (2 + 2 bytes in BF16), the tables once per position:

    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin          (x1, x2: the two halves of x)

in FP32, rounded once to x's dtype. The backward is the same rotation with ``-sin``
(a rotation's transpose), so one kernel serves both with a sign parameter. Inputs
may be any strided view whose last dimension is contiguous (q and k arrive as
``[B, S, H, Dh]`` memory seen as ``[B, H, S, Dh]``); the output keeps the input's
layout, as the eager elementwise ops do. Importing this module requires Triton
(``moe_model.layers.apply_rope`` imports it only for CUDA inputs).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK_S = 16


@triton.jit
def rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, S, sxb, sxh, sxs, sob, soh, sos,
                scs, SIGN: tl.constexpr, HALF: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_HALF: tl.constexpr):
    pid_s, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_HALF)
    mask = (s[:, None] < S) & (d[None, :] < HALF)
    s64 = s.to(tl.int64)[:, None]
    x_row = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + s64 * sxs + d[None, :]
    o_row = out_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh + s64 * sos + d[None, :]
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    table = s64 * scs + d[None, :]
    c = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + table, mask=mask, other=0.0) * SIGN
    tl.store(o_row, (x1 * c - x2 * sn).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + HALF, (x2 * c + x1 * sn).to(out_ptr.dtype.element_ty), mask=mask)


def rope_rotate(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor,
                sign: float) -> torch.Tensor:
    """Rotate ``x`` by the tables (``sign=-1``: the inverse rotation, the backward)."""
    B, H, S, Dh = x_BHSDh.shape
    if x_BHSDh.stride(-1) != 1:
        x_BHSDh = x_BHSDh.contiguous()
    out = torch.empty_like(x_BHSDh)
    if out.stride(-1) != 1:
        out = torch.empty(B, H, S, Dh, dtype=x_BHSDh.dtype, device=x_BHSDh.device)
    cos_SDh, sin_SDh = cos_SDh.contiguous(), sin_SDh.contiguous()
    half = Dh // 2
    grid = (triton.cdiv(S, _BLOCK_S), H, B)
    rope_kernel[grid](
        x_BHSDh, out, cos_SDh, sin_SDh, S, *x_BHSDh.stride()[:3], *out.stride()[:3],
        cos_SDh.stride(0), SIGN=sign, HALF=half, BLOCK_S=_BLOCK_S,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    return out


class FusedRope(torch.autograd.Function):
    """``apply_rope`` with one kernel each way; the tables are constants (no gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rope_rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rope_rotate(grad, cos, sin, -1.0), None, None
