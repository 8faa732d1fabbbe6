"""Fused RMSNorm in Triton: forward and backward kernels and their autograd Function.

Importing this module requires Triton; ``moe_model.layers.RMSNorm`` imports it lazily,
only for CUDA inputs. ``rms_norm(x, weight, eps)`` computes what the reference
``moe_model.layers.rms_norm_reference`` computes, with its rounding:

    x32 = x.float(); rstd = rsqrt(mean(x32^2) + eps)      # FP32
    n = (x32 * rstd).to(x.dtype)                           # rounded to x's dtype
    y = weight * n                                         # dtype promote(weight, x)

Shape legend: R rows (every dimension but the last), D the normalised width.

- forward: one program per block of ``BLOCK_R`` rows reads x once and writes y and
  ``rstd [R]`` (FP32, the only thing saved for backward besides x and the weight).
- backward: ``n_prog`` programs walk contiguous chunks of rows, write dx and keep
  their rows' dweight contributions in registers; each program stores one FP32 row of
  partial sums ``[n_prog, D]``, which a ``.sum(0)`` reduces (deterministic: no
  atomics, a fixed grid for a given device and shape).
- ``add_rms_norm``: a residual connection and the norm reading it, ``h = x + branch`` and
  ``norm(h)``, in the same two kernels: the forward adds and stores h, the backward adds
  h's other gradient to dx. Two passes over ``[T, D]`` and two launches fewer than the
  add and the norm apart (149 -> 121 us forward + backward at bench-1gpu's microbatch on
  an H200), equal to them bit for bit.

The backward follows the reference's autograd rounding: the gradient reaching ``n``
is ``dy * weight`` rounded to y's dtype and then to x's dtype, and dweight sums
``dy * n`` rounded to y's dtype per element (as the reference's broadcasting multiply
does), in FP32. Inputs may be strided views: the leading dimensions are addressed
through up to three (size, stride) pairs, so the QK-norm input and its gradient (views
of ``[B, S, H, Dh]`` through a transpose) are read in place; y and dx are contiguous.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moe_model._triton_support import row_chunks
from moe_model.backward_needs import grads_needed

MAX_D = 8192  # the widest row kept in registers; wider rows take the reference path
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Elements of one program's [BLOCK_R, BLOCK_D] tile; CPU runs are the Triton
# interpreter, where small tiles give tests several programs at tiny shapes.
_TILE_ELEMENTS = {"cuda": 4096, "cpu": 512}
_BWD_PROGRAMS_PER_SM = 4  # backward grid: programs per SM (each adds one FP32 row of dW partials)


# --------------------------------------------------------------------- kernels
@triton.jit
def _row_offsets(rows, N1, N2, S0, S1, S2):
    """Element offset of each row's first element; row ``r`` is ``(i0, i1, i2)`` of
    leading dimensions ``[R / (N1 N2), N1, N2]`` with strides ``S0, S1, S2``."""
    r = rows.to(tl.int64)
    i2 = r % N2
    t = r // N2
    return (t // N1) * S0 + (t % N1) * S1 + i2 * S2


@triton.jit
def rms_norm_fwd_kernel(
    x_ptr, res_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr,
    R, D, eps,
    xN1, xN2, xS0, xS1, xS2,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    """``y = norm(x)``; with ``HAS_RESIDUAL`` the norm's input is ``h = x + res`` (rounded
    to x's dtype, as the eager add), stored to ``h_ptr`` (``res`` and ``h`` contiguous)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < R
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    x_off = _row_offsets(rows, xN1, xN2, xS0, xS1, xS2)
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        at = (rows.to(tl.int64) * D)[:, None] + cols[None, :]
        x = (x + tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + at, x, mask=mask)
        x = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (n * w[None, :]).to(y_ptr.dtype.element_ty)
    y_off = rows.to(tl.int64) * D
    tl.store(y_ptr + y_off[:, None] + cols[None, :], y, mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, g_in_ptr,
    R, D, rows_per_prog,
    xN1, xN2, xS0, xS1, xS2,
    dyN1, dyN2, dyS0, dyS1, dyS2,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GRAD_IN: tl.constexpr,
    WRITE_DX: tl.constexpr, WRITE_DW: tl.constexpr,
):
    """dx for rows ``[pid * rows_per_prog, (pid + 1) * rows_per_prog)`` and their
    dweight partial sum in row ``pid`` of ``dw_ptr [n_prog, D]`` (FP32). ``dy`` has
    y's dtype (its rounding is the reference autograd's). With ``HAS_GRAD_IN`` the
    input's other gradient ``g_in`` (contiguous, x's dtype) is added to dx, rounded as
    autograd's add of the two x-dtype gradients. ``WRITE_DX`` / ``WRITE_DW``: compute
    and store that gradient (one of them in a split backward's pass; the other pointer
    is then not touched)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, R)
    for start in range(row_start, row_end, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]
        x_off = _row_offsets(rows, xN1, xN2, xS0, xS1, xS2)
        dy_off = _row_offsets(rows, dyN1, dyN2, dyS0, dyS1, dyS2)
        x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + dy_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        if WRITE_DW:
            n = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
            dw += (dy * n).to(dy_ptr.dtype.element_ty).to(tl.float32)
        if WRITE_DX:
            dn = (dy * w[None, :]).to(dy_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
            dn = dn.to(tl.float32)
            # d/dx of x * rsqrt(mean(x^2) + eps): rstd * dn - x * rstd^3 * mean(dn * x)
            c = tl.sum(dn * x, axis=1) * (rstd * rstd * rstd) / D
            dx = dn * rstd[:, None] - x * c[:, None]
            dx_off = rows.to(tl.int64) * D
            if HAS_GRAD_IN:
                g_in = tl.load(g_in_ptr + dx_off[:, None] + cols[None, :], mask=mask, other=0.0)
                dx = dx.to(dx_ptr.dtype.element_ty).to(tl.float32) + g_in.to(tl.float32)
            tl.store(dx_ptr + dx_off[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if WRITE_DW:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw, axis=0), mask=col_ok)


# ------------------------------------------------------------------- launchers
def _rows_layout(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """``t`` (made contiguous only if needed) and ``(N1, N2, S0, S1, S2)`` addressing its
    rows in row-major order: the leading dimensions merged where their strides allow,
    at most three left. The last dimension must have stride 1."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        t = t.contiguous()
    sizes: list[int] = []
    strides: list[int] = []
    for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True):
        if n == 1:
            continue
        if sizes and strides[-1] == s * n:  # the outer dimension steps over this one whole
            sizes[-1] *= n
            strides[-1] = s
        else:
            sizes.append(n)
            strides.append(s)
    if len(sizes) > 3:
        return _rows_layout(t.contiguous())
    sizes = [1] * (3 - len(sizes)) + sizes
    strides = [0] * (3 - len(strides)) + strides
    return t, (sizes[1], sizes[2], strides[0], strides[1], strides[2])


