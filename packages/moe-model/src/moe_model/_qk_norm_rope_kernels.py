"""QK-norm and RoPE in one Triton kernel each way, for attention's query and key heads.

Shape legend: B batch, S sequence, H heads, Dh head dim (even), half = Dh / 2; R = B*S*H
head vectors ("rows").

The attention block normalises each query and key head vector (RMSNorm over Dh,
``qk_norm``) and then rotates it (RoPE). Run apart (``_rms_norm_kernels``, then
``_rope_kernels``) that is two passes over q and k each way, and the backward adds the
norms' weight-gradient reductions and dtype casts: 215 us per attention block and
microbatch at ``bench-1gpu``'s shapes on an H200 (8192 tokens, 16 + 4 heads of 128),
56 of them forward. Here each head vector is read once and written once each way.

The arithmetic and its roundings are the two kernels' in sequence (``bf``: rounding to
the activations' dtype; FP32 otherwise):

    forward:  rstd = rsqrt(mean(x^2) + eps); n = bf(x * rstd); y = bf(w * n)
              out = bf(y1 * cos - y2 * sin), bf(y2 * cos + y1 * sin)   (y1, y2: halves)
    backward: the inverse rotation of the output's gradient g, rounded as RoPE's
              backward returns it: dy = bf(g1 * cos + g2 * sin), bf(g2 * cos - g1 * sin);
              then RMSNorm's backward on dy: dn = bf(dy * w), dw = sum bf(dy * n),
              dx = dn * rstd - x * rstd^3 * mean(dn * x)

so the result is what the two kernels give, up to the FP32 order of the norm's sums
(the mean of squares here adds the two halves' sums). The weight gradient is summed per
program into FP32 partial rows, then over them (deterministic: no atomics).

Input: the projection's output as ``[B, S, H, Dh]`` (contiguous); output in the same
layout, which the caller sees as ``[B, H, S, Dh]`` through a transpose, as before.
Importing this module requires Triton; ``moe_model.layers`` imports it only for CUDA
inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moe_model._triton_support import row_chunks
from moe_model.backward_needs import grads_needed

# elements of one program's [BLOCK_R, Dh] tile; CPU runs are the Triton interpreter,
# where small tiles give tests several programs at tiny shapes
_TILE_ELEMENTS = {"cuda": 4096, "cpu": 64}
_BWD_PROGRAMS_PER_SM = 4  # backward grid: programs per SM (each adds one FP32 row of dW partials)


@triton.jit
def qk_norm_rope_fwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr,
    R, H, S, eps, cos_stride,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_HALF)
    row_ok = rows < R
    d_ok = d < HALF
    mask = row_ok[:, None] & d_ok[None, :]
    r64 = rows.to(tl.int64)
    at = r64[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    y1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
    y2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    table = ((r64 // H) % S)[:, None] * cos_stride + d[None, :]
    c = tl.load(cos_ptr + table, mask=mask, other=0.0)
    sn = tl.load(sin_ptr + table, mask=mask, other=0.0)
    tl.store(out_ptr + at, (y1 * c - y2 * sn).to(dtype), mask=mask)
    tl.store(out_ptr + at + HALF, (y2 * c + y1 * sn).to(dtype), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def qk_norm_rope_bwd_kernel(
    g_ptr, x_ptr, w_ptr, rstd_ptr, cos_ptr, sin_ptr, dx_ptr, dw_ptr,
    R, H, S, rows_per_prog, g_sb, g_ss, g_sh, cos_stride,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
    WRITE_DX: tl.constexpr, WRITE_DW: tl.constexpr,
):
    """dx for rows ``[pid * rows_per_prog, (pid + 1) * rows_per_prog)`` and their dweight
    partial sum in row ``pid`` of ``dw_ptr [n_prog, Dh]`` (FP32). ``g`` (the output's
    gradient) may be any ``[B, S, H, Dh]`` view whose last dimension is contiguous.
    ``WRITE_DX`` / ``WRITE_DW``: compute and store that gradient (one of them in a split
    backward's pass; the other pointer is then not touched)."""
    pid = tl.program_id(0)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    dw1 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_R, BLOCK_HALF], dtype=tl.float32)
    dtype = x_ptr.dtype.element_ty
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, R)
    for start in range(row_start, row_end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        mask = row_ok[:, None] & d_ok[None, :]
        r64 = rows.to(tl.int64)
        h = r64 % H
        s = (r64 // H) % S
        b = r64 // (H * S)
        g_at = (b * g_sb + s * g_ss + h * g_sh)[:, None] + d[None, :]
        g1 = tl.load(g_ptr + g_at, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(g_ptr + g_at + HALF, mask=mask, other=0.0).to(tl.float32)
        table = s[:, None] * cos_stride + d[None, :]
        c = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sn = -tl.load(sin_ptr + table, mask=mask, other=0.0)  # the inverse rotation
        dy1 = (g1 * c - g2 * sn).to(dtype).to(tl.float32)
        dy2 = (g2 * c + g1 * sn).to(dtype).to(tl.float32)
        at = r64[:, None] * (2 * HALF) + d[None, :]
        x1 = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + at + HALF, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if WRITE_DW:
            n1 = (x1 * rstd[:, None]).to(dtype).to(tl.float32)
            n2 = (x2 * rstd[:, None]).to(dtype).to(tl.float32)
            dw1 += (dy1 * n1).to(dtype).to(tl.float32)
            dw2 += (dy2 * n2).to(dtype).to(tl.float32)
        if WRITE_DX:
            dn1 = (dy1 * w1[None, :]).to(dtype).to(tl.float32)
            dn2 = (dy2 * w2[None, :]).to(dtype).to(tl.float32)
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * dn - x * rstd^3 * mean(dn * x)
            k = (tl.sum(dn1 * x1, axis=1) + tl.sum(dn2 * x2, axis=1)) * (rstd * rstd * rstd) / (2 * HALF)
            tl.store(dx_ptr + at, (dn1 * rstd[:, None] - x1 * k[:, None]).to(dtype), mask=mask)
            tl.store(dx_ptr + at + HALF, (dn2 * rstd[:, None] - x2 * k[:, None]).to(dtype), mask=mask)
    if WRITE_DW:
        dw_row = dw_ptr + pid.to(tl.int64) * (2 * HALF)
        tl.store(dw_row + d, tl.sum(dw1, axis=0), mask=d_ok)
        tl.store(dw_row + HALF + d, tl.sum(dw2, axis=0), mask=d_ok)


# tile elements per warp: the backward holds about twice the forward's tile-sized arrays
# per thread, and ran fastest with half the forward's warps (H200, bench-1gpu's q and k:
# 41 -> 37 and 34 -> 23 us per launch against 8 warps; the kernels' times in
# tools/bench_train_step.py --config bench-1gpu --profile)
_ELEMENTS_PER_WARP = {"forward": 256, "backward": 512}


def _launch_shape(Dh: int, device: torch.device, direction: str) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_HALF, num_warps) for head vectors of width Dh, ``direction``
    ``forward`` or ``backward``."""
    block_half = triton.next_power_of_2(Dh // 2)
    tile = _TILE_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    block_r = max(1, tile // (2 * block_half))
    return block_r, block_half, min(8, max(1, block_r * block_half // _ELEMENTS_PER_WARP[direction]))


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the fused kernels take these: same dtype for x and the norm's weight (the
    training path: parameters held in the compute dtype) and an even head dim."""
    return (x.dim() == 4 and x.shape[-1] % 2 == 0 and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.device == x.device)


def qk_norm_rope_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, H, Dh] contiguous, rstd [R] FP32) for x [B, S, H, Dh]."""
    B, S, H, Dh = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    R = B * S * H
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return out, rstd
    cos, sin = cos.contiguous(), sin.contiguous()
    block_r, block_half, num_warps = _launch_shape(Dh, x.device, "forward")
    qk_norm_rope_fwd_kernel[(triton.cdiv(R, block_r),)](
        x, weight.contiguous(), cos, sin, out, rstd, R, H, S, eps, cos.stride(0),
        HALF=Dh // 2, BLOCK_R=block_r, BLOCK_HALF=block_half, num_warps=num_warps,
    )
    return out, rstd


def qk_norm_rope_bwd(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, need_dx: bool = True, need_dw: bool = True,
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx [B, S, H, Dh] contiguous, dweight) for the output's gradient ``g`` [B, S, H, Dh].
    ``need_dx`` / ``need_dw`` false: that gradient is neither computed nor written
    (``None``); the other is bit for bit what the full backward gives."""
    B, S, H, Dh = x.shape
    R = B * S * H
    dx = torch.empty_like(x) if need_dx else None
    if R == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    if not (need_dx or need_dw):
        return None, None
    if g.stride(-1) != 1:
        g = g.contiguous()
    block_r, block_half, num_warps = _launch_shape(Dh, x.device, "backward")
    n_prog, rows_per_prog = row_chunks(R, block_r, x.device, _BWD_PROGRAMS_PER_SM)
    partial = torch.empty(n_prog, Dh, dtype=torch.float32, device=x.device) if need_dw else None
    qk_norm_rope_bwd_kernel[(n_prog,)](
        g, x, weight.contiguous(), rstd, cos, sin, x if dx is None else dx, x if partial is None else partial,
        R, H, S, rows_per_prog, g.stride(0), g.stride(1), g.stride(2), cos.stride(0),
        HALF=Dh // 2, BLOCK_R=block_r, BLOCK_HALF=block_half, WRITE_DX=need_dx, WRITE_DW=need_dw,
        num_warps=num_warps,
    )
    return dx, None if partial is None else partial.sum(0).to(weight.dtype)


class QKNormRope(torch.autograd.Function):
    """RMSNorm over each head vector, then RoPE: ``[B, S, H, Dh] -> [B, S, H, Dh]``; the
    tables are constants (no gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x, cos, sin = x.contiguous(), cos.contiguous(), sin.contiguous()
        out, rstd = qk_norm_rope_fwd(x, weight, eps, cos, sin)
        ctx.save_for_backward(x, weight, rstd, cos, sin)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple:  # noqa: ANN001
        x, weight, rstd, cos, sin = ctx.saved_tensors
        need = grads_needed(ctx, (0, 1, 3, 4))  # dx or dw only in a split (zero-bubble) backward
        dx, dw = qk_norm_rope_bwd(g, x, weight, rstd, cos, sin, need_dx=need[0], need_dw=need[1])
        return dx, dw, None, None, None
