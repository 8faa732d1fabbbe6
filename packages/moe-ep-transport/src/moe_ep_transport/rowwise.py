"""The rowwise transport: one-sided row puts into symmetric buffers, no host sync.

Per dispatch: (1) every rank puts its per-expert counts into every peer's slab and
a barrier completes the exchange; (2) every rank plans, on the device, the
destination (rank, row) of each of its routed rows (:mod:`moe_ep_transport.plan`);
(3) one kernel stores each token once into every other rank that holds one of its
experts (that rank's *token inbox*: row ``source * T_max + token``), and the
token's slot index at each of its receive rows there; rows a rank sends to itself
go straight into the output tensor; a barrier completes it; the destination
expands the tokens of other ranks into their receive rows, a fresh tensor (the
slab is reused by the next phase, while the rows must live until the expert
backward). Sending tokens instead of rows cuts the NVLink bytes of a dispatch by
the number of a token's experts that share a rank (top-8 over two ranks: about
4x); the token inbox takes M * T_max rows, which fit the slab's C = cf * T_max * k
rows while M <= cf * k; larger EP groups send one row per slot
(:meth:`EPConfig.dispatch_layout`).

Per combine the destination puts each expert output row back into its source's
slab at the source's slot index (the origin recorded in step 3; rows of its own
stay where they are); after a barrier each source sums its top-k rows in FP32,
reading its own rows straight from the expert output. Putting (not fetching)
saves copying the expert output into a symmetric buffer first, and stores travel
faster than loads over NVLink.

Every step is one launch (a put, a barrier, a kernel of :mod:`moe_ep_transport.ops`),
and on CUDA the steps fold: the dispatch's count exchange into the plan's kernels (the
slot ranking's block scan stores the counts into the peers, and its program that
finishes last passes the barrier and plans the cells, :meth:`RowwiseTransport.plan_routes`),
and a put's barrier into the kernel that reads what it put (every program of the receive
or sum waits for the peers' flags; ``_kernel_parts``): five launches per dispatch (slot
ranks, block scan and cells, rows, put, receive), two per combine (put, sum). Index
tensors that do not change between calls are built once. Sizes are static: capacity C
rows to receive, T_max*k slots to return.

With ``EPConfig.copy_engine`` the two sends that are one contiguous block per destination
rank, the token inbox (every source token, needed there or not) and the partial sums,
travel by the GPU's copy engines after the kernel (``PeerMemory.put_rows(bulk=True)``,
``put_partial_sums(bulk=True)``): no SM stores them.

Consecutive phases use different slabs, chosen by a counter on the host. A CUDA graph
replays the slabs its capture chose, so calls captured in a graph run inside
:meth:`RowwiseTransport.replayable`, which rounds their phases up to a multiple of the
slab count with data-less phases (a barrier): replayed back to back, or after another
such graph, they still alternate.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_ep_transport import ops
from moe_ep_transport._triton_support import resolve_backend
from moe_ep_transport.config import EPConfig
from moe_ep_transport.peer_memory import N_SLABS, PeerMemory, slab_view
from moe_ep_transport.plan import RoutePlan, plan_routes, route_plan
from moe_ep_transport.transport import check_send, send_then_grads

_ALIGN = 256


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def slab_bytes_for(cfg: EPConfig, ep_size: int, row_bytes: int, partial_bytes: int | None = None) -> int:
    """Bytes each slab needs for rows of at most ``row_bytes`` (any phase; never more for the token inbox).

    ``partial_bytes`` (default: FP32 rows of ``d_model``) sizes the partials of
    :meth:`RowwiseTransport.reduce_back` when ``cfg`` sums at the destination.
    """
    capacity = cfg.rank_capacity(ep_size)
    counts = ep_size * cfg.n_experts * 4
    send = _align(capacity * 8) + capacity * _align_row(row_bytes)
    inbox_rows = ep_size * cfg.max_tokens if cfg.dispatch_layout(ep_size) == "token_inbox" else 0
    inbox = _align(capacity * 8) + inbox_rows * _align_row(row_bytes)  # never more than `send`
    back = cfg.max_slots * _align_row(row_bytes)
    partial_bytes = cfg.d_model * 4 if partial_bytes is None else partial_bytes
    partials = ep_size * cfg.max_tokens * partial_bytes if cfg.sums_at_destination(
        ep_size, row_bytes, partial_bytes) else 0
    return _align(max(counts, send, inbox, back, partials))


def _align_row(row_bytes: int) -> int:
    return (row_bytes + 3) // 4 * 4


@dataclass
class RowwiseRoute:
    plan: RoutePlan
    origin_C: torch.Tensor | None = None  # source slot index of each receive row (after the first send)
    slot_rows_S: torch.Tensor | None = None  # rows of the route's ops.SlotTable (receive kernel)
    weights_C: torch.Tensor | None = None  # each receive row's weight, when the first send carried them


class RowwiseTransport:
    def __init__(self, memory: PeerMemory, cfg: EPConfig) -> None:
        self.memory = memory
        self.rank = memory.rank
        self.world_size = memory.world_size
        self.capacity = cfg.rank_capacity(self.world_size)
        self.max_slots = cfg.max_slots
        self.max_tokens = cfg.max_tokens
        self._meta_bytes = _align(self.capacity * 8)
        self.layout = cfg.dispatch_layout(self.world_size)  # fixed per group: the slabs are sized for it
        # The receive kernel writes the inverse layout when combine may sum at the destination
        # for rows up to FP32 (a store per receive row; ops.slot_table would cost launches).
        D = cfg.d_model
        self._writes_slot_table = cfg.sums_at_destination(self.world_size, 4 * D, 4 * D)
        # Bulk moves by the copy engines (EPConfig.copy_engine): the token inbox sends and the
        # partial sums, each one contiguous block per destination rank.
        self.copy_engine = cfg.copy_engine
        if cfg.copy_engine and not cfg.copy_engine_moves(self.world_size, 4 * D):  # rows up to FP32
            raise ValueError(
                f"EPConfig.copy_engine moves the token inbox sends and the partial sums summed at the "
                f"destination, and an EP group of {self.world_size} ranks uses neither here (one row per "
                f"slot: {self.world_size} * max_tokens > the capacity; combine={cfg.combine!r} sums at the "
                f"source): leave it False or set combine='destination'"
            )
        self._phase = 0  # advances identically on every rank (all ranks run the same calls)
        # The count exchange's fixed addressing: the counts to row `rank` of every peer.
        M, device = self.world_size, memory.slab(0).device
        self._count_rank_M = torch.arange(M, device=device)
        self._count_row_M = torch.full((M,), self.rank, dtype=torch.int64, device=device)
        # The plan launch's ticket counters, one per slab (a launch leaves its counter at zero;
        # launches that share a slab never overlap).
        self._tickets = torch.zeros(N_SLABS, dtype=torch.int32, device=device)

    def close(self) -> None:
        """Release the symmetric buffers (collective; NVSHMEM memory only)."""
        close = getattr(self.memory, "close", None)
        if close is not None:
            close()

    def _next_slab(self) -> int:
        index = self._phase % N_SLABS
        self._phase += 1
        return index

    @property
    def phase(self) -> int:
        """Phases run so far (the same on every rank); the next one uses slab ``phase % N_SLABS``."""
        return self._phase

    @contextmanager
    def replayable(self) -> Iterator[None]:
        """Calls inside take a multiple of ``N_SLABS`` phases, so a CUDA graph captured around
        them can be replayed back to back, or after another such graph.

        A replay reruns its capture's slab choices without advancing the host counter: a
        graph of an odd number of phases would start its next replay on the slab its last
        phase used, which a slower peer may still be reading. Each data-less phase added
        at the end is one barrier (every rank has read the previous phase's slab).
        """
        start = self._phase
        yield
        while (self._phase - start) % N_SLABS:
            self._next_slab()
            self.memory.barrier()

    def _check_fits(self, nbytes: int, what: str) -> None:
        if nbytes > self.memory.slab_bytes:
            raise ValueError(
                f"{what} needs {nbytes} bytes of symmetric buffer but the transport's slabs hold "
                f"{self.memory.slab_bytes}. make_transport sizes them for rows of EPConfig.d_model "
                f"elements of its `dtype` argument (default torch.bfloat16) or for its `codec`'s "
                f"packed rows: build it with the dtype of the rows you dispatch "
                f"(make_transport(..., dtype=x.dtype)) and the codec you use; a RowwiseTransport "
                f"built directly needs a PeerMemory of rowwise.slab_bytes_for(cfg, ep_size, "
                f"row_bytes) bytes per slab"
            )

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Every rank's counts, int32 ``[M, E]``: a view of the slab, valid until the next phase."""
        slab, counts_ME = self._count_slab(counts_E.numel())
        self._put_counts(slab, counts_E)
        self.memory.barrier()
        return counts_ME

    def _count_slab(self, n_experts: int) -> tuple[int, torch.Tensor]:
        """The count exchange's slab (the next one) and the int32 ``[M, E]`` table at its start."""
        self._check_fits(self.world_size * n_experts * 4, "the count exchange")
        slab = self._next_slab()
        return slab, slab_view(self.memory.slab(slab), 0, torch.int32, n_experts)[: self.world_size]

    def _put_counts(self, slab: int, counts_E: torch.Tensor) -> None:
        """Row ``rank`` of the int32 ``[M, E]`` count table at the start of every rank's slab."""
        M, E = self.world_size, counts_E.numel()
        self.memory.put_rows(
            slab, 0, counts_E.to(torch.int32).view(1, E), self._count_rank_M, self._count_row_M, per_src=M,
        )

    def plan_routes(
        self, expert_N: torch.Tensor, n_experts: int, *, top_k: int, capacity: int, salt: int,
        stats_sum_2ME: torch.Tensor | None = None,
    ) -> RoutePlan:
        """The call's plan (``transport.Transport``), the count exchange folded into its kernels
        where the plan runs its kernels and the peers' slabs have addresses (NVSHMEM): the
        slot ranking's block scan also puts the counts into every peer, and where the memory
        passes barriers in kernels its program that finishes last passes the exchange's
        barrier and plans the cells too (``_plan_kernels.rank_slots_and_cells``)."""
        E = n_experts
        slab, counts_ME = self._count_slab(E)
        table = self.memory.peer_table(slab)
        if table is not None and resolve_backend("auto", expert_N.device):
            from moe_ep_transport import _plan_kernels as plan_kernels

            publish = plan_kernels.CountPublish(table, 0, self.rank)
            if self.memory.barriers_in_kernels:
                wait = self.memory.deferred_barrier()
                slots, cells = plan_kernels.rank_slots_and_cells(
                    expert_N, E, self._tickets[slab : slab + 1], publish,
                    plan_kernels.CellRequest(counts_ME, capacity, salt, stats_sum_2ME, wait),
                )
                return route_plan(expert_N, slots, cells, rank=self.rank, top_k=top_k, capacity=capacity)
            slots = plan_kernels.rank_slots(expert_N, E, publish)
        else:
            slots = ops.rank_slots(expert_N, E)
            self._put_counts(slab, slots.counts_E)
        wait = self.memory.deferred_barrier()
        return plan_routes(expert_N, slots, counts_ME, rank=self.rank, top_k=top_k, capacity=capacity,
                           salt=salt, stats_sum_2ME=stats_sum_2ME, wait=wait)

    @property
    def sends_tokens_once(self) -> bool:
        """Whether a token dispatch moves each token once per destination rank (the token inbox layout)."""
        return self.layout == "token_inbox"

    def _inbox_stride(self, per_src: int) -> int:
        """Rows per source of the token inbox a send of ``per_src`` slots per source row puts
        into (each row once per destination rank), or 0: one row per slot at its receive row."""
        return self.max_tokens if per_src > 1 and self.sends_tokens_once else 0

    def open_route(self, plan: RoutePlan) -> RowwiseRoute:
        if plan.capacity != self.capacity:
            raise ValueError(f"plan capacity {plan.capacity} != transport capacity {self.capacity}")
        return RowwiseRoute(plan)

    def send(
        self, route: RowwiseRoute, src_RW: torch.Tensor, per_src: int, transient: bool = False,
        slot_weights_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_send(route.plan, src_RW, per_src)
        plan, C, W = route.plan, self.capacity, src_RW.shape[1]
        if transient and per_src == 1 and route.origin_C is not None:
            return self._send_in_place(route, src_RW)
        row_bytes = W * src_RW.element_size()
        self._check_fits(self._meta_bytes + C * row_bytes, "a row send")  # C >= the inbox's rows
        inbox_rows = self.world_size * self.max_tokens
        stride = self._inbox_stride(per_src)
        dedup = stride > 0
        if dedup and src_RW.shape[0] > self.max_tokens:  # it would overlap the next source's inbox
            raise ValueError(
                f"send: {src_RW.shape[0]} source rows, more than EPConfig.max_tokens={self.max_tokens}"
            )
        slab = self._next_slab()
        first = route.origin_C is None
        if slot_weights_N is not None and not first:
            raise ValueError("send: slot weights travel with a route's first send only")
        device = src_RW.device
        out = src_RW.new_empty(C, W)
        self.memory.put_rows(
            slab, self._meta_bytes, src_RW, plan.dst_rank_N, plan.dst_row_N, per_src=per_src,
            local_dst=out, meta_N=ops.index_range(plan.dst_rank_N.numel(), device) if first else None,
            inbox_stride=stride, meta_w_N=slot_weights_N, bulk=dedup and self.copy_engine,
        )
        wait = self.memory.deferred_barrier()  # passed by the receive kernel
        buf = self.memory.slab(slab)
        inbox = slab_view(buf, self._meta_bytes, src_RW.dtype, W)[: inbox_rows if dedup else C]
        origin_in_C, origin_out_C, slot_rows = route.origin_C, None, None
        if first:
            origin_in_C = buf[: C * 8].view(torch.int64)
            origin_out_C = route.origin_C = torch.empty(C, dtype=torch.int64, device=device)
            if self._writes_slot_table:
                slot_rows = route.slot_rows_S = torch.empty(
                    self.world_size * self.max_slots, dtype=torch.int64, device=device)
        if slot_weights_N is not None:
            route.weights_C = torch.empty(C, dtype=torch.float32, device=device)
        ops.finish_receive(
            out, inbox, plan.row_src_C, self.rank, origin_in_C, origin_out_C, per_src, stride,
            slot_rows, self.max_slots, route.weights_C if slot_weights_N is not None else None, wait=wait,
        )
        return out

    def _send_in_place(self, route: RowwiseRoute, src_RW: torch.Tensor) -> torch.Tensor:
        """A send whose receive rows stay in the slab (every row, this rank's own too)."""
        plan, C, W = route.plan, self.capacity, src_RW.shape[1]
        self._check_fits(self._meta_bytes + C * W * src_RW.element_size(), "a row send")
        slab = self._next_slab()
        self.memory.put_rows(slab, self._meta_bytes, src_RW, plan.dst_rank_N, plan.dst_row_N)
        self.memory.barrier()
        return slab_view(self.memory.slab(slab), self._meta_bytes, src_RW.dtype, W)[:C]

    def gather_sum(
        self, route: RowwiseRoute, rows_CD: torch.Tensor, w_N: torch.Tensor, store_rows: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = route.plan
        if route.origin_C is None:
            raise RuntimeError("gather_sum before send: the route has no row origins")
        rows_CD = rows_CD.contiguous()
        words = ops.as_words(rows_CD)
        n = plan.dst_rank_N.numel()
        self._check_fits(self.max_slots * words.shape[1] * words.element_size(), "a row return")
        slab = self._next_slab()
        self.memory.put_rows(slab, 0, words, plan.row_src_C, route.origin_C, skip_local=True)
        wait = self.memory.deferred_barrier()  # passed by the sum's kernel
        inbox_ND = slab_view(self.memory.slab(slab), 0, rows_CD.dtype, rows_CD.shape[1])[:n]
        return ops.topk_gather_sum(
            inbox_ND, rows_CD, plan.dst_rank_N, plan.dst_row_N, self.rank, w_N,
            plan.top_k, rows_CD.dtype, store_rows, wait=wait,
        )

    def _slots(self, route: RowwiseRoute) -> ops.SlotTable:
        plan = route.plan
        if route.origin_C is None:
            raise RuntimeError("reduce_back before send: the route has no row origins")
        if route.slot_rows_S is None:  # the receive kernel did not write it: built once per route
            route.slot_rows_S = ops.slot_table(plan.row_src_C, route.origin_C, self.world_size, self.max_slots).rows_S
        return ops.SlotTable(route.slot_rows_S, plan.row_src_C, route.origin_C, self.max_slots)

    def reduce_back(
        self, route: RowwiseRoute, rows_CD: torch.Tensor, w_C: torch.Tensor | None, acc_dtype: torch.dtype
    ) -> torch.Tensor:
        plan, M, T_max = route.plan, self.world_size, self.max_tokens
        D = rows_CD.shape[1]
        self._check_fits(M * T_max * D * acc_dtype.itemsize, "the partial sums")
        slots = self._slots(route)
        slab = self._next_slab()
        self.memory.put_partial_sums(
            slab, 0, rows_CD.contiguous(), w_C, slots, top_k=plan.top_k, max_tokens=T_max,
            acc_dtype=acc_dtype, bulk=self.copy_engine,
        )
        wait = self.memory.deferred_barrier()  # passed by the sum's kernel
        partials_QD = slab_view(self.memory.slab(slab), 0, acc_dtype, D)[: M * T_max]
        return ops.sum_partials(partials_QD, plan.dst_rank_N, M, T_max, plan.top_k, rows_CD.dtype, wait=wait)

    def send_grads(
        self, route: RowwiseRoute, grad_TD: torch.Tensor, w_C: torch.Tensor, rows_CD: torch.Tensor | None,
        scaled: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``transport.Transport.send_grads``: on the kernel path the receive kernel computes the
        row and weight gradients as it reads the token gradients (no receive of their own)."""
        plan = route.plan
        if route.origin_C is None or not resolve_backend("auto", grad_TD.device):
            return send_then_grads(self, route, grad_TD, w_C, rows_CD, scaled)
        words = ops.as_words(grad_TD)
        check_send(plan, words, plan.top_k)
        C, W = self.capacity, words.shape[1]
        self._check_fits(self._meta_bytes + C * W * words.element_size(), "a row send")
        stride = self._inbox_stride(plan.top_k)
        slab = self._next_slab()
        local = words.new_empty(C, W)  # the rows this rank sends itself
        self.memory.put_rows(slab, self._meta_bytes, words, plan.dst_rank_N, plan.dst_row_N, per_src=plan.top_k,
                             local_dst=local, inbox_stride=stride, bulk=stride > 0 and self.copy_engine)
        wait = self.memory.deferred_barrier()  # passed by the receive kernel
        inbox = slab_view(self.memory.slab(slab), self._meta_bytes, grad_TD.dtype, grad_TD.shape[1])
        from moe_ep_transport import _transport_kernels as kernels

        return kernels.receive_grads(ops.from_words(local, grad_TD.dtype), inbox, plan.row_src_C, route.origin_C,
                                     self.rank, w_C, rows_CD, scaled, plan.top_k, stride, wait=wait)

    def send_back(self, route: RowwiseRoute, rows_CW: torch.Tensor) -> torch.Tensor:
        plan = route.plan
        if route.origin_C is None:
            raise RuntimeError("send_back before send: the route has no row origins")
        n, W = plan.dst_rank_N.numel(), rows_CW.shape[1]
        self._check_fits(self.max_slots * W * rows_CW.element_size(), "a row return")
        slab = self._next_slab()
        # Every row, this rank's own included, lands at its slot index in its source's slab;
        # the same launch zeroes the dropped slots' rows (nobody sends them).
        self.memory.put_rows(slab, 0, rows_CW.contiguous(), plan.row_src_C, route.origin_C,
                             clear_N=plan.dst_rank_N)
        wait = self.memory.deferred_barrier()  # passed by the copy's kernel
        return ops.copy_rows(slab_view(self.memory.slab(slab), 0, rows_CW.dtype, W)[:n], wait)  # the slab is scratch
