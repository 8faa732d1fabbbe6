"""The local dispatcher's fused combine: Triton kernels and their launchers
``weighted_gather_sum`` and ``combine_backward`` (imported lazily by
``moe_model.dispatch``, whose docstring describes the design). Importing this module
requires Triton.

Offsets into the row buffers are int64 (``R * D`` can exceed 2^31); ``K`` (top-k) is
a compile-time constant. Slots whose ``kept`` is 0 are neither read nor written.
"""

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def weighted_gather_sum_kernel(
    rows_ptr, row_of_slot_ptr, w_ptr, kept_ptr, y_ptr,
    T, D, stride_r, stride_y,
    K: tl.constexpr, HAS_W: tl.constexpr, HAS_KEPT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``y[t, d] = sum_j w[t*K+j] * kept[t*K+j] * rows[row_of_slot[t*K+j], d]``,
    accumulated in FP32; one program per (token block, D block)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = t < T
    d_ok = d < D
    t64 = t.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        s = t64 * K + j
        r = tl.load(row_of_slot_ptr + s, mask=t_ok, other=0).to(tl.int64)
        ok = t_ok
        if HAS_KEPT:
            kept = tl.load(kept_ptr + s, mask=t_ok, other=0.0)
            ok = ok & (kept != 0)
        x = tl.load(rows_ptr + r[:, None] * stride_r + d[None, :],
                    mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + s, mask=t_ok, other=0.0).to(tl.float32)
            if HAS_KEPT:
                w = w * kept
            x = x * w[:, None]
        elif HAS_KEPT:
            x = x * kept[:, None]
        acc += x
    y_ptrs = y_ptr + t64[:, None] * stride_y + d[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])


@triton.jit
def _row_amax(top, w, g_min, g_nan):
    """The largest magnitude of a stored row ``(w * g).to(d_rows' dtype)`` over a token's
    ``g``, given ``top``, ``|w|`` times ``g``'s largest magnitude rounded as the row is
    stored, ``g``'s smallest magnitude and whether ``g`` holds a NaN (FP32).

    ``g -> |(w * g).to(dtype)|`` is non-decreasing in ``|g|`` (a product and a rounding to
    nearest, both symmetric in sign), so the row's largest magnitude is ``top``. The
    smallest magnitude covers an infinite ``w``: ``inf * 0`` puts a NaN in the row, as a
    NaN in ``g`` or in ``w`` does."""
    low = tl.abs(w) * g_min
    return tl.where(g_nan | (top != top) | (low != low), float("nan"), top)


