"""Triton kernel of the FP8 grouped GEMM (``gemm="triton"`` of ``moe_mxfp8.fp8_gemm``,
whose docstring states the contract). Importing this module requires Triton.

The tile walk (groups found from the device offsets, bands of m-tiles, one flat (tile,
k-step) loop per persistent program) has the shape of moe_model's BF16 grouped GEMM;
this package installs and runs without moe_model, so it keeps its own."""

import triton
import triton.language as tl


@triton.jit
def _locate_tile(offs_ptr, E, tile, tiles_n, BM: tl.constexpr, E_BLOCK: tl.constexpr):
    """Where work tile ``tile`` lies: its group, its index among the group's tiles, the
    group's first row and end row; and the tile count of all groups. Group ``e`` owns
    ``ceil(rows_e / BM) * tiles_n`` consecutive tiles, in group order (empty groups none)."""
    e = tl.arange(0, E_BLOCK)
    ends = tl.load(offs_ptr + e, mask=e < E, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=(e > 0) & (e < E), other=0)
    counts = tl.where(e < E, tl.cdiv(ends - starts, BM) * tiles_n, 0)
    first = tl.cumsum(counts, axis=0) - counts
    owner = (first <= tile) & (tile < first + counts)  # one group, or none past the last tile
    g = tl.sum(tl.where(owner, e, 0), axis=0)
    local = tile - tl.sum(tl.where(owner, first, 0), axis=0)
    start = tl.sum(tl.where(owner, starts, 0), axis=0)
    end = tl.sum(tl.where(owner, ends, 0), axis=0)
    return g, local, start, end, tl.sum(counts, axis=0)


