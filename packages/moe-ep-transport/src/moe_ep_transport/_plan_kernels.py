"""Triton kernels of the routing plan: three launches instead of a hundred small ops.

Each kernel computes exactly the integers of its PyTorch definition in
:mod:`moe_ep_transport.plan_reference` (shape legend there); tests compare them
bit for bit under ``TRITON_INTERPRET=1``. Import this module only where a kernel
is launched (it imports triton).

Expert ids outside ``[0, E)`` cannot be checked on the device without a host
synchronisation; they match no expert, so their slots are dropped and counted
nowhere (the CPU path raises). The kernels never address memory with them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from moe_ep_transport import overflow
from moe_ep_transport._kernel_parts import fence_system, peer_barrier
from moe_ep_transport.ops import PeerWait
from moe_ep_transport.plan_reference import CellPlan, SlotRanks, next_power_of_2, slot_block

_PRIME = tl.constexpr(overflow.HASH_PRIME)
_MULT = tl.constexpr(overflow.HASH_MULTIPLIER)
_START = tl.constexpr(overflow.HASH_START)
_INCR = tl.constexpr(overflow.HASH_INCREMENT)


@triton.jit
def _slot_destination(expert_ptr, rank_in_block_ptr, cum_ptr, table_ptr, slot, live, n_ranks, n_experts,
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
def _receive_source(recv_end_ptr, rows, n_rows, n_ranks, n_experts, E_P: tl.constexpr):
    """Plan step 3's receive side: the source rank of receive rows ``rows``, -1 for padding."""
    cols = tl.arange(0, E_P)
    ends = tl.load(recv_end_ptr + cols, mask=cols < n_experts, other=n_rows)
    cell = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int64), axis=1)
    return tl.where(cell < n_experts, cell % n_ranks, -1)


@triton.jit
def _mix(h, p):
    """One part of :func:`moe_ep_transport.overflow.mix` (non-negative int64 operands)."""
    h = ((h + p % _PRIME + 1) * _MULT) % _PRIME
    return (h * _MULT + _INCR) % _PRIME


@triton.jit
def _rank_slots_kernel(expert_ptr, rank_ptr, hist_ptr, n_slots, n_experts,
                       BLOCK_S: tl.constexpr, E_P: tl.constexpr):
    b = tl.program_id(0)
    slot = b * BLOCK_S + tl.arange(0, BLOCK_S)
    live = slot < n_slots
    expert = tl.load(expert_ptr + slot, mask=live, other=-1).to(tl.int64)
    cols = tl.arange(0, E_P)
    onehot = (expert[:, None] == cols[None, :]).to(tl.int32)
    running = tl.cumsum(onehot, axis=0)
    tl.store(rank_ptr + slot, tl.sum(running * onehot, axis=1) - 1, mask=live)
    tl.store(hist_ptr + b * n_experts + cols, tl.sum(onehot, axis=0), mask=cols < n_experts)


@triton.jit
def _cumsum_blocks_kernel(hist_ptr, cum_ptr, n_blocks, n_experts, peer_table_ptr, byte_offset, me, n_ranks,
                          ticket_ptr, counts_ptr, stats_ptr, table_ptr, recv_ptr, offsets_ptr, sum_ptr, capacity,
                          salt, epoch_ptr, parity, flag_table_ptr,
                          CHUNK: tl.constexpr, PUBLISH: tl.constexpr, M_P: tl.constexpr, E_P: tl.constexpr,
                          CELLS: tl.constexpr, ACCUMULATE: tl.constexpr, WAIT: tl.constexpr,
                          FLAGS_P: tl.constexpr, FENCE: tl.constexpr):
    # Program e scans column e of hist[B, E] over the blocks, CHUNK blocks at a time with a
    # carry (torch's dim-0 scan of the narrow [B, E] took 0.36 ms at 256 Ki slots).
    e = tl.program_id(0)
    carry = tl.zeros([], dtype=tl.int32)
    for b0 in range(0, n_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        live = b < n_blocks
        h = tl.load(hist_ptr + b * n_experts + e, mask=live, other=0)
        tl.store(cum_ptr + b * n_experts + e, tl.cumsum(h, axis=0) + carry, mask=live)
        carry += tl.sum(h, axis=0)
    if PUBLISH:  # the count exchange's put: the total into int32 [M, E] row `me` of every rank's slab
        r = tl.arange(0, M_P)
        peer = r < n_ranks
        slab = tl.load(peer_table_ptr + r, mask=peer, other=0) + byte_offset
        counts = slab.to(tl.pointer_type(tl.int32)) + me * n_experts + e
        tl.store(counts, tl.zeros([M_P], dtype=tl.int32) + carry, mask=peer)
    if CELLS:
        # The program that finishes last (the last ticket of a counter: each program's puts
        # are ordered before its ticket, at system scope with FENCE, and the last one acquires
        # them all) passes the count exchange's barrier (WAIT) and plans the cells. It resets
        # the counter for the next launch, so graph replays find it at zero.
        tl.debug_barrier()  # every thread's puts before the ticket
        if FENCE:
            fence_system(tl.arange(0, FLAGS_P))
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_experts - 1:
            tl.store(ticket_ptr, 0)
            if WAIT:
                peer_barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, FLAGS_P)
            _cells(counts_ptr, stats_ptr, table_ptr, recv_ptr, offsets_ptr, sum_ptr, capacity, salt, me, n_ranks,
                   n_experts, M_P, E_P, ACCUMULATE, WAIT)


