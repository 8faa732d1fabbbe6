"""Expert-parallel token dispatcher: the ``TokenDispatcher`` contract over an EP group.

Shape legend: T tokens on this rank, D width, k top-k, N = T*k slots, E global
experts, L local experts, M EP ranks, C rank capacity (rows returned by dispatch).

``dispatch(x[T,D], expert_ids[T,k])`` returns ``rows[C,D]`` (expert-major over the
local experts, padding rows zero), ``group_offsets[L]`` (int32 cumulative ends, on
the device) and a handle; ``combine(rows_out[C,D], weights[T,k], handle)`` returns
``y[T,D] = sum_j weights[t,j] * expert_output(t,j)`` accumulated in FP32 in slot
order. Both are autograd functions: dispatch's backward is a combine of the row
gradients with unit weights, combine's backward a dispatch of ``weights * grad_y``
plus the gradient of the weights. ``run_experts(x, expert_ids, weights, experts)`` runs
dispatch -> experts -> combine in one call (moe_model's ``PipelinesExperts``): in
``EPConfig.overlap_chunks`` token chunks pipelined over two CUDA streams
(:mod:`moe_ep_transport.pipeline`), or, with one chunk, as the three plain calls.
With an ``interleave`` (:class:`~moe_ep_transport.interleave.MicrobatchInterleave`),
dispatch and combine called from one of its forwards run on the communication stream
and hand control to the next forward.

Overflow (a destination asked for more than C rows): with ``overflow="drop"`` the
rows chosen by :mod:`moe_ep_transport.overflow` are dropped; their weights count as
zero in combine (the token's other experts keep their weights, which are *not*
renormalised: the residual stream carries the token, and renormalising would
scale the surviving experts by a load-dependent factor). ``handle.plan.dropped_M``
and the telemetry report them. ``overflow="error"`` raises :class:`EPOverflowError`
on every rank before any row moves; it reads the drop count on the host, the one
place in dispatch/combine that synchronises (use it to validate a configuration;
train with ``"drop"`` or dropless).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_ep_transport import ops
from moe_ep_transport.codec import RowCodec
from moe_ep_transport.config import EPConfig
from moe_ep_transport.interleave import MicrobatchInterleave
from moe_ep_transport.overflow import HASH_PRIME
from moe_ep_transport.pipeline import ExpertsFn, PipelinedHandle, run_pipelined
from moe_ep_transport.plan import RoutePlan
from moe_ep_transport.telemetry import EPTelemetry
from moe_ep_transport.transport import Transport


class EPOverflowError(RuntimeError):
    """A rank was asked for more rows than its capacity under ``overflow="error"``."""


@dataclass
class EPHandle:
    plan: RoutePlan  # the routing of this call (drops, layout); device tensors
    route: Any  # the transport's per-call state
    weights: torch.Tensor | None = None  # the weights dispatch sent along (see EPDispatcher.dispatch)
    weights_version: int | None = None  # their version counter then (an in-place change voids them)


def _version(t: torch.Tensor) -> int | None:
    """A tensor's version counter (inference tensors have none: identity alone decides)."""
    return None if t.is_inference() else t._version


