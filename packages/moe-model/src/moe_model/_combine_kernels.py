"""Triton kernels of the local dispatcher's fused combine (imported lazily by
``moe_model.dispatch``, whose ``weighted_gather_sum`` and ``combine_backward``
describe them). Importing this module requires Triton.

Offsets into the row buffers are int64 (``R * D`` can exceed 2^31); ``K`` (top-k) is
a compile-time constant. Slots whose ``kept`` is 0 are neither read nor written.
"""

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
def combine_backward_kernel(
    dy_ptr, rows_ptr, row_of_slot_ptr, w_ptr, kept_ptr, d_rows_ptr, d_w_ptr,
    T, D, stride_dy, stride_r, stride_dr,
    K: tl.constexpr, K_BLOCK: tl.constexpr, HAS_KEPT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """For a block of tokens and all their slots, walking D: ``d_rows[row_of_slot[s]] =
    w[s] * dy[t(s)]`` (kept slots only) and ``d_w[s] = kept[s] * dot(rows[row_of_slot[s]],
    dy[t(s)])`` in FP32. Each token's ``dy`` block is broadcast over its ``K`` slots
    ([BLOCK_T, K_BLOCK, BLOCK_D] tiles); no atomics."""
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
    # Per-block reductions over D (within a warp) keep registers low: no 3-D accumulator.
    dw = tl.zeros((BLOCK_T, K_BLOCK), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        d_ok = d < D
        g = tl.load(dy_base + d, mask=t_ok & d_ok, other=0.0).to(tl.float32)
        m = ok & d_ok
        x = tl.load(x_base + d, mask=m, other=0.0).to(tl.float32)
        dw += tl.sum(x * g, axis=2)
        tl.store(dr_base + d, (w * g).to(d_rows_ptr.dtype.element_ty), mask=m)
    if HAS_KEPT:
        dw = dw * kept
    tl.store(d_w_ptr + s, dw, mask=s_ok)