@triton.jit
def combine_backward_kernel(
    dy_ptr, rows_ptr, row_of_slot_ptr, w_ptr, kept_ptr, d_rows_ptr, d_w_ptr, codes_ptr, scales_ptr,
    T, D, stride_dy, stride_r, stride_dr, stride_codes,
    K: tl.constexpr, K_BLOCK: tl.constexpr, HAS_KEPT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ENCODE: tl.constexpr, ROW_SCALE: tl.constexpr, ROW_ENCODE: tl.constexpr,
):
    """For a block of tokens and all their slots, walking D: ``d_rows[row_of_slot[s]] =
    w[s] * dy[t(s)]`` (kept slots only) and ``d_w[s] = kept[s] * dot(rows[row_of_slot[s]],
    dy[t(s)])`` in FP32. Each token's ``dy`` block is broadcast over its ``K`` slots
    ([BLOCK_T, K_BLOCK, BLOCK_D] tiles); no atomics.

    ``ENCODE``: also ``codes[row] = ROW_ENCODE(d_rows[row] as stored, scale)`` (uint8) and
    ``scales[row] = scale = ROW_SCALE(amax)``, ``amax`` the stored row's largest magnitude
    (``_row_amax``, from a first walk over the tokens' ``dy``). Only for launches where
    every slot is kept (codes of rows no slot writes are not written)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, K_BLOCK)
    t_ok = t < T
    t64 = t.to(tl.int64)
    s = t64[:, None] * K + j[None, :]  # [BLOCK_T, K_BLOCK]
    s_ok = t_ok[:, None] & (j < K)[None, :]
    r = tl.load(row_of_slot_ptr + s, mask=s_ok, other=0).to(tl.int64)
    w = tl.load(w_ptr + s, mask=s_ok, other=0.0).to(tl.float32)
    ok = s_ok
    if HAS_KEPT:
        kept = tl.load(kept_ptr + s, mask=s_ok, other=0.0)
        ok = ok & (kept != 0)
    x_base = (rows_ptr + r * stride_r)[:, :, None]  # [BLOCK_T, K_BLOCK, 1]
    dr_base = (d_rows_ptr + r * stride_dr)[:, :, None]
    dy_base = (dy_ptr + t64 * stride_dy)[:, None, None]  # [BLOCK_T, 1, 1]: shared by the slots
    ok = ok[:, :, None]
    t_ok = t_ok[:, None, None]
    w = w[:, :, None]
    cols = tl.arange(0, BLOCK_D)[None, None, :]
    if ENCODE:
        g_amax = tl.zeros((BLOCK_T, 1, 1), dtype=tl.float32)
        g_min = tl.full((BLOCK_T, 1, 1), float("inf"), dtype=tl.float32)
        g_nan = tl.zeros((BLOCK_T, 1, 1), dtype=tl.int1)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + cols
            g = tl.abs(tl.load(dy_base + d, mask=t_ok & (d < D), other=0.0).to(tl.float32))
            g_amax = tl.maximum(g_amax, tl.max(g, axis=2, keep_dims=True))
            g_min = tl.minimum(g_min, tl.min(tl.where(d < D, g, float("inf")), axis=2, keep_dims=True))
            g_nan = g_nan | (tl.max((g != g).to(tl.int32), axis=2, keep_dims=True) != 0)
        top = (tl.abs(w) * g_amax).to(d_rows_ptr.dtype.element_ty).to(tl.float32)
        scale = ROW_SCALE(_row_amax(top, w, g_min, g_nan))  # [BLOCK_T, K_BLOCK, 1]
        code_base = (codes_ptr + r * stride_codes)[:, :, None]
        tl.store(scales_ptr + r[:, :, None], scale, mask=ok)
    # Per-block reductions over D (within a warp) keep registers low: no 3-D accumulator.
    dw = tl.zeros((BLOCK_T, K_BLOCK), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        d_ok = d < D
        g = tl.load(dy_base + d, mask=t_ok & d_ok, other=0.0).to(tl.float32)
        m = ok & d_ok
        x = tl.load(x_base + d, mask=m, other=0.0).to(tl.float32)
        dw += tl.sum(x * g, axis=2)
        v = (w * g).to(d_rows_ptr.dtype.element_ty)
        tl.store(dr_base + d, v, mask=m)
        if ENCODE:
            tl.store(code_base + d, ROW_ENCODE(v.to(tl.float32), scale), mask=m)
    if HAS_KEPT:
        dw = dw * kept
    tl.store(d_w_ptr + s, dw, mask=s_ok)


# --- launchers ---------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchShape:
    """A GPU launch shape of the row-moving kernels (this module's and ``_gather_kernels``'):
    the widest D block a program takes at once, the elements of a program's tile (rows
    times D columns, times the padded ``k`` in the combine's backward) and its warps."""

    block_d: int
    tile: int
    num_warps: int


# Per kernel kind, the fastest of `tools/from_source.sh python3 tools/sweep_dispatch_kernels.py
# --out $OUT/sweep.json` at bench-1gpu's layer shapes (8192 tokens, top-8, D 2048; one H100,
# commit eb56bdc, tools/results/sweep_dispatch_kernels_h100.json) or within 2.5% of it:
# 0.114, 0.211 and 0.291 ms. CPU runs are the Triton interpreter (tests), where small blocks
# exercise the tails.
_GPU = {
    "gather_sum": LaunchShape(block_d=256, tile=2048, num_warps=4),
    "backward": LaunchShape(block_d=512, tile=4096, num_warps=8),
    "backward_codes": LaunchShape(block_d=512, tile=8192, num_warps=4),
}
_CPU_BLOCK_T, _CPU_BLOCK_D = 4, 16