def _launch_config(D: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of width D."""
    block_d = triton.next_power_of_2(D)
    tile = _TILE_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    block_r = max(1, tile // block_d)
    num_warps = min(16, max(1, block_r * block_d // 512))
    return block_r, block_d, num_warps


def _on_device(device: torch.device):  # noqa: ANN202 - a context manager
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rms_norm: unsupported dtypes x {x.dtype}, weight {weight.dtype}")
    if not 0 < x.shape[-1] <= MAX_D:
        raise ValueError(f"rms_norm: width {x.shape[-1]} outside 1..{MAX_D}")


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 branch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y contiguous with x's shape and dtype ``promote(weight, x)``, rstd [R] FP32, the
    norm's input). With ``branch`` (x's shape and dtype) the norm's input is ``h = x +
    branch``, returned contiguous; else it is ``x``."""
    _check(x, weight)
    if branch is not None and (branch.shape, branch.dtype, branch.device) != (x.shape, x.dtype, x.device):
        raise ValueError(f"rms_norm: branch {branch.dtype}{tuple(branch.shape)} on {branch.device} does "
                         f"not match x {x.dtype}{tuple(x.shape)} on {x.device}")
    D = x.shape[-1]
    R = x.numel() // D
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(R, dtype=torch.float32, device=x.device)
    h = x if branch is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if R == 0:
        return y, rstd, h
    xv, xl = _rows_layout(x)
    res = branch.contiguous() if branch is not None else xv
    block_r, block_d, num_warps = _launch_config(D, x.device)
    with _on_device(x.device):
        rms_norm_fwd_kernel[(triton.cdiv(R, block_r),)](
            xv, res, h, weight.contiguous(), y, rstd, R, D, eps, *xl,
            BLOCK_R=block_r, BLOCK_D=block_d, HAS_RESIDUAL=branch is not None, num_warps=num_warps,
        )
    return y, rstd, h


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 grad_in: torch.Tensor | None = None, need_dx: bool = True, need_dw: bool = True,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx contiguous with x's shape and dtype, dweight with the weight's dtype); with
    ``grad_in`` (x's other gradient), dx + grad_in in the same pass. ``need_dx`` /
    ``need_dw`` false: that gradient is neither computed nor written (``None``); the
    other is bit for bit what the full backward gives."""
    D = x.shape[-1]
    R = x.numel() // D
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    dy = dy.to(out_dtype)  # the reference's rounding assumes dy has y's dtype (it always does)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else None
    if R == 0:
        return dx, torch.zeros_like(weight) if need_dw else None
    if not (need_dx or need_dw):
        return None, None
    xv, xl = _rows_layout(x)
    dyv, dyl = _rows_layout(dy)
    block_r, block_d, num_warps = _launch_config(D, x.device)
    n_prog, rows_per_prog = row_chunks(R, block_r, x.device, _BWD_PROGRAMS_PER_SM)
    partial = torch.empty(n_prog, D, dtype=torch.float32, device=x.device) if need_dw else None
    g_in = grad_in.to(x.dtype).contiguous() if grad_in is not None and need_dx else None
    unused = xv  # a pointer for the kernel's arguments it does not touch
    with _on_device(x.device):
        rms_norm_bwd_kernel[(n_prog,)](
            dyv, xv, weight.contiguous(), rstd, unused if dx is None else dx,
            unused if partial is None else partial, unused if g_in is None else g_in,
            R, D, rows_per_prog, *xl, *dyl,
            BLOCK_R=block_r, BLOCK_D=block_d, HAS_GRAD_IN=g_in is not None,
            WRITE_DX=need_dx, WRITE_DW=need_dw, num_warps=num_warps,
        )
    return dx, None if partial is None else partial.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # noqa: ANN001
        y, rstd, _ = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple:  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        need = grads_needed(ctx)  # dx or dw only in a split (zero-bubble) backward
        dx, dw = rms_norm_bwd(dy, x, weight, rstd, need_dx=need[0], need_dw=need[1])
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Differentiable fused ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the
    last dimension (normalised in FP32), on CUDA (or on CPU under ``TRITON_INTERPRET=1``)."""
    return _RMSNormFunction.apply(x, weight, eps)


class _AddRMSNormFunction(torch.autograd.Function):
    """``(h, norm(h))`` for ``h = x + branch``: the add in the norm's forward kernel, and
    in the backward h's two gradients (from its later uses and from the norm) summed in
    the norm's backward kernel, instead of autograd's separate add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor,  # noqa: ANN001
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, rstd, h = rms_norm_fwd(x, weight, eps, branch)
        ctx.save_for_backward(h, weight, rstd)
        return h, y

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: torch.Tensor, dy: torch.Tensor) -> tuple:  # noqa: ANN001
        h, weight, rstd = ctx.saved_tensors
        need = grads_needed(ctx)
        dx, dw = rms_norm_bwd(dy, h, weight, rstd, grad_in=dh, need_dx=need[0] or need[1], need_dw=need[2])
        return dx if need[0] else None, dx if need[1] else None, dw, None


def add_rms_norm(x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable ``(h, rms_norm(h, weight, eps))`` for ``h = x + branch`` (same shape
    and dtype), one kernel each way."""
    return _AddRMSNormFunction.apply(x, branch, weight, eps)
