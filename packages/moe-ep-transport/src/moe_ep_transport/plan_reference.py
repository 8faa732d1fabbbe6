"""The routing plan's three steps in PyTorch: their definition, and the CPU path.

Shape legend: N slots of this rank (flat slot ``i = t*k + j``), E global experts,
M EP ranks, L = E/M local experts, C rank capacity, B slot blocks of
:func:`slot_block` slots. A *cell* is the rows one source rank sends to one
expert; a destination receives its cells in the order ``j = l*M + s`` (local
expert, then source).

The plan is cut into the pieces that need no global synchronisation inside them,
so that on CUDA each is one Triton program (``_plan_kernels``; step 2 runs in the last
program of step 1's block scan) computing the same integers bit for bit:

1. :func:`rank_slots_reference`: per block of slots, how many slots chose each
   expert (running over blocks: ``cum_BE``), and each slot's rank among the
   earlier slots of its block that chose the same expert. ``cum_BE[-1]`` are this
   rank's counts, which the transport exchanges.
2. :func:`plan_cells_reference`: from the exchanged count matrix, the fair
   overflow allocation and the receive layout, as small tables.
3. :func:`plan_rows_reference`: every slot's destination (rank, row) and every
   receive row's source rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_ep_transport.overflow import counts_seed, dropped_window, fair_allocation

SLOT_BLOCK_ELEMENTS = 8192  # the [block, E] one-hot of a slot block stays in one program's registers


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def slot_block(n_experts: int) -> int:
    """Slots per block of step 1 (and per program of step 3)."""
    return max(16, min(256, SLOT_BLOCK_ELEMENTS // next_power_of_2(n_experts)))


class SlotRanks(NamedTuple):
    """Step 1's output."""

    rank_in_block_N: torch.Tensor  # int32: earlier slots of the same block with the same expert
    cum_BE: torch.Tensor  # int32: slots per expert in blocks 0..b (inclusive running count)

    @property
    def counts_E(self) -> torch.Tensor:
        """Rows this rank routes to each global expert (int32 view)."""
        return self.cum_BE[-1]


class CellPlan(NamedTuple):
    """Step 2's output: everything per cell, nothing per row."""

    stats_2ME: torch.Tensor  # int64: [0] rows asked per (source, expert), [1] rows kept
    slot_table_4E: torch.Tensor  # int64, per expert, this source's cell: size, dropped, drop start, base row
    recv_2E: torch.Tensor  # int64, this destination's cells in receive order: first row, end row
    group_offsets_L: torch.Tensor  # int32: cumulative ends of the local expert segments


def rank_slots_reference(expert_N: torch.Tensor, n_experts: int) -> SlotRanks:
    expert_N = expert_N.to(torch.int64)
    n, E = expert_N.numel(), n_experts
    if n and not (0 <= int(expert_N.min()) and int(expert_N.max()) < E):  # CPU path: checking is free
        raise ValueError(f"expert_ids must lie in [0, {E}) (EPConfig.n_experts)")
    block = slot_block(E)
    n_blocks = max(1, -(-n // block))
    slot_N = torch.arange(n, device=expert_N.device)
    bucket_N = (slot_N // block) * E + expert_N
    hist_BE = torch.zeros(n_blocks * E, dtype=torch.int64, device=expert_N.device)
    hist_BE = hist_BE.scatter_add_(0, bucket_N, torch.ones_like(expert_N)).view(n_blocks, E)
    cum_BE = hist_BE.cumsum(0)
    # Rank among all earlier slots with the same expert, minus those of earlier blocks.
    order_N = torch.argsort(expert_N, stable=True)
    position_N = torch.empty_like(order_N).scatter_(0, order_N, slot_N)
    total_E = cum_BE[-1]
    rank_N = position_N - (total_E.cumsum(0) - total_E).index_select(0, expert_N)
    earlier_N = (cum_BE - hist_BE).view(-1).index_select(0, bucket_N)
    return SlotRanks((rank_N - earlier_N).to(torch.int32), cum_BE.to(torch.int32))


def plan_cells_reference(
    counts_ME: torch.Tensor, capacity: int, salt: int, rank: int, stats_sum_2ME: torch.Tensor | None = None
) -> CellPlan:
    """The cells of destination ``rank``; with ``stats_sum_2ME`` (int64), the stats are added to it
    too (the running telemetry: the kernel adds them in the same launch)."""
    counts_ME = counts_ME.to(torch.int64)
    M, E = counts_ME.shape
    L = E // M
    kept_ME, drop_start_ME = fair_allocation(counts_ME, capacity, counts_seed(counts_ME, salt))
    # Receive layout of every destination r: its cells (l, s) in order, kept rows each.
    kept_rj = kept_ME.view(M, M, L).permute(1, 2, 0).reshape(M, E)
    base_rj = kept_rj.cumsum(1) - kept_rj
    base_ME = base_rj.view(M, L, M).permute(2, 0, 1).reshape(M, E)
    mine = counts_ME[rank]
    table = torch.stack([mine, mine - kept_ME[rank], drop_start_ME[rank], base_ME[rank]])
    recv = torch.stack([base_rj[rank], base_rj[rank] + kept_rj[rank]])
    # A fresh contiguous tensor: with one local expert the [1]-shaped column view keeps
    # stride M, which grouped GEMMs (torch._grouped_mm) reject.
    offsets = torch.empty(L, dtype=torch.int32, device=recv.device)
    offsets.copy_(recv[1].view(L, M)[:, -1])
    stats = torch.stack([counts_ME, kept_ME])
    if stats_sum_2ME is not None:
        stats_sum_2ME += stats
    return CellPlan(stats, table, recv, offsets)


def plan_rows_reference(
    expert_N: torch.Tensor, slots: SlotRanks, cells: CellPlan, ep_size: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dst_rank_N, dst_row_N, row_src_C)``, int64; dropped slots get rank -1 and row 0,
    padding receive rows source -1."""
    expert_N = expert_N.to(torch.int64)
    n, E = expert_N.numel(), cells.slot_table_4E.shape[1]
    block = slot_block(E)
    block_N = torch.arange(n, device=expert_N.device) // block
    earlier_N = torch.where(
        block_N > 0,
        slots.cum_BE.to(torch.int64).view(-1).index_select(0, (block_N - 1).clamp(min=0) * E + expert_N),
        0,
    )
    q_N = slots.rank_in_block_N.to(torch.int64) + earlier_N  # rank inside the slot's cell
    size_N, drop_N, start_N, base_N = cells.slot_table_4E.index_select(1, expert_N)
    dropped_N, preceding_N = dropped_window(q_N, size_N, drop_N, start_N)
    dst_rank_N = torch.where(dropped_N, -1, expert_N // (E // ep_size))
    dst_row_N = torch.where(dropped_N, 0, base_N + q_N - preceding_N)
    rows_C = torch.arange(capacity, device=expert_N.device)
    cell_C = torch.searchsorted(cells.recv_2E[1], rows_C, right=True)
    row_src_C = torch.where(cell_C < E, cell_C % ep_size, -1)
    return dst_rank_N, dst_row_N, row_src_C