def default_launch(kind: str) -> LaunchShape:
    """The GPU launch shape of kernel ``kind``: ``gather_sum`` (the combine's forward and
    the gather's backward), ``backward`` (the combine's) or ``backward_codes`` (the
    combine's backward that also writes an encoder's codes)."""
    if kind not in _GPU:
        raise ValueError(f"combine kernel kind must be one of {sorted(_GPU)}, got {kind!r}")
    return _GPU[kind]


def _blocks(device: torch.device, T: int, D: int, launch: LaunchShape, tile: int) -> tuple[int, int]:
    """(tokens, D columns) per program: ``tokens * columns`` about ``tile`` on a GPU."""
    if device.type != "cuda":
        return _CPU_BLOCK_T, _CPU_BLOCK_D
    block_d = min(launch.block_d, triton.next_power_of_2(max(D, 1)))
    block_t = max(1, min(tile // block_d, triton.next_power_of_2(max(T, 1))))
    return block_t, block_d


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (row strides are passed to the kernels)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def weighted_gather_sum(
    rows_RD: torch.Tensor, row_of_slot_S: torch.Tensor, n_tokens: int,
    weights: torch.Tensor | None = None, kept_S: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, launch: LaunchShape | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * kept[t,j] * rows[row_of_slot[t*k+j]]`` (Triton; FP32 accumulation).

    ``weights`` (``[T,k]`` or ``[T*k]``, FP32) and ``kept_S`` (``[T*k]`` FP32, 1 kept /
    0 dropped; dropped slots' rows are not read) default to ones. Returns ``[T, D]``
    in ``out_dtype`` (default: ``rows_RD``'s dtype). One program per (token block,
    D block): it reads its tokens' ``k`` rows once and writes ``y`` once. ``launch``:
    the GPU launch shape (default: ``default_launch("gather_sum")``).
    """
    T, D = n_tokens, rows_RD.shape[1]
    k = row_of_slot_S.shape[0] // max(T, 1)
    y_TD = torch.empty(T, D, dtype=out_dtype or rows_RD.dtype, device=rows_RD.device)
    if T == 0 or D == 0:
        return y_TD
    if k == 0:
        return y_TD.zero_()
    rows_RD = _row_major(rows_RD)
    launch = launch or default_launch("gather_sum")
    block_t, block_d = _blocks(rows_RD.device, T, D, launch, launch.tile)
    row_of_slot_S = row_of_slot_S.contiguous()
    w_S = weights.reshape(-1).contiguous() if weights is not None else None
    kept_S = kept_S.contiguous() if kept_S is not None else None
    grid = (triton.cdiv(T, block_t), triton.cdiv(D, block_d))
    weighted_gather_sum_kernel[grid](
        rows_RD, row_of_slot_S, w_S if w_S is not None else row_of_slot_S,
        kept_S if kept_S is not None else row_of_slot_S, y_TD,
        T, D, rows_RD.stride(0), y_TD.stride(0),
        K=k, HAS_W=w_S is not None, HAS_KEPT=kept_S is not None,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=launch.num_warps,
    )
    return y_TD


def combine_backward(
    dy_TD: torch.Tensor, rows_out_RD: torch.Tensor, row_of_slot_S: torch.Tensor,
    w_S: torch.Tensor, kept_S: torch.Tensor | None, n_rows: int, zero_fill: bool | None = None,
    encoder: Any = None, launch: LaunchShape | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``y[t] = sum_j w_S[t*k+j] * rows_out[row_of_slot[t*k+j]]`` (Triton).

    ``w_S`` are the FP32 slot weights already multiplied by ``kept_S``. Returns
    ``d_rows[n_rows, D]`` in ``rows_out``'s dtype, ``d_rows[row_of_slot[s]] = w_S[s] *
    dy[t(s)]`` for kept slots (each row is written by at most one kept slot) and zero
    for rows no kept slot writes when ``zero_fill`` (default: ``kept_S is not None``;
    in dropless mode every row is written), and ``d_w[T, k]`` FP32, ``d_w[t,j] =
    kept * dot(rows_out[row_of_slot[t*k+j]], dy[t])``. One program per token block
    walks all of D: it reads ``rows_out`` and ``dy`` once and writes ``d_rows`` once.

    ``encoder`` (a ``moe_model.row_encoding.RowEncoder``; only where every row is
    written: no ``kept_S``, no ``zero_fill``): also ``d_rows``' per-row codes ``[n_rows, D]``
    (uint8) and scales ``[n_rows, 1]`` (FP32), written in the same pass after a first walk
    over ``dy`` for each token's largest magnitude; else (and where there is nothing to
    encode: no tokens, slots or columns) those two are ``None``. That launch runs without
    FMA contraction (the encoder's rounding steps need it), so ``d_w``'s dot products
    round apart from a launch without an encoder (``d_rows`` does not change).
    ``launch``: the GPU launch shape (default: ``default_launch`` of ``backward`` or,
    with an encoder, ``backward_codes``).
    """
    T, D = dy_TD.shape
    k = w_S.shape[0] // max(T, 1)
    if zero_fill is None:
        zero_fill = kept_S is not None
    if encoder is not None and (zero_fill or kept_S is not None or n_rows != T * k):
        raise ValueError("combine_backward: an encoder needs every row written (dropless, "
                         f"n_rows == T*k), got kept_S={kept_S is not None}, zero_fill={zero_fill}, "
                         f"n_rows={n_rows}, T*k={T * k}")
    alloc = torch.zeros if zero_fill else torch.empty
    dev = rows_out_RD.device
    d_rows_RD = alloc(n_rows, D, dtype=rows_out_RD.dtype, device=dev)
    d_weights_Tk = torch.empty(T, k, dtype=torch.float32, device=dev)
    if T == 0 or k == 0:
        return d_rows_RD, d_weights_Tk, None, None
    if D == 0:
        return d_rows_RD, d_weights_Tk.zero_(), None, None
    codes_RD = scales_R1 = None
    if encoder is not None:
        codes_RD = torch.empty(n_rows, D, dtype=torch.uint8, device=dev)
        scales_R1 = torch.empty(n_rows, 1, dtype=torch.float32, device=dev)
    dy_TD, rows_out_RD = _row_major(dy_TD), _row_major(rows_out_RD)
    row_of_slot_S, w_S = row_of_slot_S.contiguous(), w_S.contiguous()
    kept_S = kept_S.contiguous() if kept_S is not None else None
    k_block = triton.next_power_of_2(k)
    launch = launch or default_launch("backward" if encoder is None else "backward_codes")
    block_t, block_d = _blocks(dev, T, D, launch, launch.tile // k_block)
    combine_backward_kernel[(triton.cdiv(T, block_t),)](
        dy_TD, rows_out_RD, row_of_slot_S, w_S, kept_S if kept_S is not None else w_S,
        d_rows_RD, d_weights_Tk,
        codes_RD if codes_RD is not None else d_rows_RD, scales_R1 if scales_R1 is not None else w_S,
        T, D, dy_TD.stride(0), rows_out_RD.stride(0), d_rows_RD.stride(0),
        codes_RD.stride(0) if codes_RD is not None else 0,
        K=k, K_BLOCK=k_block, HAS_KEPT=kept_S is not None,
        BLOCK_T=block_t, BLOCK_D=block_d,
        ENCODE=encoder is not None,
        ROW_SCALE=None if encoder is None else encoder.row_scale,
        ROW_ENCODE=None if encoder is None else encoder.row_encode,
        # an encoder's rounding steps are exact only without FMA contraction
        num_warps=launch.num_warps, enable_fp_fusion=encoder is None,
    )
    return d_rows_RD, d_weights_Tk, codes_RD, scales_R1
