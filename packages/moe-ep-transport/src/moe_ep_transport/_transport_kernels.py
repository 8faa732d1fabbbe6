"""Triton kernels of the transports: row put through peer pointers, receive finish, top-k sum.

Import this module only where a kernel is launched (it imports triton).
Row tensors are 2-D; a row is ``width`` elements of its dtype (callers view rows
as 32-bit words when they only move them). The kernels address every tensor as
contiguous (row ``i`` at ``ptr + i * width``, element ``i`` at ``ptr + i``), so the
wrappers take any strides: what a kernel reads is made contiguous here (free when
it already is), and a tensor it writes in place must be contiguous (a copy would
lose the writes: ValueError naming it).

Pointer tables are int64 tensors of slab byte addresses (one per destination
rank); a peer's address comes from NVSHMEM (``nvshmem_ptr``), so a plain store
reaches the peer's memory over NVLink. The offset into the slab and the local
destination are kernel arguments (no per-call table arithmetic). The addresses are
16-byte aligned, which the put kernel states with ``tl.multiple_of`` on the
pointers so that its stores vectorise (128-bit; checked on the compiled PTX).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moe_ep_transport._copy_engine import copy_to
from moe_ep_transport._kernel_parts import barrier, wait_in_every_program
from moe_ep_transport.ops import PeerWait, SlotTable

_MAX_BLOCK_W = 1024  # elements of one row chunk (4 KiB of 32-bit words)


@triton.jit
def _clear_rows(src_ptr, table_ptr, byte_offset, me, clear_ptr, n_clear, width, block,
                BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_clear
    zero = live & (tl.load(clear_ptr + rows, mask=live, other=0) < 0)
    own = tl.load(table_ptr + me) + byte_offset
    dst = tl.multiple_of(own.to(tl.pointer_type(src_ptr.dtype.element_ty)), 16) + rows * width
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = zero[:, None] & (cols < width)[None, :]
        tl.store(dst[:, None] + cols[None, :], tl.zeros([BLOCK_R, BLOCK_W], dtype=src_ptr.dtype.element_ty), mask=m)


@triton.jit
def _put_rows_kernel(
    src_ptr, dst_rank_ptr, dst_row_ptr, table_ptr, byte_offset, local_addr, me,
    meta_src_ptr, meta_w_ptr, n_rows, width, inbox_stride, clear_ptr, n_clear, put_programs,
    PER_SRC: tl.constexpr, DEDUP: tl.constexpr, HAS_LOCAL: tl.constexpr, SKIP_LOCAL: tl.constexpr,
    HAS_META: tl.constexpr, HAS_META_W: tl.constexpr, CLEAR: tl.constexpr, REMOTE_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    if CLEAR:
        if pid >= put_programs:  # the programs past the put zero this rank's own cleared rows
            _clear_rows(src_ptr, table_ptr, byte_offset, me, clear_ptr, n_clear, width, pid - put_programs,
                        BLOCK_R, BLOCK_W)
            return
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank = tl.load(dst_rank_ptr + rows, mask=rows < n_rows, other=-1)
    ok = rank >= 0
    if SKIP_LOCAL:
        ok = ok & (rank != me)
    src_row = rows // PER_SRC
    dst_row = tl.load(dst_row_ptr + rows, mask=ok, other=0)
    slab = tl.load(table_ptr + rank, mask=ok, other=0)
    at = dst_row
    store = ok
    if DEDUP:
        # A row for another rank travels once per (source row, rank): only the source
        # row's first slot bound there stores it, into the rank's token inbox; without
        # REMOTE_ROWS another launch moves the inbox rows (the copy engines) and this one
        # stores only this rank's own rows and the metadata.
        remote = rank != me
        if REMOTE_ROWS:
            first = rows - rows % PER_SRC
            for jj in tl.static_range(PER_SRC):
                earlier = tl.load(dst_rank_ptr + first + jj, mask=ok & (first + jj < rows), other=-1)
                store = store & ~(remote & (earlier == rank))
        else:
            store = store & ~remote
        at = tl.where(remote, me * inbox_stride + src_row, dst_row)
    addr = slab + byte_offset
    if HAS_LOCAL:
        addr = tl.where(rank == me, local_addr, addr)
    dst = tl.multiple_of(addr.to(tl.pointer_type(src_ptr.dtype.element_ty)), 16) + at * width
    src = src_ptr + src_row * width
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = store[:, None] & (cols < width)[None, :]
        v = tl.load(src[:, None] + cols[None, :], mask=m)
        tl.store(dst[:, None] + cols[None, :], v, mask=m)
    if HAS_META:
        meta = tl.load(meta_src_ptr + rows, mask=ok, other=0)
        if HAS_META_W:  # the slot's weight in the high 32 bits (ops.pack_meta)
            w_bits = tl.load(meta_w_ptr + rows, mask=ok, other=0.0).to(tl.int32, bitcast=True)
            meta = (meta & 0xFFFFFFFF) | (w_bits.to(tl.int64) << 32)
        tl.store(slab.to(tl.pointer_type(tl.int64)) + dst_row, meta, mask=ok)


@triton.jit
def _finish_receive_kernel(
    out_ptr, inbox_ptr, row_src_ptr, origin_in_ptr, origin_out_ptr, slot_rows_ptr, w_out_ptr, max_slots, me,
    n_rows, width, inbox_stride, epoch_ptr, parity, flag_table_ptr, n_ranks,
    PER_SRC: tl.constexpr, DEDUP: tl.constexpr, COPY_ORIGIN: tl.constexpr, SLOT_ROWS: tl.constexpr,
    W_OUT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    WAIT: tl.constexpr, FLAGS_P: tl.constexpr, FENCE: tl.constexpr,
):
    if WAIT:  # the put's barrier (the rows are in the inbox after it)
        wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks, tl.program_id(0), FLAGS_P, FENCE)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    src = tl.load(row_src_ptr + rows, mask=live, other=me)
    remote = (src != me) & (src >= 0)
    write = remote | (src < 0)  # padding rows are written as zeros
    if DEDUP or COPY_ORIGIN or SLOT_ROWS or W_OUT:
        meta = tl.load(origin_in_ptr + rows, mask=live, other=0)
        origin = meta & 0xFFFFFFFF  # the slot index (ops.pack_meta)
    if DEDUP:
        at = tl.where(remote, src * inbox_stride + origin // PER_SRC, 0)  # the token inbox row
    else:
        at = rows
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        cm = (cols < width)[None, :]
        v = tl.load(inbox_ptr + at[:, None] * width + cols[None, :], mask=remote[:, None] & cm, other=0)
        tl.store(out_ptr + rows[:, None] * width + cols[None, :], v, mask=write[:, None] & cm)
    if COPY_ORIGIN:
        tl.store(origin_out_ptr + rows, origin, mask=live)
    if SLOT_ROWS:  # the inverse layout (ops.SlotTable): readers validate entries, so no fill
        tl.store(slot_rows_ptr + src * max_slots + origin, rows, mask=live & (src >= 0))
    if W_OUT:  # the slot's weight, zero for padding rows
        w = (meta >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        tl.store(w_out_ptr + rows, tl.where(src >= 0, w, 0.0), mask=live)


@triton.jit
def _topk_gather_sum_kernel(
    inbox_ptr, local_ptr, dst_rank_ptr, dst_row_ptr, w_ptr, y_ptr, rows_out_ptr, me, width,
    epoch_ptr, parity, flag_table_ptr, n_ranks,
    K: tl.constexpr, STORE_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
    WAIT: tl.constexpr, FLAGS_P: tl.constexpr, FENCE: tl.constexpr,
):
    if WAIT:
        wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks,
                              tl.program_id(0) + tl.program_id(1), FLAGS_P, FENCE)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = cols < width
    acc = tl.zeros([BLOCK_W], dtype=w_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        i = t.to(tl.int64) * K + j
        rank = tl.load(dst_rank_ptr + i)
        local = rank == me
        base = tl.where(local, local_ptr, inbox_ptr)
        row = tl.where(local, tl.load(dst_row_ptr + i), i)
        limit = tl.where(rank >= 0, width, 0)  # a dropped slot reads nothing (zeros) ...
        x = tl.load(base + row * width + cols, mask=cols < limit, other=0.0)
        w = tl.where(rank >= 0, tl.load(w_ptr + i), 0.0)  # ... with weight zero
        acc = acc + x.to(w_ptr.dtype.element_ty) * w
        if STORE_ROWS:
            tl.store(rows_out_ptr + i * width + cols, x, mask=cm)
    tl.store(y_ptr + t.to(tl.int64) * width + cols, acc.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _combine_grads_kernel(
    g_ptr, w_ptr, rows_ptr, scaled_ptr, grad_w_ptr, width, bound_ptr,
    inbox_ptr, row_src_ptr, origin_ptr, me, inbox_stride, epoch_ptr, parity, flag_table_ptr, n_ranks,
    K: tl.constexpr, SCALED: tl.constexpr, GRAD_W: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_BOUND: tl.constexpr, RECEIVE: tl.constexpr, PER_SRC: tl.constexpr, DEDUP: tl.constexpr,
    WAIT: tl.constexpr, FLAGS_P: tl.constexpr, FENCE: tl.constexpr,
):
    if WAIT:  # RECEIVE: the put's barrier
        wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks, tl.program_id(0), FLAGS_P, FENCE)
    # Program t: the token's k scaled gradient rows and the k weight gradients, reading
    # the token's gradient once (eager PyTorch materialises two [T, k, D] FP32 tensors).
    # With a bound, programs at or past it (padding rows) move no memory.
    t = tl.program_id(0).to(tl.int64)
    acc_dtype = w_ptr.dtype.element_ty
    slots = tl.arange(0, K)
    live = slots < K
    limit = width
    if HAS_BOUND:
        end = tl.load(bound_ptr).to(tl.int64)
        live = (t + slots) < end + slots  # a per-slot vector (a scalar mask trips the interpreter)
        limit = tl.where(t < end, width, 0)
    g_row = g_ptr + t * width
    if RECEIVE:  # K = 1 over receive rows: finish_receive's addressing, g_ptr holds this rank's own rows
        src = tl.load(row_src_ptr + t)
        remote = (src >= 0) & (src != me)
        if DEDUP:
            origin = tl.load(origin_ptr + t) & 0xFFFFFFFF
            inbox_row = tl.where(remote, src * inbox_stride + origin // PER_SRC, 0)  # the token inbox row
        else:
            inbox_row = t
        g_row = tl.where(remote, inbox_ptr + inbox_row * width, g_row)
        live = (src + slots) >= slots  # padding rows (source -1) move no memory, results unset
        limit = tl.where(src >= 0, width, 0)
    w = tl.load(w_ptr + t * K + slots, mask=live, other=0.0)
    dots = tl.zeros([K], dtype=acc_dtype)
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        cm = cols < limit
        g = tl.load(g_row + cols, mask=cm, other=0.0).to(acc_dtype)
        at = (t * K + slots)[:, None] * width + cols[None, :]
        m = cm[None, :] & (slots < K)[:, None]
        if SCALED:
            tl.store(scaled_ptr + at, (g[None, :] * w[:, None]).to(scaled_ptr.dtype.element_ty), mask=m)
        if GRAD_W:
            x = tl.load(rows_ptr + at, mask=m, other=0.0).to(acc_dtype)
            dots += tl.sum(x * g[None, :], axis=1)
    if GRAD_W:
        tl.store(grad_w_ptr + t * K + slots, dots, mask=live)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, n_rows, width, epoch_ptr, parity, flag_table_ptr, me, n_ranks,
                      BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, WAIT: tl.constexpr, FLAGS_P: tl.constexpr,
                      FENCE: tl.constexpr):
    if WAIT:
        wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks, tl.program_id(0), FLAGS_P, FENCE)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < n_rows
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = live[:, None] & (cols < width)[None, :]
        at = rows[:, None] * width + cols[None, :]
        tl.store(dst_ptr + at, tl.load(src_ptr + at, mask=m), mask=m)


@triton.jit
def _signal_barrier_kernel(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P)


@triton.jit
def _put_partial_sums_kernel(
    rows_ptr, w_ptr, slot_rows_ptr, row_src_ptr, origin_ptr, n_rows, table_ptr, byte_offset, me,
    max_tokens, width, stage_ptr, K: tl.constexpr, HAS_W: tl.constexpr, STAGE: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # Program (q, column block), q = s * T_max + t: source s's token t. Sum its rows here
    # in slot order, FP32, no FMA; store the partial into row me * T_max + t of s's slab
    # (s == me included: the table holds this rank's own slab too). Nothing if no row here.
    # STAGE: other sources' partials go to row (s minus one past me) * T_max + t of the
    # local staging rows instead, which the copy engines move next.
    q = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = cols < width
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    present = cols < 0  # vector masks throughout (the interpreter takes no scalar masks)
    s = q // max_tokens
    t = q - s * max_tokens
    for j in tl.static_range(K):
        entry = tl.load(slot_rows_ptr + q * K + j)
        at = tl.minimum(tl.maximum(entry, 0), n_rows - 1)
        # A table entry counts only if that row came from this (source, slot) (ops.SlotTable).
        ok = (entry >= 0) & (entry < n_rows) & (tl.load(row_src_ptr + at) == s)
        ok = ok & (tl.load(origin_ptr + at) == t * K + j)
        c = tl.where(ok, at, -1)
        row_ok = (tl.zeros([BLOCK_W], dtype=tl.int64) + c) >= 0
        x = tl.load(rows_ptr + c * width + cols, mask=cm & row_ok, other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.where(ok, tl.load(w_ptr + at), 0.0)
        else:
            w = tl.where(ok, 1.0, 0.0)
        acc = acc + x * w
        present = present | row_ok
    slab = tl.load(table_ptr + s)
    dst = tl.multiple_of((slab + byte_offset).to(tl.pointer_type(tl.float32)), 16) + (me * max_tokens + t) * width
    if STAGE:
        staged = stage_ptr + ((s - (s > me).to(tl.int64)) * max_tokens + t) * width
        dst = tl.where(s == me, dst, staged)
    tl.store(dst + cols, acc, mask=cm & present)


@triton.jit
def _sum_partials_kernel(
    partials_ptr, dst_rank_ptr, y_ptr, n_ranks, max_tokens, width, epoch_ptr, parity, flag_table_ptr, me,
    K: tl.constexpr, BLOCK_W: tl.constexpr, WAIT: tl.constexpr, FLAGS_P: tl.constexpr, FENCE: tl.constexpr,
):
    if WAIT:  # the partial sums' barrier
        wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks,
                              tl.program_id(0) + tl.program_id(1), FLAGS_P, FENCE)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = cols < width
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    ranks = tl.zeros([BLOCK_W], dtype=tl.int64)  # vector masks (the interpreter takes no scalar masks)
    for r in range(0, n_ranks):
        present = cols < 0
        for j in tl.static_range(K):
            present = present | ((ranks + tl.load(dst_rank_ptr + t * K + j)) == r)
        x = tl.load(partials_ptr + (r * max_tokens + t) * width + cols, mask=cm & present, other=0.0)
        acc = acc + x
    tl.store(y_ptr + t * width + cols, acc.to(y_ptr.dtype.element_ty), mask=cm)


def _block_w(width: int) -> int:
    return min(_MAX_BLOCK_W, triton.next_power_of_2(max(width, 1)))


def _check_written(what: str, t: torch.Tensor | None) -> None:
    """A tensor a kernel writes in place must be contiguous (a contiguous copy would lose the writes)."""
    if t is not None and not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous (the kernel writes it in place), got strides {t.stride()}")


def put_rows(
    src_SW: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    table_M: torch.Tensor,
    *,
    per_src: int = 1,
    byte_offset: int = 0,
    me: int = -1,
    local_dst: torch.Tensor | None = None,
    skip_local: bool = False,
    meta_N: torch.Tensor | None = None,
    inbox_stride: int = 0,
    meta_w_N: torch.Tensor | None = None,
    clear_N: torch.Tensor | None = None,
    bulk_to: Sequence[int] | None = None,
) -> None:
    """Row ``dst_row[i]`` at ``table[dst_rank[i]] + byte_offset`` becomes ``src[i // per_src]``.

    ``table_M[r]`` is the byte address of rank ``r``'s slab; the rows there have
    ``src``'s dtype and width. Slots with ``dst_rank < 0`` are skipped; slots for
    rank ``me`` go to ``local_dst`` instead when given, and are skipped with
    ``skip_local``. With ``meta_N``, also ``int64 slab[dst_row[i]] = meta[i]`` at the
    slab's start. With ``inbox_stride=S > 0`` a row for another rank goes there once
    per source row, to row ``me * S + i // per_src`` (its token inbox), not ``dst_row``.
    With ``meta_w_N`` (float32), the metadata is ``ops.pack_meta(meta, meta_w)``.
    With ``clear_N`` (integers), row ``i`` at ``table[me] + byte_offset`` is zeroed where
    ``clear_N[i] < 0``, in the same launch (rows no put writes, e.g. the dropped slots a
    return leaves empty).
    With ``bulk_to`` (``table_M`` on the host) and ``inbox_stride``, the rows for other
    ranks travel as one block per rank instead, after the kernel: every source row, needed
    there or not, to rows ``me * S`` on of each other rank's inbox, by the copy engines
    (:func:`moe_ep_transport._copy_engine.copy_to`: no SM); the kernel stores this rank's
    own rows and the metadata.
    """
    if local_dst is not None and skip_local:
        raise ValueError("put_rows: local_dst and skip_local exclude each other")
    if bulk_to is not None and (inbox_stride <= 0 or me < 0):
        raise ValueError("put_rows: bulk_to moves token inbox blocks: it needs inbox_stride > 0 and `me`")
    if clear_N is not None and me < 0:
        raise ValueError("put_rows: clear_N zeroes rows of rank `me`, which must be given")
    _check_written("put_rows: local_dst", local_dst)
    n = dst_rank_N.numel()
    n_clear = clear_N.numel() if clear_N is not None else 0
    if n == 0 and n_clear == 0:
        return
    width = src_SW.shape[1]
    src_SW = src_SW.contiguous()  # once: the kernel and the copies read the same rows
    dst_row_N = dst_row_N.contiguous()
    block_r = 4
    put_programs = triton.cdiv(n, block_r)
    _put_rows_kernel[(put_programs + triton.cdiv(n_clear, block_r),)](
        src_SW, dst_rank_N.contiguous(), dst_row_N, table_M.contiguous(), byte_offset,
        local_dst.data_ptr() if local_dst is not None else 0, me,
        meta_N.contiguous() if meta_N is not None else dst_row_N,
        meta_w_N.contiguous() if meta_w_N is not None else dst_row_N,
        n, width, inbox_stride, clear_N.contiguous() if clear_N is not None else dst_row_N, n_clear,
        put_programs,
        PER_SRC=per_src, DEDUP=inbox_stride > 0, HAS_LOCAL=local_dst is not None, SKIP_LOCAL=skip_local,
        HAS_META=meta_N is not None, HAS_META_W=meta_w_N is not None, CLEAR=clear_N is not None,
        REMOTE_ROWS=bulk_to is None, BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8,
    )
    if bulk_to is not None:
        inbox_at = byte_offset + me * inbox_stride * width * src_SW.element_size()
        for rank, address in enumerate(bulk_to):
            if rank != me:
                copy_to(address + inbox_at, src_SW)


def finish_receive(
    out_CW: torch.Tensor,
    inbox_CW: torch.Tensor,
    row_src_C: torch.Tensor,
    me: int,
    origin_in_C: torch.Tensor | None = None,
    origin_out_C: torch.Tensor | None = None,
    per_src: int = 1,
    inbox_stride: int = 0,
    slot_rows_out: torch.Tensor | None = None,
    max_slots: int = 0,
    w_out_C: torch.Tensor | None = None,
    wait: PeerWait | None = None,
) -> None:
    """Copy rows that came from other ranks from the inbox into ``out``; zero padding rows.

    Rows this rank sent to itself were written into ``out`` directly by the put.
    Row ``c`` is inbox row ``c``, or with ``inbox_stride=S > 0`` inbox row
    ``row_src[c] * S + origin_in[c] // per_src`` (the token inbox). With
    ``origin_out_C``, ``origin_in_C`` is copied into it in the same launch; with
    ``slot_rows_out``, ``slot_rows_out[row_src[c] * max_slots + origin_in[c]] = c`` too;
    with ``w_out_C`` (float32), each row's weight from its metadata (``ops.pack_meta``).
    ``origin_in`` is read as packed metadata: its low 32 bits are the slot index.
    With ``wait``, the kernel passes that barrier first (every program: ``_kernel_parts``).
    """
    for what, t in (("out_CW", out_CW), ("origin_out_C", origin_out_C), ("slot_rows_out", slot_rows_out),
                    ("w_out_C", w_out_C)):
        _check_written(f"finish_receive: {what}", t)
    n = out_CW.shape[0]
    if n == 0:
        _pass_alone(wait)
        return
    width = out_CW.shape[1]
    row_src_C = row_src_C.contiguous()
    block_r = 4
    _finish_receive_kernel[(triton.cdiv(n, block_r),)](
        out_CW, inbox_CW.contiguous(), row_src_C,
        origin_in_C.contiguous() if origin_in_C is not None else row_src_C,
        origin_out_C if origin_out_C is not None else row_src_C,
        slot_rows_out if slot_rows_out is not None else row_src_C,
        w_out_C if w_out_C is not None else row_src_C, max_slots,
        me, n, width, inbox_stride, n_ranks=_ranks(wait), PER_SRC=per_src, DEDUP=inbox_stride > 0,
        COPY_ORIGIN=origin_out_C is not None, SLOT_ROWS=slot_rows_out is not None, W_OUT=w_out_C is not None,
        BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8, **_wait_kwargs(wait, out_CW),
    )


def combine_grads(
    g_TD: torch.Tensor,
    w_N: torch.Tensor,
    rows_ND: torch.Tensor | None,
    rows_dtype: torch.dtype,
    scaled: bool,
    bound: torch.Tensor | None = None,
    receive: tuple | None = None,
    per_src: int = 1,
    wait: PeerWait | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(w * g).to(rows_dtype)`` per slot and ``<rows, g>`` per slot, in ``w``'s dtype.

    ``K`` (slots per token) must be a power of two for the kernel's slot vector. With
    ``bound`` (a one-element integer device tensor) tokens at or past it are skipped:
    their outputs are left unset. With ``wait`` (``receive`` only), the kernel passes that
    barrier first.
    """
    if wait is not None and receive is None:
        raise ValueError("combine_grads: a wait is for a receive (the rows it reads arrive after it)")
    N, (T, width) = w_N.numel(), g_TD.shape
    scaled_ND = torch.empty(N, width, dtype=rows_dtype, device=g_TD.device) if scaled else None
    grad_w_N = torch.empty(N, dtype=w_N.dtype, device=g_TD.device) if rows_ND is not None else None
    if T == 0 or (scaled_ND is None and grad_w_N is None):  # a rank without tokens
        _pass_alone(wait)
        return scaled_ND, grad_w_N
    K = N // T
    w_N = w_N.contiguous()
    rows_ND = rows_ND.contiguous() if rows_ND is not None else None
    placeholder = scaled_ND if scaled_ND is not None else rows_ND
    _combine_grads_kernel[(T,)](
        g_TD.contiguous(), w_N, rows_ND if rows_ND is not None else placeholder,
        placeholder, grad_w_N if grad_w_N is not None else w_N, width,
        bound if bound is not None else w_N, *(receive if receive is not None else (w_N, w_N, w_N, 0, 0)),
        n_ranks=_ranks(wait), K=K, SCALED=scaled, GRAD_W=rows_ND is not None,
        BLOCK_W=min(triton.next_power_of_2(max(width, 1)), max(64, 4096 // K)), HAS_BOUND=bound is not None,
        RECEIVE=receive is not None, PER_SRC=per_src, DEDUP=receive is not None and receive[-1] > 0,
        num_warps=4, **_wait_kwargs(wait, w_N),
    )
    return scaled_ND, grad_w_N


def signal_barrier(epochs_2: torch.Tensor, flag_table_M: torch.Tensor, me: int, parity: int) -> None:
    """Stream-ordered barrier over peer flags: one small kernel, no NVSHMEM call.

    ``flag_table_M[r]`` is the address of rank ``r``'s flags (``M`` int64, zero at the
    start, in memory every rank can store into); ``epochs_2`` (int64, this rank's own)
    the barriers' numbers by ``parity`` (the count of barriers before this one, mod 2;
    ``_kernel_parts``). Every rank must run the same sequence of barriers.
    """
    M = flag_table_M.numel()
    _signal_barrier_kernel[(1,)](epochs_2, parity, flag_table_M.contiguous(), me, M,
                                 M_P=_flags_p(M), num_warps=1)


def copy_rows(src_RW: torch.Tensor, wait: PeerWait | None = None) -> torch.Tensor:
    """A contiguous copy of ``src_RW`` (rows of a slab), read after ``wait``'s barrier."""
    out = torch.empty(src_RW.shape, dtype=src_RW.dtype, device=src_RW.device)
    n, width = src_RW.shape
    if n == 0 or width == 0:
        _pass_alone(wait)
        return out
    block_r = 4
    _copy_rows_kernel[(triton.cdiv(n, block_r),)](
        src_RW.contiguous(), out, n, width, me=wait.me if wait is not None else 0, n_ranks=_ranks(wait),
        BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8, **_wait_kwargs(wait, out),
    )
    return out


def _flags_p(n_ranks: int) -> int:
    return max(2, triton.next_power_of_2(n_ranks))


def _wait_kwargs(wait: PeerWait | None, out: torch.Tensor) -> dict:
    """A receive kernel's barrier arguments by name (``wait_in_every_program``'s, with
    ``WAIT``, ``FLAGS_P`` and ``FENCE``): ``wait``'s, or placeholders where the kernel waits
    for nothing. ``out``: a tensor the kernel writes (its device decides the fence)."""
    if wait is None:
        return dict(epoch_ptr=out, parity=0, flag_table_ptr=out, WAIT=False, FLAGS_P=2, FENCE=False)
    return dict(epoch_ptr=wait.epochs_2, parity=wait.parity, flag_table_ptr=wait.flag_table_M.contiguous(),
                WAIT=True, FLAGS_P=_flags_p(wait.flag_table_M.numel()), FENCE=out.is_cuda)


def _ranks(wait: PeerWait | None) -> int:
    """The ranks a receive's barrier waits for (1 where it waits for none)."""
    return wait.flag_table_M.numel() if wait is not None else 1


def _pass_alone(wait: PeerWait | None) -> None:
    """The barrier of a receive that launches no kernel (nothing to read here): every rank
    passes every barrier, so it runs as a kernel of its own."""
    if wait is not None:
        signal_barrier(*wait)


def topk_gather_sum(
    inbox_ND: torch.Tensor,
    local_CD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    me: int,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
    wait: PeerWait | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y[t] = sum_j w[t*k+j] * x(t*k+j)`` in ``w``'s dtype, slot order, no fused multiply-add.

    Slot ``i`` reads ``local[dst_row[i]]`` (``dst_rank == me``), ``inbox[i]`` (another
    rank) or zeros with weight zero (dropped). FMA contraction is disabled so the sum
    equals the unfused PyTorch reference bit for bit. With ``wait``, the kernel passes
    that barrier first.
    """
    n = dst_rank_N.numel()
    T = n // top_k
    width = local_CD.shape[1]
    y = torch.empty(T, width, dtype=out_dtype, device=local_CD.device)
    rows_out = (
        torch.empty(n, width, dtype=local_CD.dtype, device=local_CD.device) if store_rows else None
    )
    if T == 0:
        _pass_alone(wait)
        return y, rows_out
    block_w = _block_w(width)
    _topk_gather_sum_kernel[(T, triton.cdiv(width, block_w))](
        inbox_ND.contiguous(), local_CD.contiguous(), dst_rank_N.contiguous(), dst_row_N.contiguous(),
        w_N.contiguous(), y, rows_out if store_rows else y, me, width, n_ranks=_ranks(wait),
        K=top_k, STORE_ROWS=store_rows, BLOCK_W=block_w, num_warps=4, enable_fp_fusion=False,
        **_wait_kwargs(wait, y),
    )
    return y, rows_out


def put_partial_sums(
    rows_CD: torch.Tensor,
    w_C: torch.Tensor | None,
    slots: SlotTable,
    table_M: torch.Tensor,
    *,
    top_k: int,
    max_tokens: int,
    byte_offset: int,
    me: int,
    bulk_to: Sequence[int] | None = None,
) -> None:
    """Sum each (source, token)'s rows here and store the FP32 partial into the source.

    Row ``q = s * T_max + t`` of :func:`moe_ep_transport.ops.partial_sums_reference`,
    bit for bit (FMA contraction off), lands at row ``me * T_max + t`` of the FP32 rows
    at ``table[s] + byte_offset``; tokens without a row here store nothing. With
    ``bulk_to`` (``table_M`` on the host) the kernel stores other sources' partials into
    local staging rows, and the copy engines (:func:`moe_ep_transport._copy_engine.copy_to`)
    move each source's ``T_max`` rows there as one block: the rows of tokens without a
    row here carry whatever the staging held (their readers skip them, as they skip the
    rows nobody stored).
    """
    if w_C is not None and w_C.dtype != torch.float32:
        raise ValueError(f"put_partial_sums: weights must be float32, got {w_C.dtype}")
    Q = slots.rows_S.numel() // top_k
    C, width = rows_CD.shape
    M = table_M.numel()
    stage = None
    if bulk_to is not None:
        stage = torch.empty((M - 1) * max_tokens, width, dtype=torch.float32, device=rows_CD.device)
    if Q and C:
        block_w = _block_w(width)
        rows_CD = rows_CD.contiguous()
        _put_partial_sums_kernel[(Q, triton.cdiv(width, block_w))](
            rows_CD, w_C.contiguous() if w_C is not None else rows_CD, slots.rows_S.contiguous(),
            slots.row_src_C.contiguous(), slots.origin_C.contiguous(), C, table_M.contiguous(), byte_offset,
            me, max_tokens, width, stage if stage is not None else rows_CD, K=top_k, HAS_W=w_C is not None,
            STAGE=stage is not None, BLOCK_W=block_w, num_warps=4, enable_fp_fusion=False,
        )
    if stage is not None:
        at = byte_offset + me * max_tokens * width * 4
        for rank, address in enumerate(bulk_to):
            if rank != me:
                block = rank - (rank > me)
                copy_to(address + at, stage[block * max_tokens : (block + 1) * max_tokens])


def sum_partials(
    partials_QD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    n_ranks: int,
    max_tokens: int,
    top_k: int,
    out_dtype: torch.dtype,
    wait: PeerWait | None = None,
) -> torch.Tensor:
    """:func:`moe_ep_transport.ops.sum_partials` in one launch (FP32 partials); with ``wait``,
    the kernel passes that barrier first."""
    if partials_QD.dtype != torch.float32:
        raise ValueError(f"sum_partials: partials must be float32, got {partials_QD.dtype}")
    if wait is not None and wait.flag_table_M.numel() != n_ranks:
        raise ValueError(f"sum_partials: a wait over {wait.flag_table_M.numel()} ranks for partials of {n_ranks}")
    T, width = dst_rank_N.numel() // top_k, partials_QD.shape[1]
    y = torch.empty(T, width, dtype=out_dtype, device=partials_QD.device)
    if T == 0:
        _pass_alone(wait)
        return y
    block_w = _block_w(width)
    _sum_partials_kernel[(T, triton.cdiv(width, block_w))](
        partials_QD.contiguous(), dst_rank_N.contiguous(), y, n_ranks, max_tokens, width,
        me=wait.me if wait is not None else 0, K=top_k, BLOCK_W=block_w, num_warps=4, enable_fp_fusion=False,
        **_wait_kwargs(wait, y),
    )
    return y


def receive_grads(
    local_CD: torch.Tensor,
    inbox_RD: torch.Tensor,
    row_src_C: torch.Tensor,
    origin_C: torch.Tensor,
    me: int,
    w_C: torch.Tensor,
    rows_CD: torch.Tensor | None,
    scaled: bool,
    per_src: int = 1,
    inbox_stride: int = 0,
    wait: PeerWait | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`finish_receive` then :func:`combine_grads` (one slot per row) in one launch
    (after ``wait``'s barrier, when given).

    Receive row ``c``'s gradient ``g`` is ``local[c]`` (its source is this rank) or the
    inbox row of :func:`finish_receive`; returns ``(w_C * g).to(local's dtype)`` per row
    (``scaled``) and ``<rows_CD[c], g>`` (with ``rows_CD``), in ``w_C``'s dtype: the same
    program as :func:`combine_grads` over the received rows, so the same bits. Padding rows
    (source -1) are left unset in both.
    """
    receive = (inbox_RD.contiguous(), row_src_C.contiguous(), origin_C.contiguous(), me, inbox_stride)
    return combine_grads(local_CD, w_C, rows_CD, local_CD.dtype, scaled, receive=receive, per_src=per_src,
                         wait=wait)