@triton.jit
def _band_order(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(m-tile, n-tile) of a group's ``local``-th tile, walking bands of ``GROUP_M``
    m-tiles column by column, so that neighbouring programs share rows and weight columns
    in L2."""
    per_band = GROUP_M * tiles_n
    band = local // per_band
    height = tl.minimum(tiles_m - band * GROUP_M, GROUP_M)
    within = local - band * per_band
    return band * GROUP_M + within % height, within // height


@triton.jit
def _store_group_rows(y_desc, start, rows, row, col, tile):
    """Store ``tile`` at ``(row, col)`` of a group whose rows are ``[start, start + rows)``
    through ``y_desc`` (``fp8_gemm._group_rows_descriptor``): the TMA unit drops the rows
    past the group's end, so a tile that overhangs it leaves the next group's rows alone.

    The descriptor is 4-D, ``[2^31 - 2^16, 2^31 - 2^16, 2^30, N]`` with strides ``[2^34 -
    s, s, s, 1]`` (``s`` the row stride, in elements; fewer than 2^30 rows); the coordinates ``(2^30, start + rows, 2^30 - rows +
    row, col)`` address element ``(start + row) * s + col`` once the 64-bit address wraps
    around, and the third one is in bounds exactly while ``row < rows``. The same trick as
    Triton's ``triton.tools.ragged_tma``, whose device function does not run under the
    interpreter."""
    big = 0x40000000
    y_desc.store([big, start + rows, big - rows + row, col],
                 tl.reshape(tile, [1, 1, tile.shape[0], tile.shape[1]]))


@triton.jit
def fp8_rows_kernel(
    a, b, y_ptr, y_desc, offs_ptr, a_scale_ptr, b_scale_ptr,
    R, N, K, E, num_progs,
    stride_ar, stride_be, stride_bn, stride_yr, stride_asr, stride_bse, stride_bsn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    E_BLOCK: tl.constexpr, BLOCKWISE: tl.constexpr, FAST: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_K: tl.constexpr, ACCUMULATE: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """``y[r] = (a[r] / sa) @ (b[g(r)] / sb)^T`` for the rows of every group, E4M3 operands.

    ``a [R, K]`` and ``b [E, N, K]`` (K contiguous; with ``USE_TMA`` tensor descriptors of
    ``a`` and of ``b`` viewed ``[E * N, K]``, and ``K % BK == 0``). Scales: rowwise, ``sa
    [R]`` and ``sb [E, N]`` applied to the finished FP32 tile; ``BLOCKWISE``, ``sa [R,
    K/128]`` (1x128 tiles) and ``sb [E, N/128, K/128]`` (128x128 blocks) applied to each
    K step's product before it joins the FP32 sum (``BK`` divides 128); where ``BN``
    divides 128 a tile's columns share one weight block, whose scale is loaded once per
    step and folded into the rows' (the same products, one multiply per element). The
    product of a K step accumulates in the tensor cores; ``FAST`` (rowwise only) carries
    the running sum there too, otherwise every step's product is added in FP32 registers,
    the promotion every ``BK`` elements that DeepSeek-V3's recipe prescribes.

    Persistent: each program walks its tiles in one flat (tile, k-step) loop, so the
    software pipeline fetches the next tile's first blocks while the current one ends.
    Rows past a group's end are read (the next group's rows, or zeros past R) and never
    stored; columns past N likewise. ``ACCUMULATE``: ``y += ...`` (``y`` read in the
    epilogue and the sum rounded once), for products that add up to one result.
    ``TMA_STORE`` (not with ``ACCUMULATE``): the finished tile leaves through ``y_desc`` in
    two column halves (``_store_group_rows``), an asynchronous store the next tile's loads
    run under; half a tile of staging memory leaves room for another pipeline stage.
    """
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    _, _, _, _, total = _locate_tile(offs_ptr, E, 0, tiles_n, BM, E_BLOCK)
    my_tiles = tl.where(pid < total, tl.cdiv(total - pid, num_progs), 0)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    tile = pid - num_progs
    ki = -1
    g = 0
    g_start = 0
    g_end = 0
    row0 = 0
    col0 = 0
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, my_tiles * k_steps):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += num_progs
            g, local, g_start, g_end, _ = _locate_tile(offs_ptr, E, tile, tiles_n, BM, E_BLOCK)
            pid_m, pid_n = _band_order(local, tl.cdiv(g_end - g_start, BM), tiles_n, GROUP_M)
            row0 = g_start + pid_m * BM
            col0 = pid_n * BN
        k0 = ki * BK
        rows = tl.minimum(row0 + rm, R - 1)  # clamped: read, never stored
        cols = (col0 + rn) % N
        if USE_TMA:
            x = a.load([row0, k0])
            w = tl.trans(b.load([g * N + col0, k0]))
        else:
            a_ptrs = a + rows.to(tl.int64)[:, None] * stride_ar + (k0 + rk)[None, :]
            b_ptrs = b + g.to(tl.int64) * stride_be + cols[None, :] * stride_bn + (k0 + rk)[:, None]
            if EVEN_K:
                x = tl.load(a_ptrs)
                w = tl.load(b_ptrs)
            else:
                k_ok = k0 + rk < K
                x = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if BLOCKWISE:
            sa = tl.load(a_scale_ptr + rows.to(tl.int64) * stride_asr + k0 // 128)
            if 128 % BN == 0:  # the tile's columns lie in one weight block: one scale
                sb = tl.load(b_scale_ptr + g.to(tl.int64) * stride_bse + (col0 // 128) * stride_bsn + k0 // 128)
                acc += tl.dot(x, w) * ((1.0 / sa) * (1.0 / sb))[:, None]
            else:
                sb = tl.load(b_scale_ptr + g.to(tl.int64) * stride_bse + (cols // 128) * stride_bsn + k0 // 128)
                acc += tl.dot(x, w) * ((1.0 / sa)[:, None] * (1.0 / sb)[None, :])
        elif FAST:
            acc = tl.dot(x, w, acc)
        else:
            acc += tl.dot(x, w)
        if ki == k_steps - 1:
            if not BLOCKWISE:
                sa = tl.load(a_scale_ptr + rows.to(tl.int64) * stride_asr)
                sb = tl.load(b_scale_ptr + g.to(tl.int64) * stride_bse + cols * stride_bsn)
                acc = acc * (1.0 / sa)[:, None] * (1.0 / sb)[None, :]
            if TMA_STORE:
                halves = tl.permute(tl.reshape(acc.to(y_ptr.dtype.element_ty), (BM, 2, BN // 2)), (0, 2, 1))
                left, right = tl.split(halves)
                _store_group_rows(y_desc, g_start, g_end - g_start, row0 - g_start, col0, left)
                _store_group_rows(y_desc, g_start, g_end - g_start, row0 - g_start, col0 + BN // 2, right)
            else:
                out_rows = row0 + rm
                out_cols = col0 + rn
                y_ptrs = y_ptr + out_rows.to(tl.int64)[:, None] * stride_yr + out_cols[None, :]
                mask = (out_rows[:, None] < g_end) & (out_cols[None, :] < N)
                if ACCUMULATE:
                    acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            acc = tl.zeros((BM, BN), dtype=tl.float32)


@triton.jit
def fp8_wgrad_blocks_kernel(
    a_ptr, b_ptr, y_ptr, pends_ptr, a_scale_ptr, b_scale_ptr, N, K,
    stride_an, stride_bk, stride_ye, stride_yn, stride_as, stride_bs,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """``y[e] = sum_j (a[:, blk j] / sa[j]) @ (b[:, blk j] / sb[j])^T`` over the 128-column
    blocks ``j`` of group ``e``'s slot, E4M3 operands reduced over their columns (tokens).

    ``a [N, W]`` and ``b [K, W]`` (columns contiguous; each group's columns start at a
    multiple of 128, padding zero), group ``e``'s slot ending at ``pends[e]``; scales ``sa
    [W/128, N]`` and ``sb [W/128, K]``, one per row of a 128-column block. Each block's
    product accumulates in the tensor cores over its 128 columns (in steps of ``BK``,
    which divides 128), is scaled by the outer product of the two operands' reciprocal
    scales and added to the FP32 sum: the promotion every 128 elements of DeepSeek-V3's
    recipe. One program per (output tile, group); a group without rows stores zeros.
    ``ACCUMULATE``: ``y[e] +=`` instead, the FP32 sum added to ``y`` as loaded (a group
    without rows leaves it as it was).
    """
    pid, e = tl.program_id(0), tl.program_id(1)
    tiles_k = tl.cdiv(K, BN)
    pid_n, pid_k = pid // tiles_k, pid % tiles_k
    p_start = tl.load(pends_ptr + e - 1, mask=e > 0, other=0)
    p_end = tl.load(pends_ptr + e)
    rn = pid_n * BM + tl.arange(0, BM)
    rk = pid_k * BN + tl.arange(0, BN)
    rn_read = tl.minimum(rn, N - 1).to(tl.int64)  # clamped: read, never stored
    rk_read = tl.minimum(rk, K - 1).to(tl.int64)
    rt = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(p_start // 128, p_end // 128):
        part = tl.zeros((BM, BN), dtype=tl.float32)
        for t in tl.static_range(128 // BK):
            cols = j * 128 + t * BK + rt
            x = tl.load(a_ptr + rn_read[:, None] * stride_an + cols[None, :])
            w = tl.load(b_ptr + rk_read[:, None] * stride_bk + cols[None, :])
            part = tl.dot(x, tl.trans(w), part)
        sa = tl.load(a_scale_ptr + j * stride_as + rn_read)
        sb = tl.load(b_scale_ptr + j * stride_bs + rk_read)
        acc += part * ((1.0 / sa)[:, None] * (1.0 / sb)[None, :])
    y_ptrs = (y_ptr + e.to(tl.int64) * stride_ye + rn.to(tl.int64)[:, None] * stride_yn
              + rk[None, :])
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
