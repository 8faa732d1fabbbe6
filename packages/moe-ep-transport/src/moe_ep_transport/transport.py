"""What a transport does, and the all-to-all reference transport.

A transport moves rows for a :class:`~moe_ep_transport.plan.RoutePlan` that every
backend computes identically; it decides nothing about the layout. Four steps:

- ``exchange_counts(counts_E) -> counts_ME``: every rank learns every rank's counts
  (int32 in, int32 or int64 out; valid until the transport's next call).
- ``plan_routes(expert_N, E, top_k=, capacity=, salt=, stats_sum_2ME=) -> plan``: the
  call's :class:`~moe_ep_transport.plan.RoutePlan`: ``ops.rank_slots``,
  ``exchange_counts``, :func:`~moe_ep_transport.plan.plan_routes`
  (:func:`count_and_plan`). The rowwise transport fuses the count exchange into the
  plan's kernels: the slot-ranking kernel stores the counts into the peers, the cell
  kernel passes the barrier (two launches fewer).
- ``open_route(plan) -> route``: per-call state (splits, permutations, origins).
- ``send(route, src_RW, per_src) -> out_CW``: row ``src[i // per_src]`` of slot
  ``i`` lands at ``out[dst_row[i]]`` on ``dst_rank[i]``; padding rows are zero; a
  fresh tensor. (``per_src = k`` sends tokens: a transport may move a token once
  per destination rank instead of once per slot.) With ``transient`` the result may
  instead be a view of the transport's own buffer, valid through its next call only
  (padding rows undefined). With ``slot_weights_N`` (float32, one per slot) on a
  route's first send, ``route.weights_C`` becomes each receive row's weight (zero for
  padding): the rowwise transport carries them in the send's metadata, for free.
- ``gather_sum(route, rows_CD, w_N, store_rows) -> (y_TD, rows_ND | None)``: the
  reverse trip, reduced: ``y[t] = sum_j w[t*k+j] * rows[dst_row]@dst_rank`` in
  ``w_N``'s dtype; dropped slots count zero whatever their weight.
- ``reduce_back(route, rows_CD, w_C, acc_dtype) -> y_TD``: the reverse trip reduced
  at the destinations first (``EPConfig.combine``): each rank sums the rows it holds
  of each token (``ops.partial_sums_reference``, weights ``w_C`` per receive row or
  unit), one partial per token travels back, the source sums them in rank order
  (``ops.sum_partials``); ``y`` has the rows' dtype.
- ``send_grads(route, grad_TD, w_C, rows_CD, scaled) -> (grad_rows_CD, grad_w_C)``:
  combine's backward at the destinations: ``grad_TD`` travels like a token send, then
  each receive row's gradient and its weight's gradient (``ops.combine_grads`` over the
  receive rows; :func:`send_then_grads`); the rowwise transport's receive kernel computes
  them as it reads the rows (one launch fewer). Padding rows: unset.
- ``send_back(route, rows_CW) -> back_NW``: receive row ``c`` returns to slot
  ``origin`` of its source, unreduced (e.g. one value per row); dropped slots zero.

Shape legend: T tokens, k top-k, N = T*k slots, M ranks, E experts, C capacity,
W 32-bit words per row, D row width.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from moe_ep_transport import ops
from moe_ep_transport.plan import RoutePlan, plan_routes


def check_send(plan: RoutePlan, src_RW: torch.Tensor, per_src: int) -> None:
    """A send must not read past its source rows (on the GPU that would be a silent bad read)."""
    n = plan.dst_rank_N.numel()
    rows = src_RW.shape[0] if src_RW.dim() == 2 else 0
    if per_src < 1 or rows * per_src < n:
        raise ValueError(
            f"send: src_RW {tuple(src_RW.shape)} with per_src={per_src} has {rows} source rows "
            f"for {n} slots (slot i reads row i // per_src)"
        )


def count_and_plan(
    transport: Transport, expert_N: torch.Tensor, n_experts: int, *, top_k: int, capacity: int, salt: int,
    stats_sum_2ME: torch.Tensor | None = None,
) -> RoutePlan:
    """``Transport.plan_routes`` step by step: the slot ranks, the count exchange, the plan."""
    slots = ops.rank_slots(expert_N, n_experts)
    counts_ME = transport.exchange_counts(slots.counts_E)
    return plan_routes(expert_N, slots, counts_ME, rank=transport.rank, top_k=top_k, capacity=capacity,
                       salt=salt, stats_sum_2ME=stats_sum_2ME)


def send_then_grads(
    transport: Transport, route: Any, grad_TD: torch.Tensor, w_C: torch.Tensor, rows_CD: torch.Tensor | None,
    scaled: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``Transport.send_grads`` in two steps: the send, then ``ops.combine_grads``."""
    plan = route.plan
    g_CD = ops.from_words(transport.send(route, ops.as_words(grad_TD), plan.top_k), grad_TD.dtype)
    # One receive row per "token" (k = 1); rows past the last expert's end are padding
    # (the buffer is sized for the worst case): skipped, their results unspecified.
    return ops.combine_grads(g_CD, w_C, rows_CD, grad_TD.dtype, scaled=scaled, bound=plan.group_offsets_L[-1:])