def _accumulation_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """FP32, or wider when an operand is wider (FP64 tests stay exact)."""
    acc = torch.float32
    for dtype in dtypes:
        acc = torch.promote_types(acc, dtype)
    return acc


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x_TD: torch.Tensor, dispatcher: EPDispatcher, route: Any, w_N: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.dispatcher, ctx.route = dispatcher, route
        ctx.x_dtype = x_TD.dtype
        return dispatcher._send_tokens(x_TD, route, w_N)

    @staticmethod
    def backward(ctx: Any, grad_CD: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        plan, transport = ctx.route.plan, ctx.dispatcher.transport
        acc = _accumulation_dtype(grad_CD.dtype)
        if ctx.dispatcher.sums_at_destination(grad_CD.dtype, acc):
            grad_TD = transport.reduce_back(ctx.route, grad_CD.contiguous(), None, acc)
        else:
            ones_N = ops.ones(plan.dst_rank_N.numel(), acc, grad_CD.device)  # dropped: zero anyway
            grad_TD, _ = transport.gather_sum(ctx.route, grad_CD.contiguous(), ones_N, store_rows=False)
        return grad_TD.to(ctx.x_dtype), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows_CD: torch.Tensor, weights_Tk: torch.Tensor, dispatcher: EPDispatcher, route: Any,
        staged: bool,
    ) -> torch.Tensor:
        acc = _accumulation_dtype(rows_CD.dtype, weights_Tk.dtype)
        w_N = weights_Tk.reshape(-1).to(acc)  # dropped slots weigh zero inside the sum
        need_rows = ctx.needs_input_grad[1]
        transport = dispatcher.transport
        ctx.dispatcher, ctx.route = dispatcher, route
        ctx.w_dtype, ctx.rows_dtype, ctx.acc = weights_Tk.dtype, rows_CD.dtype, acc
        ctx.at_destination = dispatcher.sums_at_destination(rows_CD.dtype, acc)
        if ctx.at_destination:
            # The weights travel to the rows (unless dispatch carried them); each rank sums what
            # it holds of a token. Without a backward they are read where they land (a
            # transient send: no copy).
            if staged and acc == torch.float32 and getattr(route, "weights_C", None) is not None:
                w_C = route.weights_C
            else:
                keep = any(ctx.needs_input_grad[:2])
                w_words = transport.send(route, ops.as_words(w_N.view(-1, 1)), 1, transient=not keep)
                w_C = ops.from_words(w_words, acc).view(-1)
            y_TD = transport.reduce_back(route, rows_CD, w_C, acc)
            ctx.save_for_backward(w_C, rows_CD if need_rows else None)
            return y_TD
        y_TD, rows_ND = transport.gather_sum(route, rows_CD, w_N, store_rows=need_rows)
        ctx.save_for_backward(w_N, rows_ND if need_rows else None)
        return y_TD

    @staticmethod
    def backward(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.at_destination:
            return _Combine._backward_at_destination(ctx, grad_TD)
        w_N, rows_ND = ctx.saved_tensors
        plan = ctx.route.plan
        T, k = plan.n_tokens, plan.top_k
        need_rows, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_rows = grad_w = None
        # Dropped slots are not sent, so their (unmasked) weights do not matter in scaled_ND.
        scaled_ND, grad_w_N = ops.combine_grads(
            grad_TD, w_N, rows_ND if need_w else None, ctx.rows_dtype, scaled=need_rows
        )
        if need_rows:
            words = ctx.dispatcher.transport.send(ctx.route, ops.as_words(scaled_ND), 1)
            grad_rows = ops.from_words(words, ctx.rows_dtype)
        if need_w:
            grad_w = grad_w_N.view(T, k).to(ctx.w_dtype)
        return grad_rows, grad_w, None, None, None

    @staticmethod
    def _backward_at_destination(ctx: Any, grad_TD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The token's gradient travels once per rank (like a dispatch); each row's gradient
        and its weight's gradient are computed where the row is, and only the latter returns."""
        w_C, rows_CD = ctx.saved_tensors
        plan, transport = ctx.route.plan, ctx.dispatcher.transport
        need_rows, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Padding rows' results are unspecified, read by nobody (the expert GEMMs stop at the
        # offsets, send_back skips them).
        grad_rows, grad_w_C = transport.send_grads(
            ctx.route, grad_TD.to(ctx.rows_dtype), w_C, rows_CD if need_w else None, scaled=need_rows)
        grad_w = None
        if need_w:
            back = transport.send_back(ctx.route, ops.as_words(grad_w_C.view(-1, 1)))
            grad_w = ops.from_words(back, ctx.acc).view(plan.n_tokens, plan.top_k).to(ctx.w_dtype)
        return grad_rows, grad_w, None, None, None


class EPDispatcher:
    """Dispatch/combine for one MoE layer over a transport (shared by the layers of a group).

    ``seed`` salts the overflow priorities (give each layer its own). ``interleave``: the
    microbatch interleave whose forwards call this dispatcher, if any (share one between
    the layers of a model).
    """

    def __init__(
        self, cfg: EPConfig, transport: Transport, codec: RowCodec | None = None, seed: int = 0,
        interleave: MicrobatchInterleave | None = None,
    ) -> None:
        self.cfg = cfg
        self.interleave = interleave
        self.transport = transport
        self.codec = codec
        self.seed = seed
        self._salt = seed % HASH_PRIME
        self.ep_size = transport.world_size
        self.rank = transport.rank
        self.n_local = cfg.local_experts(self.ep_size)
        self.expert_start = self.rank * self.n_local
        self.capacity = cfg.rank_capacity(self.ep_size)
        self.telemetry = EPTelemetry()

    @property
    def _interleaving(self) -> bool:
        """Whether this call comes from a forward of the dispatcher's interleave."""
        return self.interleave is not None and self.interleave.interleaving

    def sums_at_destination(self, rows_dtype: torch.dtype, acc_dtype: torch.dtype) -> bool:
        """Where combine sums a token's contributions for rows of ``rows_dtype`` (EPConfig.combine)."""
        D = self.cfg.d_model
        return self.cfg.sums_at_destination(self.ep_size, D * rows_dtype.itemsize, D * acc_dtype.itemsize)

    def bytes_per_row(self, dtype: torch.dtype) -> int:
        """Bytes one dispatched row moves (the codec's packed width when one is set)."""
        if self.codec is not None:
            return self.codec.packed_width(self.cfg.d_model)
        return self.cfg.d_model * dtype.itemsize

    def _check_inputs(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights_Tk: torch.Tensor | None
    ) -> None:
        """Reject a call before the count exchange (a collective) and the telemetry see it."""
        cfg = self.cfg
        if x_TD.dim() != 2 or x_TD.shape[1] != cfg.d_model:
            raise ValueError(f"x must be [T, {cfg.d_model}] (EPConfig.d_model), got {tuple(x_TD.shape)}")
        if expert_ids_Tk.shape != (x_TD.shape[0], cfg.top_k):
            raise ValueError(
                f"expert_ids must be [T={x_TD.shape[0]}, k={cfg.top_k}], got {tuple(expert_ids_Tk.shape)}"
            )
        if expert_ids_Tk.dtype.is_floating_point or expert_ids_Tk.dtype == torch.bool:
            raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids_Tk.dtype}")
        if x_TD.shape[0] > cfg.max_tokens:
            raise ValueError(f"x has {x_TD.shape[0]} tokens, more than EPConfig.max_tokens={cfg.max_tokens}")
        if expert_ids_Tk.device != x_TD.device:
            raise ValueError(f"expert_ids is on {expert_ids_Tk.device}, x on {x_TD.device}")
        if weights_Tk is not None and weights_Tk.shape != expert_ids_Tk.shape:
            raise ValueError(
                f"weights must be [T, k] = {tuple(expert_ids_Tk.shape)}, got {tuple(weights_Tk.shape)}"
            )
        if weights_Tk is not None and weights_Tk.device != x_TD.device:
            raise ValueError(f"weights is on {weights_Tk.device}, x on {x_TD.device}")
        if weights_Tk is not None and not weights_Tk.dtype.is_floating_point:
            raise ValueError(f"weights must be a floating-point tensor, got {weights_Tk.dtype}")

    def dispatch(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, EPHandle]:
        """Send each routed row to its expert's rank.

        ``weights`` [T, k]: the weights ``combine`` will get, when known. Where combine
        sums at the destination they travel with the tokens (in the rowwise send's
        metadata: no extra exchange), and ``combine`` uses them if it receives the same
        tensor, unchanged (otherwise it sends the weights it gets).
        """
        self._check_inputs(x_TD, expert_ids_Tk, weights)
        if self._interleaving:
            inputs = [x_TD, expert_ids_Tk] + ([weights] if weights is not None else [])
            return self.interleave.transport_call(
                lambda: self._dispatch(x_TD, expert_ids_Tk, weights), inputs, lambda out: out[:2])
        return self._dispatch(x_TD, expert_ids_Tk, weights)

    def _dispatch(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, EPHandle]:
        expert_N = expert_ids_Tk.reshape(-1)  # any integer dtype: the plan kernels read it as is
        plan = self.transport.plan_routes(
            expert_N, self.cfg.n_experts, top_k=self.cfg.top_k, capacity=self.capacity, salt=self._salt,
            stats_sum_2ME=self.telemetry.running_sum(self.ep_size, self.cfg.n_experts, x_TD.device),
        )
        if self.cfg.overflow == "error":
            self._raise_on_overflow(plan)
        route = self.transport.open_route(plan)
        stage = weights is not None and self.sums_at_destination(x_TD.dtype, torch.float32)
        w_N = weights.detach().reshape(-1).to(torch.float32) if stage else None
        rows_CD = _Dispatch.apply(x_TD, self, route, w_N)
        handle = EPHandle(plan, route)
        if stage:
            handle.weights, handle.weights_version = weights, _version(weights)
        return rows_CD, plan.group_offsets_L, handle

    def dropped_per_expert(self, handle: EPHandle | PipelinedHandle) -> torch.Tensor:
        """[E] int64: the slots *this rank* routed that their destination dropped.

        This rank's row of the route plan, so summing over the ranks of the EP group
        counts every dropped slot once (the telemetry, in contrast, is the same on
        every rank of the group). Satisfies ``moe_model.ReportsDrops`` structurally.
        A pipelined call's handle sums its chunks'.
        """
        if isinstance(handle, PipelinedHandle):
            return torch.stack([self.dropped_per_expert(chunk) for chunk in handle.chunks]).sum(0)
        plan = handle.plan
        return plan.counts_ME[plan.rank] - plan.kept_ME[plan.rank]

    def run_experts(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights_Tk: torch.Tensor, experts: ExpertsFn
    ) -> tuple[torch.Tensor, EPHandle | PipelinedHandle]:
        """``combine(experts(*dispatch(x, ids, weights)[:2]), weights, handle)`` and the handle(s):
        moe_model's ``PipelinesExperts``. With ``EPConfig.overlap_chunks == 1`` exactly those
        three calls; with more, chunks pipelined over two CUDA streams
        (:mod:`moe_ep_transport.pipeline`), each chunk a call of at most ``max_tokens``."""
        if self.cfg.overlap_chunks == 1:
            rows, offsets, handle = self.dispatch(x_TD, expert_ids_Tk, weights_Tk)
            return self.combine(experts(rows, offsets), weights_Tk, handle), handle
        if self._interleaving:
            raise ValueError(
                f"EPConfig.overlap_chunks={self.cfg.overlap_chunks} pipelines chunks of one microbatch; "
                "it does not combine with a microbatch interleave (use one or the other)"
            )
        return run_pipelined(self, x_TD, expert_ids_Tk, weights_Tk, experts, self.cfg.overlap_chunks)

    def combine(self, rows_out_CD: torch.Tensor, weights_Tk: torch.Tensor, handle: EPHandle) -> torch.Tensor:
        plan = handle.plan
        if rows_out_CD.shape[0] != self.capacity:
            raise ValueError(f"rows_out must have {self.capacity} rows (capacity), got {rows_out_CD.shape[0]}")
        if weights_Tk.shape != (plan.n_tokens, plan.top_k):
            raise ValueError(
                f"weights must be [{plan.n_tokens}, {plan.top_k}], got {tuple(weights_Tk.shape)}"
            )
        staged = handle.weights is weights_Tk and _version(weights_Tk) == handle.weights_version
        if self._interleaving:
            return self.interleave.transport_call(
                lambda: _Combine.apply(rows_out_CD, weights_Tk, self, handle.route, staged),
                [rows_out_CD, weights_Tk], lambda y: [y])
        return _Combine.apply(rows_out_CD, weights_Tk, self, handle.route, staged)

    def _send_tokens(self, x_TD: torch.Tensor, route: Any, w_N: torch.Tensor | None) -> torch.Tensor:
        """Forward row movement: encode each token once, send a copy per kept slot, decode
        (with ``w_N``, each slot's weight travels along)."""
        plan = route.plan
        if self.codec is None:
            words = self.transport.send(route, ops.as_words(x_TD), plan.top_k, slot_weights_N=w_N)
            return ops.from_words(words, x_TD.dtype)
        packed = ops.as_words(self.codec.encode(x_TD))
        received = ops.from_words(
            self.transport.send(route, packed, plan.top_k, slot_weights_N=w_N), torch.uint8)
        rows_CD = self.codec.decode(received, x_TD.dtype)
        return torch.where((plan.row_src_C >= 0).unsqueeze(1), rows_CD, 0)

    def _raise_on_overflow(self, plan: RoutePlan) -> None:
        dropped = plan.dropped_M.tolist()  # the documented host sync of overflow="error"
        if any(dropped):
            M, E = plan.counts_ME.shape
            asked = plan.counts_ME.view(M, M, E // M).sum((0, 2)).tolist()
            worst = max(range(M), key=lambda r: asked[r])
            raise EPOverflowError(
                f"EP rank {worst} was asked for {asked[worst]} rows but its capacity is "
                f"{self.capacity} (capacity_factor={self.cfg.capacity_factor}, "
                f"max_tokens={self.cfg.max_tokens}, top_k={self.cfg.top_k}); "
                f"rows over capacity per rank: {dropped}"
            )


def make_transport(
    backend: str,
    cfg: EPConfig,
    group: dist.ProcessGroup | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
    codec: RowCodec | None = None,
) -> Transport:
    """Build the transport of an EP group (one per group, shared by its MoE layers).

    ``backend="all_to_all"``: the reference (gloo or NCCL). ``backend="rowwise"``:
    NVSHMEM one-sided puts on CUDA; on CPU the same algorithm over emulated peer
    memory (for tests). The rowwise slabs are sized for rows of ``dtype`` (and the
    codec's packed rows) at ``cfg``'s capacity: pass the dtype of the activations
    given to ``dispatch`` (the default is BF16; wider rows do not fit).
    ``use_reference_kernels(True)`` sends the rowwise transport's planning and sums to
    their PyTorch reference, but its peer-memory puts and barriers on CUDA stay Triton
    kernels (byte copies with no eager counterpart): for a run without them, take
    ``all_to_all``.
    """
    from moe_ep_transport.transport import AllToAllTransport

    if backend == "all_to_all":
        if cfg.copy_engine:
            raise ValueError("EPConfig.copy_engine moves the rowwise transport's blocks; the all_to_all "
                             "transport's collectives move their own: leave it False or take 'rowwise'")
        return AllToAllTransport(group, cfg.max_tokens)
    if backend != "rowwise":
        raise ValueError(f"unknown EP transport backend {backend!r}: 'all_to_all' or 'rowwise'")
    from moe_ep_transport.rowwise import RowwiseTransport, slab_bytes_for

    ep_size = dist.get_world_size(group)
    row_bytes = cfg.d_model * dtype.itemsize
    if codec is not None:
        row_bytes = max(row_bytes, codec.packed_width(cfg.d_model))
    partial_bytes = cfg.d_model * max(4, dtype.itemsize)  # FP32 accumulation, or wider
    nbytes = slab_bytes_for(cfg, ep_size, row_bytes, partial_bytes)
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        from moe_ep_transport.nvshmem_memory import NvshmemPeerMemory

        memory = NvshmemPeerMemory(nbytes, group, device)
    else:
        from moe_ep_transport.peer_memory import EmulatedPeerMemory

        memory = EmulatedPeerMemory(nbytes, group, device)
    return RowwiseTransport(memory, cfg)
