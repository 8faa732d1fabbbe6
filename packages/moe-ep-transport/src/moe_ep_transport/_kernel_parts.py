"""Triton device functions shared by the kernels of the plan and the transport (no launches).

Import this module only from kernel modules (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def peer_barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    """The flag barrier inside a single-program kernel, before it reads what peers put
    (``_transport_kernels.signal_barrier``; ``ops.PeerWait``)."""
    barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P)
    tl.debug_barrier()  # every thread of the program reads after the spin's acquire


@triton.jit
def barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    # One program: bump this rank's epoch, store it into slot `me` of every rank's flags
    # (release at system scope: the puts of earlier kernels are visible before the flag),
    # then spin until every rank's flag here reached the epoch (acquire).
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    r = tl.arange(0, M_P)
    live = r < n_ranks
    peer_flags = tl.load(flag_table_ptr + r, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + me, tl.zeros([M_P], dtype=tl.int64) + epoch, mask=live, sem="release",
                   scope="sys")
    my_flags = tl.load(flag_table_ptr + me).to(tl.pointer_type(tl.int64))
    waiting = 1
    while waiting > 0:
        seen = tl.atomic_add(my_flags + r, tl.zeros([M_P], dtype=tl.int64), mask=live, sem="acquire",
                             scope="sys")
        waiting = tl.sum((live & (seen < epoch)).to(tl.int32), axis=0)


@triton.jit
def slot_destination(expert_ptr, rank_in_block_ptr, cum_ptr, table_ptr, slot, live, n_ranks, n_experts,
                     SLOT_BLOCK: tl.constexpr):
    """Plan step 3 for slots ``slot`` (``plan_reference.plan_rows_reference``): ``(rank, row)``,
    rank -1 and row 0 for a dropped slot (or one outside ``live``)."""
    E = n_experts
    expert = tl.load(expert_ptr + slot, mask=live, other=-1).to(tl.int64)
    ok = live & (expert >= 0) & (expert < E)
    block = slot // SLOT_BLOCK
    q = tl.load(rank_in_block_ptr + slot, mask=ok, other=0).to(tl.int64)
    earlier = tl.load(cum_ptr + tl.maximum(block - 1, 0) * E + expert, mask=ok, other=0).to(tl.int64)
    q += tl.where(block > 0, earlier, 0)
    size = tl.maximum(tl.load(table_ptr + expert, mask=ok, other=1), 1)
    drop = tl.load(table_ptr + E + expert, mask=ok, other=0)
    start = tl.load(table_ptr + 2 * E + expert, mask=ok, other=0)
    base = tl.load(table_ptr + 3 * E + expert, mask=ok, other=0)
    # overflow.dropped_window; q - start lies in (-size, size)
    offset = q - start
    dropped = tl.where(offset < 0, offset + size, offset) < drop
    first = tl.minimum(drop, size - start)
    preceding = tl.minimum(q, drop - first) + tl.minimum(tl.maximum(offset, 0), first)
    keep = ok & ~dropped
    return tl.where(keep, expert // (E // n_ranks), -1), tl.where(keep, base + q - preceding, 0)


@triton.jit
def receive_source(recv_end_ptr, rows, n_rows, n_ranks, n_experts, E_P: tl.constexpr):
    """Plan step 3's receive side: the source rank of receive rows ``rows``, -1 for padding."""
    cols = tl.arange(0, E_P)
    ends = tl.load(recv_end_ptr + cols, mask=cols < n_experts, other=n_rows)
    cell = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int64), axis=1)
    return tl.where(cell < n_experts, cell % n_ranks, -1)
