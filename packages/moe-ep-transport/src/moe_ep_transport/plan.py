"""The routing plan: where every routed (token, slot) row goes, computed on the device.

Shape legend: T tokens on this rank, k top-k, N = T*k slots (flat slot ``i = t*k + j``),
E global experts, M EP ranks, L = E/M local experts, C rank capacity (receive rows).

Receive layout (identical for every backend, so their outputs agree bit for bit):
rank ``r``'s buffer is expert-major over its local experts; inside an expert the
rows are grouped by source rank; inside a source they keep the source's slot
order. The layout needs only the count matrix ``counts_ME[s, g]`` (rows source
``s`` routes to expert ``g``), which every rank holds after the count exchange, so
each source computes the destination row of each of its slots by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep_transport.overflow import dropped_window, fair_allocation


@dataclass
class RoutePlan:
    rank: int  # this rank in the EP group
    n_tokens: int  # T
    top_k: int  # k
    capacity: int  # C
    counts_ME: torch.Tensor  # int64: rows requested per (source rank, global expert); same on all ranks
    kept_ME: torch.Tensor  # int64: rows that fit the destinations' capacity
    dst_rank_N: torch.Tensor  # int64: destination rank of each slot, -1 if the slot is dropped
    dst_row_N: torch.Tensor  # int64: row in the destination's receive buffer (0 if dropped)
    row_src_C: torch.Tensor  # int64: source rank of each receive row here, -1 for padding
    recv_base_LM: torch.Tensor  # int64: first receive row here of cell (local expert l, source s)
    group_offsets_L: torch.Tensor  # int32: cumulative ends of the local expert segments

    @property
    def valid_N(self) -> torch.Tensor:
        return self.dst_rank_N >= 0

    @property
    def ep_size(self) -> int:
        return self.counts_ME.shape[0]

    @property
    def dropped_M(self) -> torch.Tensor:
        """Rows dropped at each destination rank in this call (int64, on the device)."""
        M, E = self.counts_ME.shape
        return (self.counts_ME - self.kept_ME).view(M, M, E // M).sum((0, 2))


def local_counts(expert_N: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows this rank routes to each global expert (int64 [E]); no host sync (no bincount)."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=expert_N.device)
    return counts.scatter_add_(0, expert_N, torch.ones_like(expert_N))


def rank_in_expert(expert_N: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """For each slot, how many earlier slots of this rank chose the same expert."""
    order = torch.argsort(expert_N, stable=True)
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    start_E = counts_E.cumsum(0) - counts_E
    return pos - start_E.index_select(0, expert_N)


def plan_routes(
    expert_N: torch.Tensor,
    counts_ME: torch.Tensor,
    *,
    rank: int,
    top_k: int,
    capacity: int,
    seed: torch.Tensor,
) -> RoutePlan:
    """Destination (rank, row) of every slot of this rank, and this rank's receive layout."""
    M, E = counts_ME.shape
    L = E // M
    device = expert_N.device
    kept_ME, drop_start_ME = fair_allocation(counts_ME, capacity, seed)

    # Receive layout of every destination r: cells (l, s) in order, kept rows each.
    kept_rc = kept_ME.view(M, M, L).permute(1, 2, 0).reshape(M, L * M)
    base_rc = kept_rc.cumsum(1) - kept_rc

    # Destination row of each slot.
    q_N = rank_in_expert(expert_N, counts_ME[rank])
    r_N = expert_N // L
    cell_N = (expert_N % L) * M + rank
    size_N = counts_ME[rank].index_select(0, expert_N)
    drop_N = size_N - kept_ME[rank].index_select(0, expert_N)
    start_N = drop_start_ME[rank].index_select(0, expert_N)
    dropped_N, preceding_N = dropped_window(q_N, size_N, drop_N, start_N)
    dst_row_N = base_rc.view(-1).index_select(0, r_N * (L * M) + cell_N) + q_N - preceding_N
    dst_rank_N = torch.where(dropped_N, -1, r_N)
    dst_row_N = torch.where(dropped_N, 0, dst_row_N)

    # This rank's receive side.
    mine_c = kept_rc[rank]
    ends_c = mine_c.cumsum(0)
    rows_C = torch.arange(capacity, device=device)
    cell_C = torch.searchsorted(ends_c, rows_C, right=True)
    row_src_C = torch.where(cell_C < L * M, cell_C % M, -1)
    group_offsets_L = mine_c.view(L, M).sum(1).cumsum(0).to(torch.int32)
    return RoutePlan(
        rank=rank,
        n_tokens=expert_N.numel() // top_k,
        top_k=top_k,
        capacity=capacity,
        counts_ME=counts_ME,
        kept_ME=kept_ME,
        dst_rank_N=dst_rank_N,
        dst_row_N=dst_row_N,
        row_src_C=row_src_C,
        recv_base_LM=base_rc[rank].view(L, M),
        group_offsets_L=group_offsets_L,
    )
