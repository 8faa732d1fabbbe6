"""The routing plan: where every routed (token, slot) row goes, computed on the device.

Shape legend: T tokens on this rank, k top-k, N = T*k slots (flat slot ``i = t*k + j``),
E global experts, M EP ranks, L = E/M local experts, C rank capacity (receive rows).

Receive layout (identical for every backend, so their outputs agree bit for bit):
rank ``r``'s buffer is expert-major over its local experts; inside an expert the
rows are grouped by source rank; inside a source they keep the source's slot
order. The layout needs only the count matrix ``counts_ME[s, g]`` (rows source
``s`` routes to expert ``g``), which every rank holds after the count exchange, so
each source computes the destination row of each of its slots by itself.

The plan takes three device launches on CUDA (:mod:`moe_ep_transport.plan_reference`
defines the steps): slot ranks (per block, then the block scan) before the count
exchange, the per-row destinations after it. The cell tables take no launch of their
own: the block scan's program that finishes last plans them (in the rowwise transport
after the exchange's barrier, which it passes), and an all-to-all transport plans them
in a single-program kernel (four launches). Folding the block scan into the slot
ranking's launch as well (its last block scanning the whole table) took a plan of 32k
tokens per rank from 70 to 80 us on one H100: one program's scan, and the larger blocks
that keep its table small, cost more than a launch replayed from a CUDA graph
(``tools/bench_ep_plan.py``, commit 47316d0 against 9c93953,
``ep_plan_fused_ranking_h100.json``); what planning the cells in the scan's last program
gains and costs is in the README's design notes. The per-row step keeps
its own kernel: folded into the token put (each program planning its slots and, for
the once-per-rank check, the token's earlier ones again) the put compiled to 255
registers with spills for sm_90, and a dispatch of 32k tokens per rank took 6.27 ms
instead of 1.14 on two H200s (``tools/bench_ep_transport.py``, ``dispatch_ms``, commit
b57a150 against 8587cb1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep_transport import ops
from moe_ep_transport.plan_reference import CellPlan, SlotRanks


@dataclass
class RoutePlan:
    rank: int  # this rank in the EP group
    n_tokens: int  # T
    top_k: int  # k
    capacity: int  # C
    stats_2ME: torch.Tensor  # int64: [0] rows requested per (source rank, global expert), [1] rows kept
    dst_rank_N: torch.Tensor  # int64: destination rank of each slot, -1 if the slot is dropped
    dst_row_N: torch.Tensor  # int64: row in the destination's receive buffer (0 if dropped)
    row_src_C: torch.Tensor  # int64: source rank of each receive row here, -1 for padding
    recv_base_LM: torch.Tensor  # int64: first receive row here of cell (local expert l, source s)
    group_offsets_L: torch.Tensor  # int32: cumulative ends of the local expert segments

    @property
    def counts_ME(self) -> torch.Tensor:
        """Rows requested per (source rank, global expert); the same on all ranks."""
        return self.stats_2ME[0]

    @property
    def kept_ME(self) -> torch.Tensor:
        """Rows that fit the destinations' capacity."""
        return self.stats_2ME[1]

    @property
    def valid_N(self) -> torch.Tensor:
        return self.dst_rank_N >= 0

    @property
    def ep_size(self) -> int:
        return self.stats_2ME.shape[1]

    @property
    def dropped_M(self) -> torch.Tensor:
        """Rows dropped at each destination rank in this call (int64, on the device)."""
        M, E = self.counts_ME.shape
        return (self.counts_ME - self.kept_ME).view(M, M, E // M).sum((0, 2))


def plan_routes(
    expert_N: torch.Tensor,
    slots: SlotRanks,
    counts_ME: torch.Tensor,
    *,
    rank: int,
    top_k: int,
    capacity: int,
    salt: int,
    stats_sum_2ME: torch.Tensor | None = None,
    wait: ops.PeerWait | None = None,
) -> RoutePlan:
    """Destination (rank, row) of every slot of this rank, and this rank's receive layout.

    ``slots = ops.rank_slots(expert_N, E)``; ``counts_ME`` stacks every rank's
    ``slots.counts_E`` (the count exchange); ``salt`` varies the overflow priorities
    per layer; ``stats_sum_2ME`` (int64 ``[2, M, E]``), a running sum the plan adds its
    ``stats_2ME`` to, in its own launch (:class:`~moe_ep_transport.telemetry.EPTelemetry`);
    ``wait``: the count exchange's barrier, still to pass (the cell kernel passes it first).
    """
    cells = ops.plan_cells(counts_ME, capacity, salt, rank, stats_sum_2ME, wait)
    return route_plan(expert_N, slots, cells, rank=rank, top_k=top_k, capacity=capacity)


def route_plan(expert_N: torch.Tensor, slots: SlotRanks, cells: CellPlan, *, rank: int, top_k: int,
               capacity: int) -> RoutePlan:
    """The plan from its first two steps' outputs (``slots``, ``cells``): the per-row step."""
    M, E = cells.stats_2ME.shape[1:]
    dst_rank_N, dst_row_N, row_src_C = ops.plan_rows(expert_N, slots, cells, M, capacity)
    return RoutePlan(
        rank=rank,
        n_tokens=expert_N.numel() // top_k,
        top_k=top_k,
        capacity=capacity,
        stats_2ME=cells.stats_2ME,
        dst_rank_N=dst_rank_N,
        dst_row_N=dst_row_N,
        row_src_C=row_src_C,
        recv_base_LM=cells.recv_2E[0].view(E // M, M),
        group_offsets_L=cells.group_offsets_L,
    )
