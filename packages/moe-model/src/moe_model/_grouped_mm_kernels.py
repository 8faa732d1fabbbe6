"""Triton kernels of the grouped GEMM (imported lazily by ``moe_model._grouped_mm_launch``,
whose docstring describes them). Importing this module requires Triton."""

import triton
import triton.language as tl


@triton.jit
def group_of_tile(offs_ptr, E, tile, tiles_n, BM: tl.constexpr, E_BLOCK: tl.constexpr):
    """(group, first tile of the group, group row start, group row end) of ``tile``."""
    idx = tl.arange(0, E_BLOCK)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    tiles = tl.where(idx < E, tl.cdiv(ends - starts, BM) * tiles_n, 0)
    cum = tl.cumsum(tiles, axis=0)
    g = tl.sum((cum <= tile).to(tl.int32), axis=0)
    base = tl.max(tl.where(cum <= tile, cum, 0), axis=0)
    g_start = tl.sum(tl.where(idx == g, starts, 0), axis=0)
    g_end = tl.sum(tl.where(idx == g, ends, 0), axis=0)
    return g, base, g_start, g_end, tl.sum(tiles, axis=0)


@triton.jit
def swizzle(local, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    width = GROUP_M * tiles_n
    first_m = (local // width) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (local % width) % size_m, (local % width) // size_m


@triton.jit
def rows_kernel(
    x, w, y_ptr, offs_ptr, x1, w1, y1_ptr,
    R, N, K, E, num_progs, flip_x, flip_w,
    stride_xr, stride_we, stride_wk, stride_wn, stride_yr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    E_BLOCK: tl.constexpr, W_K_CONTIGUOUS: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr, PRECISION: tl.constexpr, PAIR: tl.constexpr,
):
    """``y[r] = x[r] @ w[g(r)]``. With ``USE_TMA``, ``x`` is a tensor descriptor of
    ``[R, K]`` and ``w`` one of the 2-D weight view (``[E*N, K]`` if K is contiguous,
    else ``[E*K, N]``), and ``K % BK == 0``; otherwise both are pointers.

    Two operand pairs in one launch (``x1``, ``w1``, ``y1_ptr`` are read only then):
    ``PAIR == 1`` sums them over a reduction twice as long, ``y = x @ w[g] + x1 @ w1[g]``
    (a SwiGLU input gradient: no second GEMM output and no add); ``PAIR == 2`` writes
    two outputs from one input, ``y = x @ w[g]``, ``y1 = x @ w1[g]`` (gate and up
    projections: one work list, one launch). With TMA the paired operand is one 3-D
    descriptor ``[2, ...]`` over both tensors, ``flip_*`` the index of the first.

    One flat loop runs over (tile, k-step) pairs of this program's tiles, so the
    software pipeline keeps loading across tile boundaries (the next tile's first
    K blocks arrive while the current tile finishes) instead of draining per tile.
    """
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    tiles_all = tiles_n * 2 if PAIR == 2 else tiles_n  # n-tiles of the work list
    k_tiles = tl.cdiv(K, BK)
    k_steps = k_tiles * 2 if PAIR == 1 else k_tiles
    _, _, _, _, total = group_of_tile(offs_ptr, E, 0, tiles_all, BM, E_BLOCK)
    my_tiles = tl.where(pid < total, tl.cdiv(total - pid, num_progs), 0)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    tile = pid - num_progs
    ki = -1
    g = 0
    g_end = 0
    row0 = 0
    pid_n = 0
    half = 0  # PAIR == 2: which output this tile writes
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, my_tiles * k_steps):
        ki = tl.where(ki == k_steps - 1, 0, ki + 1)
        if ki == 0:
            tile += num_progs
            g, base, g_start, g_end, _ = group_of_tile(offs_ptr, E, tile, tiles_all, BM, E_BLOCK)
            pid_m, pid_n = swizzle(tile - base, tl.cdiv(g_end - g_start, BM), tiles_all, GROUP_M)
            row0 = g_start + pid_m * BM
            if PAIR == 2:
                half = pid_n // tiles_n
                pid_n = pid_n - half * tiles_n
        # which operand pair this k-step reads, and its k-block
        which = ki // k_tiles if PAIR == 1 else half
        kb = ki - which * k_tiles if PAIR == 1 else ki
        # Rows past the group end belong to the next group (TMA zero-fills past R;
        # pointers clamp to the last row): computed, never stored. Columns past N
        # are wrapped (pointers) or zero-filled / the next expert's (TMA), never stored.
        if USE_TMA:
            if PAIR == 1:
                a = x.load([which ^ flip_x, row0, kb * BK]).reshape(BM, BK)
            else:
                a = x.load([row0, kb * BK])
            if PAIR == 0:
                if W_K_CONTIGUOUS:
                    b = tl.trans(w.load([g * N + pid_n * BN, kb * BK]))
                else:
                    b = w.load([g * K + kb * BK, pid_n * BN])
            else:
                if W_K_CONTIGUOUS:
                    b = tl.trans(w.load([which ^ flip_w, g * N + pid_n * BN, kb * BK]).reshape(BN, BK))
                else:
                    b = w.load([which ^ flip_w, g * K + kb * BK, pid_n * BN]).reshape(BK, BN)
        else:
            x_src = tl.where(which == 0, x, x1) if PAIR == 1 else x
            w_src = tl.where(which == 0, w, w1) if PAIR != 0 else w
            a_rows = tl.minimum(rm, R - 1 - row0)
            cols = (pid_n * BN + rn) % N
            a_ptrs = x_src + row0.to(tl.int64) * stride_xr + a_rows[:, None] * stride_xr + (kb * BK + rk)[None, :]
            w_base = w_src + g.to(tl.int64) * stride_we
            if W_K_CONTIGUOUS:
                b_ptrs = w_base + (kb * BK + rk)[:, None] + cols[None, :] * stride_wn
            else:
                b_ptrs = w_base + (kb * BK + rk)[:, None] * stride_wk + cols[None, :]
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = rk < K - kb * BK
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if ki == k_steps - 1:
            y_dst = tl.where(half == 0, y_ptr, y1_ptr) if PAIR == 2 else y_ptr
            out_cols = pid_n * BN + rn
            y_ptrs = y_dst + row0.to(tl.int64) * stride_yr + rm[:, None] * stride_yr + out_cols[None, :]
            mask = ((row0 + rm)[:, None] < g_end) & (out_cols[None, :] < N)
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            acc = tl.zeros((BM, BN), dtype=tl.float32)


@triton.jit
def group_rows(offs_ptr, g):
    """First row and row count of group ``g`` (``offs`` the groups' cumulative ends)."""
    end = tl.load(offs_ptr + g)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    return start, end - start


@triton.jit
def next_source(offs_ptr, g, a_from_a, b_from_b, prev_start, prev_steps, prev_a_from_a, prev_b_from_b,
                stride_ar, stride_br, BK: tl.constexpr):
    """A further batch of rows in a merged reduction: its first row and row count in group
    ``g``, its k-steps, and the pointer jumps from just past the previous batch's last
    k-block (``prev_*``) to its first row (int64; ``*_from_*`` are element offsets from
    the first batch's operands)."""
    start, rows = group_rows(offs_ptr, g)
    rows_jump = start.to(tl.int64) - prev_start - prev_steps * BK
    # int64 from the left: two offsets that each fit in int32 (and arrive as int32) can
    # differ by more than int32 holds
    a_jump = rows_jump * stride_ar + a_from_a - prev_a_from_a
    b_jump = rows_jump * stride_br + b_from_b - prev_b_from_b
    return start, rows, tl.cdiv(rows, BK), a_jump, b_jump


@triton.jit
def switch_source(a_ptrs, b_ptrs, rows_left, switch, a_jump, b_jump, rows):
    """Where ``switch``: move the operand pointers to the next batch and count its rows."""
    a_ptrs += tl.where(switch, a_jump, 0)
    b_ptrs += tl.where(switch, b_jump, 0)
    return a_ptrs, b_ptrs, tl.where(switch, rows, rows_left)


@triton.jit
def wgrad_kernel(
    a_ptr, b_ptr, c_ptr, offs_ptr,
    a1_from_a, b1_from_b, offs1_ptr, a2_from_a, b2_from_b, offs2_ptr, a3_from_a, b3_from_b, offs3_ptr,
    M, N, E,
    stride_ar, stride_br, stride_ce, stride_cm, stride_cn, piece, stride_piece,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    ALIGNED: tl.constexpr, ONE_CUT: tl.constexpr, SOURCES: tl.constexpr,
):
    """``c[g] = a_g^T @ b_g``; with ``SOURCES`` > 1 the reduction also runs over group
    ``g`` of up to three further batches of rows (e.g. the next microbatches'), ``c[g] =
    sum_s a_(s,g)^T @ b_(s,g)`` in one K loop: ``offs<s>`` are batch ``s``'s group
    offsets, ``a<s>_from_a`` / ``b<s>_from_b`` where its operands start, in elements from
    ``a`` / ``b`` (same widths and row strides). With ``ACCUMULATE``, ``c`` is an FP32
    accumulator that receives ``+=`` instead: element ``i`` of the row-major ``[E, M, N]``
    result lives at ``(i // piece) * stride_piece + i % piece`` (a flat buffer, or the
    rows of an owner-major gradient bucket), and the strides are unused. ``WHOLE_ROWS``
    (``piece`` a multiple of ``N``) maps whole output rows instead of single elements, and
    ``ONE_CUT`` (pieces of at least ``BM`` rows) with one division per tile; ``ALIGNED``
    (the host checked that every output row starts on 16 bytes) lets the compiler
    emit 4-wide atomics, which the index arithmetic would otherwise hide from it.

    The ``+=`` is a relaxed atomic add of the finished tile, carried out in L2: the
    program never waits for the accumulator's old values (loading them before the
    loop stalled each tile's tensor cores for the FP32 read, ~10% slower at the bench
    shapes, ``tools/bench_expert_gemms.py gemms --merge 4``). Every element belongs to exactly
    one tile, so each receives one add per launch: the result is deterministic, and
    equal to ``c + sum_s a_(s,g)^T @ b_(s,g)`` rounded once (empty groups add zeros).

    The further batches' operands come as plain scalars, not tuples of tensors: Triton's
    launcher took ~110 us of host time per launch with tuple arguments against ~40 us
    without (H200 host, triton 3.6), and the step issues hundreds of these launches."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    pid = tl.program_id(0)
    g = pid // (tiles_m * tiles_n)
    pid_m, pid_n = swizzle(pid % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    g_start, rows_left = group_rows(offs_ptr, g)
    steps = tl.cdiv(rows_left, BK)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    cols_m = (pid_m * BM + rm) % M
    cols_n = (pid_n * BN + rn) % N
    a_ptrs = a_ptr + g_start.to(tl.int64) * stride_ar + rk[:, None] * stride_ar + cols_m[None, :]
    b_ptrs = b_ptr + g_start.to(tl.int64) * stride_br + rk[:, None] * stride_br + cols_n[None, :]
    # One branch-free loop over all batches (the software pipeline runs across the
    # switches): after its k-steps end (``cum<s>``, the steps before batch ``s``) the
    # pointers jump to the next batch's first row. An empty batch ends where it starts,
    # so its jump and the next one's apply together; batches empty from the start are
    # skipped before the loop.
    total = steps
    if SOURCES > 1:
        start1, rows1, steps1, a_jump1, b_jump1 = next_source(
            offs1_ptr, g, a1_from_a, b1_from_b, g_start, steps, 0, 0, stride_ar, stride_br, BK)
        cum1 = total
        total += steps1
        a_ptrs, b_ptrs, rows_left = switch_source(a_ptrs, b_ptrs, rows_left, cum1 == 0, a_jump1, b_jump1, rows1)
    if SOURCES > 2:
        start2, rows2, steps2, a_jump2, b_jump2 = next_source(
            offs2_ptr, g, a2_from_a, b2_from_b, start1, steps1, a1_from_a, b1_from_b, stride_ar, stride_br, BK)
        cum2 = total
        total += steps2
        a_ptrs, b_ptrs, rows_left = switch_source(a_ptrs, b_ptrs, rows_left, cum2 == 0, a_jump2, b_jump2, rows2)
    if SOURCES > 3:
        _, rows3, steps3, a_jump3, b_jump3 = next_source(
            offs3_ptr, g, a3_from_a, b3_from_b, start2, steps2, a2_from_a, b2_from_b, stride_ar, stride_br, BK)
        cum3 = total
        total += steps3
        a_ptrs, b_ptrs, rows_left = switch_source(a_ptrs, b_ptrs, rows_left, cum3 == 0, a_jump3, b_jump3, rows3)
    for i in range(0, total):
        r_ok = rk < rows_left
        a = tl.load(a_ptrs, mask=r_ok[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=r_ok[:, None], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
        a_ptrs += BK * stride_ar
        b_ptrs += BK * stride_br
        rows_left -= BK
        if SOURCES > 1:
            a_ptrs, b_ptrs, rows_left = switch_source(
                a_ptrs, b_ptrs, rows_left, i == cum1 - 1, a_jump1, b_jump1, rows1)
        if SOURCES > 2:
            a_ptrs, b_ptrs, rows_left = switch_source(
                a_ptrs, b_ptrs, rows_left, i == cum2 - 1, a_jump2, b_jump2, rows2)
        if SOURCES > 3:
            a_ptrs, b_ptrs, rows_left = switch_source(
                a_ptrs, b_ptrs, rows_left, i == cum3 - 1, a_jump3, b_jump3, rows3)
    # the epilogue's addresses: not needed during the loop, so not live through it
    out_m = pid_m * BM + rm
    out_n = pid_n * BN + rn
    mask = (out_m[:, None] < M) & (out_n[None, :] < N)
    if ACCUMULATE:
        if WHOLE_ROWS:
            # Output row r (of all E * M) is row r % P of piece r // P, P = piece // N
            # rows. A division per row took about half the kernel's time at the bench
            # shapes; with pieces of at least BM rows (ONE_CUT) a tile meets at most one
            # piece boundary, so one scalar division per tile does.
            rows_per_piece = piece // N
            r0 = g.to(tl.int64) * M + pid_m * BM  # the tile's first output row
            if ONE_CUT:
                owner0 = r0 // rows_per_piece
                within = (r0 - owner0 * rows_per_piece) + rm
                cut = within >= rows_per_piece
                owner = owner0 + cut.to(tl.int64)
                within = tl.where(cut, within - rows_per_piece, within)
            else:
                owner = (r0 + rm) // rows_per_piece
                within = (r0 + rm) - owner * rows_per_piece
            c_row_offs = owner * stride_piece + within * N
            if ALIGNED:
                c_row_offs = tl.multiple_of(c_row_offs, 4)
            c_ptrs = c_ptr + c_row_offs[:, None] + out_n[None, :]
        else:
            flat = ((g.to(tl.int64) * M + out_m) * N)[:, None] + out_n[None, :]
            c_ptrs = c_ptr + (flat // piece) * stride_piece + flat % piece
        tl.atomic_add(c_ptrs, acc, mask=mask, sem="relaxed")
    else:
        c_ptrs = c_ptr + g.to(tl.int64) * stride_ce + out_m[:, None] * stride_cm + out_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