class Transport(Protocol):
    rank: int
    world_size: int

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor: ...

    def plan_routes(
        self, expert_N: torch.Tensor, n_experts: int, *, top_k: int, capacity: int, salt: int,
        stats_sum_2ME: torch.Tensor | None = None,
    ) -> RoutePlan: ...

    def open_route(self, plan: RoutePlan) -> Any: ...

    def send(
        self, route: Any, src_RW: torch.Tensor, per_src: int, transient: bool = False,
        slot_weights_N: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def gather_sum(
        self, route: Any, rows_CD: torch.Tensor, w_N: torch.Tensor, store_rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def reduce_back(
        self, route: Any, rows_CD: torch.Tensor, w_C: torch.Tensor | None, acc_dtype: torch.dtype
    ) -> torch.Tensor: ...

    def send_grads(
        self, route: Any, grad_TD: torch.Tensor, w_C: torch.Tensor, rows_CD: torch.Tensor | None, scaled: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]: ...

    def send_back(self, route: Any, rows_CW: torch.Tensor) -> torch.Tensor: ...

    def replayable(self) -> AbstractContextManager[None]:
        """Where calls a CUDA graph captures run, so that the graph can be replayed (or a
        ``RuntimeError`` saying why this transport's calls cannot be)."""
        ...


@dataclass
class AllToAllRoute:
    plan: RoutePlan
    send_order: torch.Tensor  # slots in (destination rank, destination row) order, kept ones only
    recv_pos: torch.Tensor  # receive row of each row as all_to_all delivers them (source-major)
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    max_tokens: int = 0  # T_max of every rank (the partials' row blocks)
    weights_C: torch.Tensor | None = None  # each receive row's weight, when a send carried them
    slots: ops.SlotTable | None = None  # the inverse receive layout, built on first use


class AllToAllTransport:
    """Count exchange, then ``all_to_all_single`` with host-visible split sizes.

    The reference backend: it runs on gloo (CPU) and NCCL alike and synchronises
    the host once per call (``open_route`` reads the split sizes).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, max_tokens: int = 0) -> None:
        self.group = group
        self.max_tokens = max_tokens  # T_max: sizes the partials of reduce_back
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def close(self) -> None:
        """Nothing to release (symmetry with the rowwise transport)."""

    def replayable(self) -> AbstractContextManager[None]:
        raise RuntimeError(
            "the all_to_all EP transport cannot run in a CUDA graph: it reads its split sizes "
            "on the host every call (use the rowwise transport)"
        )

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        counts_ME = counts_E.new_empty(self.world_size * counts_E.numel())
        dist.all_gather_into_tensor(counts_ME, counts_E.contiguous(), group=self.group)
        return counts_ME.view(self.world_size, -1)

    def plan_routes(
        self, expert_N: torch.Tensor, n_experts: int, *, top_k: int, capacity: int, salt: int,
        stats_sum_2ME: torch.Tensor | None = None,
    ) -> RoutePlan:
        return count_and_plan(self, expert_N, n_experts, top_k=top_k, capacity=capacity, salt=salt,
                              stats_sum_2ME=stats_sum_2ME)

    def open_route(self, plan: RoutePlan) -> AllToAllRoute:
        M, E = plan.kept_ME.shape
        L = E // M
        me, C = self.rank, plan.capacity
        splits = plan.kept_ME.view(M, M, L).sum(2).tolist()  # [source][destination]; host sync
        send_splits = splits[me]
        recv_splits = [splits[s][me] for s in range(M)]
        key = torch.where(plan.valid_N, plan.dst_rank_N * C + plan.dst_row_N, M * C)
        send_order = torch.argsort(key)[: sum(send_splits)]
        # all_to_all delivers source-major: cells (s, l) in that order, each cell's rows in order.
        kept_sl = plan.kept_ME[:, me * L : (me + 1) * L]
        sizes = kept_sl.reshape(-1)
        ends = sizes.cumsum(0)
        j = torch.arange(sum(recv_splits), device=sizes.device)
        cell = torch.searchsorted(ends, j, right=True)
        base_sl = plan.recv_base_LM.t().reshape(-1)
        recv_pos = base_sl.index_select(0, cell) + j - (ends - sizes).index_select(0, cell)
        return AllToAllRoute(plan, send_order, recv_pos, send_splits, recv_splits, self.max_tokens)

    def send(
        self, route: AllToAllRoute, src_RW: torch.Tensor, per_src: int, transient: bool = False,
        slot_weights_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_send(route.plan, src_RW, per_src)
        if slot_weights_N is not None:  # one more exchange here (the reference is not tuned)
            words = self.send(route, ops.as_words(slot_weights_N.to(torch.float32).view(-1, 1)), 1)
            route.weights_C = ops.from_words(words, torch.float32).view(-1)
        payload = src_RW.index_select(0, route.send_order // per_src)
        inbox = src_RW.new_empty(sum(route.recv_splits), src_RW.shape[1])
        dist.all_to_all_single(
            inbox, payload, route.recv_splits, route.send_splits, group=self.group
        )
        out = src_RW.new_zeros(route.plan.capacity, src_RW.shape[1])
        return out.index_copy_(0, route.recv_pos, inbox)

    def gather_sum(
        self, route: AllToAllRoute, rows_CD: torch.Tensor, w_N: torch.Tensor, store_rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = route.plan
        rows_CD = rows_CD.contiguous()
        # Slot i's row lands at i; the sum reads only the slots that went to other ranks.
        back = self.send_back(route, ops.as_words(rows_CD))
        return ops.topk_gather_sum(
            ops.from_words(back, rows_CD.dtype), rows_CD, plan.dst_rank_N, plan.dst_row_N,
            self.rank, w_N, plan.top_k, rows_CD.dtype, store_rows,
        )

    def send_grads(
        self, route: AllToAllRoute, grad_TD: torch.Tensor, w_C: torch.Tensor, rows_CD: torch.Tensor | None,
        scaled: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return send_then_grads(self, route, grad_TD, w_C, rows_CD, scaled)

    def send_back(self, route: AllToAllRoute, rows_CW: torch.Tensor) -> torch.Tensor:
        payload = rows_CW.contiguous().index_select(0, route.recv_pos)
        inbox = payload.new_empty(sum(route.send_splits), rows_CW.shape[1])
        dist.all_to_all_single(
            inbox, payload, route.send_splits, route.recv_splits, group=self.group
        )
        back = inbox.new_zeros(route.plan.dst_rank_N.numel(), rows_CW.shape[1])
        return back.index_copy_(0, route.send_order, inbox)

    def _slots(self, route: AllToAllRoute) -> ops.SlotTable:
        """Built once per route: the receive rows learn their slot index by one more exchange."""
        if route.slots is None:
            plan = route.plan
            n = plan.dst_rank_N.numel()
            index = ops.as_words(ops.index_range(n, plan.dst_rank_N.device).view(n, 1))
            origin_C = ops.from_words(self.send(route, index, 1), torch.int64).view(-1)
            route.slots = ops.slot_table(plan.row_src_C, origin_C, self.world_size, route.max_tokens * plan.top_k)
        return route.slots

    def reduce_back(
        self, route: AllToAllRoute, rows_CD: torch.Tensor, w_C: torch.Tensor | None, acc_dtype: torch.dtype
    ) -> torch.Tensor:
        plan, T_max = route.plan, route.max_tokens
        if plan.n_tokens > T_max:
            raise ValueError(f"reduce_back: {plan.n_tokens} tokens, more than the transport's max_tokens={T_max}")
        partials_QD = ops.partial_sums_reference(
            rows_CD.contiguous(), w_C, self._slots(route), plan.top_k, acc_dtype
        )
        inbox_QD = torch.empty_like(partials_QD)  # block r: rank r's partials of this rank's tokens
        dist.all_to_all_single(inbox_QD, partials_QD, group=self.group)
        return ops.sum_partials(
            inbox_QD, plan.dst_rank_N, self.world_size, T_max, plan.top_k, rows_CD.dtype
        )
