"""SwiGLU's elementwise part, ``h = silu(g) * u``, in one Triton kernel each way, for
CUDA tensors.

The eager form (``F.silu(g) * u``) runs two kernels forward and three backward and
keeps three tensors for the backward (g, silu(g), u). Here the forward reads g and u
and writes h; the backward reads dh, g and u and writes dg and du; only g and u are
kept. With s = sigmoid(g), in FP32 and rounded once to the inputs' dtype:

    h  = g * s * u
    du = dh * g * s
    dg = dh * u * s * (1 + g * (1 - s))

At the bench-1gpu expert shapes (65k rows x 1024 per layer and microbatch, BF16)
that is 0.4 GB instead of 0.67 GB moved forward, 0.67 instead of 1.2 GB backward,
and one [rows, hidden] tensor less kept per layer. With a row bound (a device tensor:
the expert rows of an expert-parallel receive buffer end there, the rest is padding
sized for the worst case) rows past it are neither read nor written, so a half-full
buffer costs half. Importing this module requires Triton (``moe_model.layers.swiglu``
imports it only for CUDA inputs).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _live(n, bound_ptr, width, HAS_BOUND: tl.constexpr, BLOCK: tl.constexpr):
    """This program's element offsets and which of them lie before the end (and the row bound)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_BOUND:
        n = tl.minimum(n, tl.load(bound_ptr).to(tl.int64) * width)
    return offs, offs < n


@triton.jit
def swiglu_forward_kernel(g_ptr, u_ptr, h_ptr, n, bound_ptr, width, HAS_BOUND: tl.constexpr,
                          BLOCK: tl.constexpr):
    offs, mask = _live(n, bound_ptr, width, HAS_BOUND, BLOCK)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(h_ptr + offs, h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward_kernel(dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, bound_ptr, width,
                           HAS_BOUND: tl.constexpr, BLOCK: tl.constexpr):
    offs, mask = _live(n, bound_ptr, width, HAS_BOUND, BLOCK)
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(du_ptr + offs, (dh * g * s).to(du_ptr.dtype.element_ty), mask=mask)
    dg = dh * u * s * (1.0 + g * (1.0 - s))
    tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, _BLOCK),)


class FusedSwiGLU(torch.autograd.Function):
    """``silu(g) * u`` with one kernel each way (``g`` and ``u`` of one shape and dtype).

    ``rows``: ``None``, or a one-element integer device tensor; rows of ``g`` (its first
    dimension) at or past its value are padding, left unset in the output and the
    gradients.
    """

    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        g, u = g.contiguous(), u.contiguous()
        h = torch.empty_like(g)
        bound, width = _bound(g, rows)
        if g.numel():
            swiglu_forward_kernel[_grid(g.numel())](g, u, h, g.numel(), bound, width, HAS_BOUND=rows is not None,
                                                    BLOCK=_BLOCK, num_warps=8)
        ctx.save_for_backward(g, u, rows)
        return h

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        g, u, rows = ctx.saved_tensors
        dh = dh.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        bound, width = _bound(g, rows)
        if g.numel():
            swiglu_backward_kernel[_grid(g.numel())](dh, g, u, dg, du, g.numel(), bound, width,
                                                     HAS_BOUND=rows is not None, BLOCK=_BLOCK, num_warps=8)
        return dg, du, None


def _bound(g: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """The kernel's row-bound pointer (``g`` itself when there is none: never read) and
    elements per row."""
    if rows is None:
        return g, 1
    if rows.numel() != 1 or rows.dtype.is_floating_point or rows.device != g.device:
        raise ValueError(
            f"swiglu: rows must be a one-element integer tensor on {g.device}, got "
            f"{rows.dtype} {tuple(rows.shape)} on {rows.device}"
        )
    return rows, g[0].numel() if g.shape[0] else 1