@triton.jit
def _cells(counts_ptr, stats_ptr, table_ptr, recv_ptr, offsets_ptr, sum_ptr, capacity, salt, me, n_ranks,
           n_experts, M_P: tl.constexpr, E_P: tl.constexpr, ACCUMULATE: tl.constexpr, VOLATILE: tl.constexpr):
    """Plan step 2 in one program (``plan_reference.plan_cells_reference``); ``VOLATILE``:
    the counts were stored by peers in this launch's barrier."""
    # Element (r, j) is destination r's cell j = l*M + s (its receive order).
    M = n_ranks
    E = n_experts
    zero = tl.zeros([M_P, E_P], dtype=tl.int64)
    r = tl.arange(0, M_P).to(tl.int64)[:, None] + zero
    j = tl.arange(0, E_P).to(tl.int64)[None, :] + zero
    s = j % M
    g = r * (E // M) + j // M
    live = (r < M) & (j < E)
    flat = s * E + g  # index in [source, expert] order
    c = tl.load(counts_ptr + flat, mask=live, other=0, volatile=VOLATILE).to(tl.int64)

    # overflow.counts_seed
    terms = tl.where(live, (c % _PRIME) * _mix(_mix(_START, flat), salt) % _PRIME, 0)
    seed = _mix(_mix(_START, tl.sum(tl.sum(terms, axis=1), axis=0) % _PRIME), salt)

    # overflow.fair_allocation, row by row over destinations
    need = tl.sum(c, axis=1)[:, None]
    denom = tl.maximum(need, 1)
    exact = c * capacity
    share = exact // denom
    leftover = capacity - tl.sum(share, axis=1)[:, None]
    eligible = live & (exact % denom != 0)
    rot = _mix(_mix(_START, seed), r) % E
    elig = eligible.to(tl.int64)
    before = tl.cumsum(elig, axis=1) - elig
    at_rot = tl.sum(tl.where(j == rot, before, 0), axis=1)[:, None]
    total = tl.sum(elig, axis=1)[:, None]
    rotated = tl.where(j >= rot, before - at_rot, before + total - at_rot)
    bonus = (eligible & (rotated < leftover)).to(tl.int64)
    kept = tl.where(need > capacity, share + bonus, c)
    base = tl.cumsum(kept, axis=1) - kept

    tl.store(stats_ptr + flat, c, mask=live)
    tl.store(stats_ptr + M * E + flat, kept, mask=live)
    if ACCUMULATE:  # the running telemetry (one program: a plain read-add-write)
        tl.store(sum_ptr + flat, tl.load(sum_ptr + flat, mask=live, other=0) + c, mask=live)
        tl.store(sum_ptr + M * E + flat, tl.load(sum_ptr + M * E + flat, mask=live, other=0) + kept, mask=live)
    mine = live & (s == me)
    start = _mix(_mix(_mix(_START, seed), s), g) % tl.maximum(c, 1)
    tl.store(table_ptr + g, c, mask=mine)
    tl.store(table_ptr + E + g, c - kept, mask=mine)
    tl.store(table_ptr + 2 * E + g, start, mask=mine)
    tl.store(table_ptr + 3 * E + g, base, mask=mine)
    here = live & (r == me)
    tl.store(recv_ptr + j, base, mask=here)
    tl.store(recv_ptr + E + j, base + kept, mask=here)
    tl.store(offsets_ptr + j // M, (base + kept).to(tl.int32), mask=here & (s == M - 1))


@triton.jit
def _plan_cells_kernel(counts_ptr, stats_ptr, table_ptr, recv_ptr, offsets_ptr, sum_ptr,
                       capacity, salt, me, n_ranks, n_experts, epoch_ptr, parity, flag_table_ptr,
                       M_P: tl.constexpr, E_P: tl.constexpr, ACCUMULATE: tl.constexpr, WAIT: tl.constexpr,
                       FLAGS_P: tl.constexpr):
    # One program: step 2 from a count matrix, after the count exchange's barrier with WAIT.
    if WAIT:
        peer_barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, FLAGS_P)
    _cells(counts_ptr, stats_ptr, table_ptr, recv_ptr, offsets_ptr, sum_ptr, capacity, salt, me, n_ranks,
           n_experts, M_P, E_P, ACCUMULATE, WAIT)


@triton.jit
def _plan_rows_kernel(expert_ptr, rank_in_block_ptr, cum_ptr, table_ptr, recv_end_ptr,
                      dst_rank_ptr, dst_row_ptr, row_src_ptr,
                      n_slots, n_rows, n_ranks, n_experts,
                      BLOCK: tl.constexpr, E_P: tl.constexpr):
    # Program b plans slot block b (the block of _rank_slots_kernel) and receive rows [b*BLOCK, ...).
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = slot < n_slots
    rank, row = _slot_destination(expert_ptr, rank_in_block_ptr, cum_ptr, table_ptr, slot, live, n_ranks,
                                  n_experts, BLOCK)
    tl.store(dst_rank_ptr + slot, rank, mask=live)
    tl.store(dst_row_ptr + slot, row, mask=live)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    source = _receive_source(recv_end_ptr, rows, n_rows, n_ranks, n_experts, E_P)
    tl.store(row_src_ptr + rows, source, mask=rows < n_rows)


class CountPublish(NamedTuple):
    """Where the block scan also stores this rank's counts: int32 row ``me`` of an ``[M, E]``
    table at ``table_M[r] + byte_offset`` of every rank ``r`` (peer addresses)."""

    table_M: torch.Tensor
    byte_offset: int
    me: int


class CellRequest(NamedTuple):
    """Step 2's inputs for the block scan's launch (:func:`rank_slots_and_cells`): the int32
    ``[M, E]`` count table where the exchange's puts land (this rank's slab), and
    :func:`plan_cells`'s other arguments (the rank is the publishing one, ``CountPublish.me``)."""

    counts_ME: torch.Tensor
    capacity: int
    salt: int
    stats_sum_2ME: torch.Tensor | None
    wait: PeerWait | None


def _rank_blocks(expert_N: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1's first launch: ``(rank_in_block_N, hist_BE)``."""
    n = expert_N.numel()
    block = slot_block(n_experts)
    n_blocks = max(1, triton.cdiv(n, block))
    rank_N = torch.empty(n, dtype=torch.int32, device=expert_N.device)
    hist_BE = torch.empty(n_blocks, n_experts, dtype=torch.int32, device=expert_N.device)
    _rank_slots_kernel[(n_blocks,)](
        expert_N.contiguous(), rank_N, hist_BE, n, n_experts,
        BLOCK_S=block, E_P=next_power_of_2(n_experts), num_warps=4,
    )
    return rank_N, hist_BE


def rank_slots(expert_N: torch.Tensor, n_experts: int, publish: CountPublish | None = None) -> SlotRanks:
    rank_N, hist_BE = _rank_blocks(expert_N, n_experts)
    return SlotRanks(rank_N, scan_blocks(hist_BE, publish=publish))


def rank_slots_and_cells(expert_N: torch.Tensor, n_experts: int, tickets_1: torch.Tensor, publish: CountPublish,
                         cells: CellRequest) -> tuple[SlotRanks, CellPlan]:
    """Steps 1 and 2 with the count exchange in two launches: the slot ranks, then the block
    scan, which puts the counts into every rank (``publish``) and, in its program that
    finishes last, passes the exchange's barrier (``cells.wait``) and plans the cells from
    the exchanged counts (``cells``). ``tickets_1``: an int32 counter at zero, left at zero
    (shared by launches that cannot run concurrently)."""
    if cells.counts_ME.shape != (publish.table_M.numel(), n_experts):
        raise ValueError(f"rank_slots_and_cells: cells.counts_ME has shape {tuple(cells.counts_ME.shape)}, "
                         f"but the counts are put into {publish.table_M.numel()} ranks of {n_experts} experts")
    rank_N, hist_BE = _rank_blocks(expert_N, n_experts)
    cum_BE, plan = _scan(hist_BE, 1024, publish, tickets_1, cells)
    assert plan is not None
    return SlotRanks(rank_N, cum_BE), plan


def scan_blocks(hist_BE: torch.Tensor, chunk: int = 1024, publish: CountPublish | None = None) -> torch.Tensor:
    """``hist_BE.cumsum(0)`` (int32) in one launch, ``chunk`` blocks per step of each column;
    with ``publish``, the totals (last row) are stored into every rank too, in the same launch."""
    return _scan(hist_BE, chunk, publish, None, None)[0]


def _scan(hist_BE: torch.Tensor, chunk: int, publish: CountPublish | None, tickets_1: torch.Tensor | None,
          request: CellRequest | None) -> tuple[torch.Tensor, CellPlan | None]:
    n_blocks, n_experts = hist_BE.shape
    cum_BE = torch.empty_like(hist_BE)
    peers = publish.table_M.contiguous() if publish is not None else cum_BE
    n_ranks = peers.numel() if publish is not None else 1
    cells, wait = None, None
    cell_args: tuple = (cum_BE,) * 7 + (0, 0)
    if request is not None:
        assert tickets_1 is not None
        if tickets_1.dtype != torch.int32 or tickets_1.numel() != 1:
            raise ValueError(f"rank_slots_and_cells: tickets_1 must be one int32 counter, got "
                             f"{tickets_1.dtype} {tuple(tickets_1.shape)}")
        _check_stats_sum(request.stats_sum_2ME)
        cells = _empty_cells(n_ranks, n_experts, hist_BE.device)
        wait = request.wait
        cell_args = (tickets_1, request.counts_ME, *cells,
                     request.stats_sum_2ME if request.stats_sum_2ME is not None else cells.stats_2ME,
                     request.capacity, request.salt % overflow.HASH_PRIME)
    _cumsum_blocks_kernel[(n_experts,)](
        hist_BE, cum_BE, n_blocks, n_experts, peers, publish.byte_offset if publish else 0,
        publish.me if publish else 0, n_ranks, *cell_args,
        wait.epochs_2 if wait is not None else cum_BE, wait.parity if wait is not None else 0,
        wait.flag_table_M.contiguous() if wait is not None else cum_BE,
        CHUNK=min(chunk, next_power_of_2(n_blocks)), PUBLISH=publish is not None,
        M_P=max(2, next_power_of_2(n_ranks)), E_P=next_power_of_2(n_experts), CELLS=request is not None,
        ACCUMULATE=request is not None and request.stats_sum_2ME is not None, WAIT=wait is not None,
        FLAGS_P=max(2, next_power_of_2(n_ranks)), FENCE=request is not None and hist_BE.is_cuda, num_warps=4,
    )
    return cum_BE, cells


def _check_stats_sum(stats_sum_2ME: torch.Tensor | None) -> None:
    if stats_sum_2ME is not None and (stats_sum_2ME.dtype != torch.int64 or not stats_sum_2ME.is_contiguous()):
        raise ValueError(f"plan_cells: stats_sum_2ME must be contiguous int64 (written in place), got "
                         f"{stats_sum_2ME.dtype} with strides {stats_sum_2ME.stride()}")


def _empty_cells(M: int, E: int, device: torch.device) -> CellPlan:
    return CellPlan(
        torch.empty(2, M, E, dtype=torch.int64, device=device),
        torch.empty(4, E, dtype=torch.int64, device=device),
        torch.empty(2, E, dtype=torch.int64, device=device),
        torch.empty(E // M, dtype=torch.int32, device=device),
    )


def plan_cells(counts_ME: torch.Tensor, capacity: int, salt: int, rank: int,
               stats_sum_2ME: torch.Tensor | None = None, wait: PeerWait | None = None) -> CellPlan:
    M, E = counts_ME.shape
    _check_stats_sum(stats_sum_2ME)
    cells = _empty_cells(M, E, counts_ME.device)
    _plan_cells_kernel[(1,)](
        counts_ME.contiguous(), *cells, stats_sum_2ME if stats_sum_2ME is not None else cells.stats_2ME,
        capacity, salt % overflow.HASH_PRIME, rank, M, E,
        wait.epochs_2 if wait is not None else counts_ME, wait.parity if wait is not None else 0,
        wait.flag_table_M.contiguous() if wait is not None else counts_ME,
        M_P=next_power_of_2(M), E_P=next_power_of_2(E), ACCUMULATE=stats_sum_2ME is not None,
        WAIT=wait is not None, FLAGS_P=max(2, next_power_of_2(M)), num_warps=4,
    )
    return cells


def plan_rows(
    expert_N: torch.Tensor, slots: SlotRanks, cells: CellPlan, ep_size: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, E = expert_N.numel(), cells.slot_table_4E.shape[1]
    device = expert_N.device
    dst_rank_N = torch.empty(n, dtype=torch.int64, device=device)
    dst_row_N = torch.empty(n, dtype=torch.int64, device=device)
    row_src_C = torch.empty(capacity, dtype=torch.int64, device=device)
    block = slot_block(E)
    grid = max(1, triton.cdiv(max(n, capacity), block))
    _plan_rows_kernel[(grid,)](
        expert_N.contiguous(), slots.rank_in_block_N, slots.cum_BE, cells.slot_table_4E, cells.recv_2E[1],
        dst_rank_N, dst_row_N, row_src_C, n, capacity, ep_size, E,
        BLOCK=block, E_P=next_power_of_2(E), num_warps=4,
    )
    return dst_rank_N, dst_row_N, row_src_C
