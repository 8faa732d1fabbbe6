"""Token dispatch: the interface between routing and the expert GEMMs.

Shape legend: T tokens, k top_k, S = T*k routed slots (slot ``t*k + j`` is token
``t``'s ``j``-th choice), R dispatched rows, D d_model, E experts.

A dispatcher gathers the routed (token, slot) rows into an expert-major buffer
that a grouped GEMM consumes directly, and scatters expert outputs back. The
interface is a structural ``Protocol``: implementations (the local dispatcher
here, expert-parallel transports elsewhere) do not import this package.

Contract:
- ``dispatch(x[T,D], expert_ids[T,k]) -> (rows[R,D], group_offsets[E_local] int32, handle)``:
  rows for local expert ``e`` are ``rows[group_offsets[e-1]:group_offsets[e]]``
  (``group_offsets`` are cumulative end offsets, as ``torch._grouped_mm`` takes them);
  rows past ``group_offsets[-1]`` are padding, ignored by ``combine``, and their
  gradient is zero. ``R`` is a static bound (no host synchronisation sizes it).
- ``combine(rows_out[R,D], weights[T,k], handle) -> y[T,D]``: the top-k weighted sum
  of each token's expert outputs, accumulated in FP32; dropped slots add nothing.
- Both are differentiable; all metadata stays on the device.
- A dispatcher that can drop rows may also satisfy ``ReportsDrops``; the MoE layer
  then logs its drop counts.
- A dispatcher may also satisfy ``EncodesRows``: the MoE layer then hands it the experts'
  ``INPUT_ROW_ENCODER`` (``moe_model.row_encoding``), whose codes of the rows it may write
  as it gathers them.
- A dispatcher may also satisfy ``PipelinesExperts``: the MoE layer then hands it the
  experts and lets it run dispatch, experts and combine itself, in whatever schedule it
  chooses (an expert-parallel transport overlapping one token chunk's transfer with
  another's expert GEMMs), as long as the result is what dispatch -> experts -> combine
  gives. The model holds no schedule of its own.

The local dispatcher's capacity policy (``capacity_factor`` set): each expert keeps
at most ``C = ceil(capacity_factor * T * k / E)`` rows. Within an expert, slots are
ranked by (choice rank ``j``, then a fixed bijective hash of the token index): a
token's first choice beats anyone's second choice, and among equals the order is a
position-independent scramble. Nothing favours low expert ids or early tokens, and
the outcome is deterministic (activation recompute reproduces it exactly).

Dropless layout on CUDA: the expert-major order of the slots comes from a counting sort
in two Triton kernels (``_dispatch_kernels``) instead of a stable ``argsort`` and the
counting, inversion and prefix sums around it (~30 small kernels per call, each costing
more launch gap than work); the result is the same permutation, bit for bit.

Fused combine on CUDA: the combine forward and backward and the dispatch gather's
backward run as Triton kernels (``_combine_kernels``) that touch each byte once:
the forward reads each token's ``k`` rows once (``T*k*D`` elements) and writes
``y`` once (``T*D``), accumulating in FP32 registers; the backward reads ``rows_out``
and ``dy`` once and writes ``d_rows`` once, with the routing-weight gradients reduced
in the same pass. No ``[T*k, D]`` FP32 (or gathered ``[T, k, D]``) tensor is
materialised, and nothing uses atomics, so results are deterministic. In the dropless
layout the backward also serves the expert output's ``GRADIENT_ROW_ENCODER``
(``moe_model.row_encoding``: moe_mxfp8's FP8 experts quantize their output gradient per
row), writing ``d_rows``' codes in the same pass; and the gather serves the experts'
``INPUT_ROW_ENCODER`` (``dispatch_encoded``, one Triton kernel, ``_gather_kernels``),
without which it is ``index_select``. Elsewhere
(CPU, FP64, no Triton) the plain torch code below runs; it is the exact reference
the layout-equivalence tests compare bit for bit. Triton is imported lazily.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from moe_model._triton_support import Backend, use_fused
from moe_model.router import count_per_expert
from moe_model.row_encoding import GRADIENT_ROW_ENCODER, RowEncoder

_HASH_MULTIPLIER = 2654435761  # odd, so t -> t * m mod 2^32 is a bijection (Knuth)


@runtime_checkable
class TokenDispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``weights``: what ``combine`` will get, when known (a dispatcher that moves
        tokens between ranks may send them along; a local one ignores them)."""
        ...

    def combine(self, rows_out: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor: ...


@runtime_checkable
class ReportsDrops(Protocol):
    def dropped_per_expert(self, handle: Any) -> torch.Tensor:
        """[E] int64: routed slots of this dispatch that no expert processed."""
        ...


ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows[R,D], group_offsets) -> rows_out[R,D]


@runtime_checkable
class PipelinesExperts(Protocol):
    def run_experts(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, experts: ExpertsFn
    ) -> tuple[torch.Tensor, Any]:
        """``(y[T,D], handle)``: ``y`` is ``combine(experts(rows, group_offsets), weights, handle)``
        of ``dispatch(x, expert_ids, weights)``, differentiable like it; ``handle`` is what
        ``ReportsDrops.dropped_per_expert`` takes. ``experts`` may be called several times
        (on parts of the tokens) and from another CUDA stream than the caller's."""
        ...


@dataclass
class LocalDispatchHandle:
    token_of_row: torch.Tensor  # [R] int64 source token (0 for padding rows)
    slot_of_row: torch.Tensor  # [R] int64 source slot (0 for padding rows)
    row_of_slot: torch.Tensor  # [S] int64 row holding each slot (0 for dropped slots)
    kept_of_slot: torch.Tensor | None  # [S] float32 1 = processed, 0 = dropped; None: dropless
    valid_rows: torch.Tensor | None  # [R] bool, False for padding; None: no padding
    dropped_per_expert: torch.Tensor  # [E] int64
    n_tokens: int  # T


@runtime_checkable
class EncodesRows(Protocol):
    def dispatch_encoded(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor | None,
        encoder: RowEncoder,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``dispatch(x, expert_ids, weights)``; where the dispatcher can, it also writes the
        rows' per-row codes in the pass that writes the rows and hands them to
        ``encoder.receive`` (``moe_model.row_encoding``)."""
        ...


class _Gather(torch.autograd.Function):
    """``rows[r] = x[token_of_row[r]]`` (padding rows zero). The backward sums each
    token's ``k`` row gradients by gathering them, without atomics, so it is
    deterministic (an ``index_select`` backward would scatter-add). ``encoder``: where the
    fused gather runs (``gather_rows``), the rows' codes are handed to it."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, h: LocalDispatchHandle,
                encoder: RowEncoder | None) -> torch.Tensor:
        ctx.handle = h
        return gather_rows(x_TD, h.token_of_row, h.valid_rows, encoder)

    @staticmethod
    def backward(ctx: Any, d_rows_RD: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        h: LocalDispatchHandle = ctx.handle
        return weighted_gather_sum(d_rows_RD, h.row_of_slot, h.n_tokens, None, h.kept_of_slot), None, None


def gather_rows_reference(
    x_TD: torch.Tensor, token_of_row_R: torch.Tensor, valid_rows_R: torch.Tensor | None,
    encoder: RowEncoder | None = None,
) -> torch.Tensor:
    """``rows[r] = x[token_of_row[r]]``, zero where ``valid_rows`` is false: ``index_select``.
    ``encoder`` receives nothing here (the consumer encodes the rows itself)."""
    rows_RD = x_TD.index_select(0, token_of_row_R)
    if valid_rows_R is not None:
        rows_RD = torch.where(valid_rows_R[:, None], rows_RD, 0)
    return rows_RD


def gather_rows(
    x_TD: torch.Tensor, token_of_row_R: torch.Tensor, valid_rows_R: torch.Tensor | None,
    encoder: RowEncoder | None = None, backend: Backend = "auto",
) -> torch.Tensor:
    """``gather_rows_reference``'s rows. With an ``encoder``, the fused path (float rows) is
    one Triton kernel (``_gather_kernels``) that also writes the rows' codes and scales and
    hands them to the encoder; without one, or elsewhere, ``index_select`` (nothing is
    received)."""
    if encoder is not None and use_fused("gather_rows", backend, x_TD.device, lambda: _unfit_dtype(x_TD)):
        from moe_model import _gather_kernels as k

        rows_RD, codes, scales = k.gather_rows_encoded(x_TD, token_of_row_R, valid_rows_R, encoder)
        encoder.receive(rows_RD, codes, scales)
        return rows_RD
    return gather_rows_reference(x_TD, token_of_row_R, valid_rows_R, encoder)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------ combine and its gradients
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unfit_dtype(t: torch.Tensor) -> str | None:
    return None if t.dtype in _FUSED_DTYPES else f"{t.dtype} rows (the kernels take {_FUSED_DTYPES})"


def weighted_gather_sum_reference(
    rows_RD: torch.Tensor, row_of_slot_S: torch.Tensor, n_tokens: int,
    weights_S: torch.Tensor | None = None, kept_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t*k+j] * kept[t*k+j] * rows[row_of_slot[t*k+j]]`` in eager PyTorch,
    in ``rows``' dtype. With ``weights_S`` (the combine) the sum runs in at least FP32 (one
    batched GEMM); without (the dispatch gather's backward) in ``rows``' dtype. ``kept_S``
    (``[T*k]``, 1 kept / 0 dropped) and the weights default to ones."""
    T = n_tokens
    k = row_of_slot_S.shape[0] // max(T, 1)
    g_TkD = rows_RD.index_select(0, row_of_slot_S).view(T, k, rows_RD.shape[1])
    if weights_S is None:
        if kept_S is not None:
            g_TkD = g_TkD * kept_S.view(T, k, 1).to(g_TkD.dtype)
        return g_TkD.sum(1)
    acc = _accumulation_dtype(rows_RD.dtype)
    w_S = weights_S.reshape(-1).to(acc)
    if kept_S is not None:
        w_S = w_S * kept_S.to(acc)
    return torch.bmm(w_S.view(T, 1, k), g_TkD.to(acc)).view(T, -1).to(rows_RD.dtype)


def weighted_gather_sum(
    rows_RD: torch.Tensor, row_of_slot_S: torch.Tensor, n_tokens: int,
    weights_S: torch.Tensor | None = None, kept_S: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``weighted_gather_sum_reference``'s sum; the fused path (float rows) is one Triton
    kernel (``_combine_kernels``) accumulating in FP32 that reads each token's ``k`` rows
    once and writes ``y`` once, without atomics."""
    if use_fused("weighted_gather_sum", backend, rows_RD.device, lambda: _unfit_dtype(rows_RD)):
        from moe_model import _combine_kernels as k

        return k.weighted_gather_sum(rows_RD, row_of_slot_S, n_tokens, weights_S, kept_S)
    return weighted_gather_sum_reference(rows_RD, row_of_slot_S, n_tokens, weights_S, kept_S)


def combine_backward_reference(
    dy_TD: torch.Tensor, rows_out_RD: torch.Tensor, w_S: torch.Tensor, h: LocalDispatchHandle,
    encoder: RowEncoder | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_rows, d_weights)`` of ``y[t] = sum_j w_S[t*k+j] * rows_out[row_of_slot[t*k+j]]``
    (``w_S`` the slot weights in at least FP32, already multiplied by ``h.kept_of_slot``), in
    eager PyTorch: ``d_rows`` ``[R, D]`` in ``rows_out``'s dtype (zero for padding rows),
    ``d_weights`` ``[T, k]`` in ``w_S``'s dtype (zero for dropped slots). ``encoder``
    receives nothing here (the consumer encodes ``d_rows`` itself)."""
    T, D = dy_TD.shape
    k = w_S.shape[0] // max(T, 1)
    dy32_TD = dy_TD.to(w_S.dtype)
    d_rows = dy32_TD.index_select(0, h.token_of_row) * w_S.index_select(0, h.slot_of_row)[:, None]
    if h.valid_rows is not None:
        d_rows = torch.where(h.valid_rows[:, None], d_rows, 0.0)
    g_TkD = rows_out_RD.index_select(0, h.row_of_slot).view(T, k, D)
    d_weights_Tk = torch.bmm(g_TkD.to(w_S.dtype), dy32_TD.unsqueeze(-1)).view(T, k)
    if h.kept_of_slot is not None:
        d_weights_Tk = d_weights_Tk * h.kept_of_slot.view(T, k).to(w_S.dtype)
    return d_rows.to(rows_out_RD.dtype), d_weights_Tk


def combine_backward(
    dy_TD: torch.Tensor, rows_out_RD: torch.Tensor, w_S: torch.Tensor, h: LocalDispatchHandle,
    encoder: RowEncoder | None = None, backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``combine_backward_reference``'s gradients (``d_weights`` FP32 on the fused path); the
    fused path (float rows) is one Triton kernel (``_combine_kernels``) that reads
    ``rows_out`` and ``dy`` once and writes ``d_rows`` once, routing-weight gradients
    reduced in the same pass.

    ``encoder``: ``rows_out``'s ``GRADIENT_ROW_ENCODER`` (``moe_model.row_encoding``). The
    fused path in the dropless layout (every row written) also writes ``d_rows``' codes and
    scales and hands them to it; elsewhere it receives nothing."""
    if use_fused("combine_backward", backend, rows_out_RD.device, lambda: _unfit_dtype(rows_out_RD)):
        from moe_model import _combine_kernels as k

        every_row = h.kept_of_slot is None and h.valid_rows is None
        d_rows, d_weights, codes, scales = k.combine_backward(
            dy_TD, rows_out_RD, h.row_of_slot, w_S, h.kept_of_slot, rows_out_RD.shape[0],
            zero_fill=not every_row, encoder=encoder if every_row else None)
        if codes is not None:
            encoder.receive(d_rows, codes, scales)
        return d_rows, d_weights
    return combine_backward_reference(dy_TD, rows_out_RD, w_S, h, encoder)


class _Combine(torch.autograd.Function):
    """``y[t] = sum_j w[t,j] * rows_out[row_of_slot[t,j]]`` in (at least) FP32; saves only
    ``rows_out`` and the (kept-masked) slot weights, and serves ``rows_out``'s
    ``GRADIENT_ROW_ENCODER`` in the backward (``combine_backward``)."""

    @staticmethod
    def forward(ctx: Any, rows_out_RD: torch.Tensor, weights_Tk: torch.Tensor,
                h: LocalDispatchHandle) -> torch.Tensor:
        T = weights_Tk.shape[0]
        acc = _accumulation_dtype(rows_out_RD.dtype)
        w_S = weights_Tk.reshape(-1).to(acc)
        if h.kept_of_slot is not None:
            w_S = w_S * h.kept_of_slot.to(acc)
        ctx.save_for_backward(rows_out_RD, w_S)
        ctx.handle, ctx.weights_dtype = h, weights_Tk.dtype
        ctx.encoder = getattr(rows_out_RD, GRADIENT_ROW_ENCODER, None)
        return weighted_gather_sum(rows_out_RD, h.row_of_slot, T, w_S, h.kept_of_slot)

    @staticmethod
    def backward(ctx: Any, dy_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows_out_RD, w_S = ctx.saved_tensors
        d_rows, d_weights_Tk = combine_backward(dy_TD, rows_out_RD, w_S, ctx.handle, encoder=ctx.encoder)
        return d_rows, d_weights_Tk.to(ctx.weights_dtype), None


def dropless_layout_reference(
    expert_ids_Tk: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slot_of_row, row_of_slot, token_of_row, counts, offsets)``: slots expert-major,
    in slot order within an expert, by a stable ``argsort``; ``slot_of_row``,
    ``row_of_slot``, ``token_of_row`` int64 ``[T*k]``, ``counts`` int64 ``[E]``, ``offsets``
    their int32 cumulative sum."""
    k = expert_ids_Tk.shape[1]
    e_S = expert_ids_Tk.reshape(-1)
    counts_E = count_per_expert(e_S, n_experts)
    order_R = torch.argsort(e_S, stable=True)  # row r holds slot order_R[r]
    row_of_slot = torch.empty_like(order_R).scatter_(0, order_R, torch.arange(e_S.numel(), device=e_S.device))
    return order_R, row_of_slot, order_R // k, counts_E, counts_E.cumsum(0).to(torch.int32)


def dropless_layout(
    expert_ids_Tk: torch.Tensor, n_experts: int, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dropless_layout_reference``'s layout, bit for bit; the fused path is the counting
    sort of ``_dispatch_kernels`` (two Triton kernels)."""
    if use_fused("dropless_layout", backend, expert_ids_Tk.device):
        from moe_model import _dispatch_kernels as k

        return k.dropless_layout(expert_ids_Tk, n_experts)
    return dropless_layout_reference(expert_ids_Tk, n_experts)


class LocalDispatcher:
    """All experts on this rank: sort slots expert-major; dropless unless a capacity is set.

    Dropless: ``R = T*k``, no padding. With ``capacity_factor``: ``R = min(T*k, E*C)``
    and the kept rows are packed at the front (see the module docstring for the policy).
    """

    def __init__(self, n_experts: int, capacity_factor: float | None = None) -> None:
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor}")
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor

    def capacity(self, n_slots: int) -> int:
        """Rows each expert may take for ``n_slots`` routed slots (``n_slots`` if dropless)."""
        if self.capacity_factor is None:
            return n_slots
        return max(1, math.ceil(self.capacity_factor * n_slots / self.n_experts))

    def dispatch(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchHandle]:
        return self.dispatch_encoded(x_TD, expert_ids_Tk, weights, None)

    def dispatch_encoded(
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights: torch.Tensor | None,
        encoder: RowEncoder | None,
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchHandle]:
        """``dispatch``; ``encoder``: see ``EncodesRows`` (served where ``gather_rows``'s fused
        path runs)."""
        T, k = expert_ids_Tk.shape
        S, E, dev = T * k, self.n_experts, x_TD.device
        if self.capacity_factor is None:
            slot_of_row, row_of_slot, token_of_row, counts_E, offsets = dropless_layout(expert_ids_Tk, E)
            handle = LocalDispatchHandle(
                token_of_row=token_of_row, slot_of_row=slot_of_row, row_of_slot=row_of_slot,
                kept_of_slot=None, valid_rows=None, dropped_per_expert=torch.zeros_like(counts_E),
                n_tokens=T,
            )
            return _Gather.apply(x_TD, handle, encoder), offsets, handle

        e_S = expert_ids_Tk.reshape(-1)
        counts_E = count_per_expert(e_S, E)
        slots_S = torch.arange(S, device=dev)
        C = self.capacity(S)
        R = min(S, E * C)
        token_S = slots_S // k
        scramble_S = (token_S * _HASH_MULTIPLIER) & 0xFFFFFFFF
        key_S = ((e_S * k + slots_S % k) << 32) | scramble_S
        order = torch.argsort(key_S)  # keys are unique: expert-major, then priority
        e_sorted = e_S.index_select(0, order)
        first_of_expert_E = counts_E.cumsum(0) - counts_E
        rank = torch.arange(S, device=dev) - first_of_expert_E.index_select(0, e_sorted)
        kept_E = counts_E.clamp(max=C)
        group_offsets = kept_E.cumsum(0)
        keep = rank < C
        dest = torch.where(keep, group_offsets.index_select(0, e_sorted) - kept_E.index_select(0, e_sorted) + rank, R)
        slot_of_row = torch.zeros(R + 1, dtype=torch.int64, device=dev).scatter_(0, dest, order)[:R]
        row_of_slot = torch.zeros(S, dtype=torch.int64, device=dev).scatter_(
            0, order, torch.where(keep, dest, 0))
        kept_of_slot = torch.zeros(S, dtype=torch.float32, device=dev).scatter_(0, order, keep.float())
        valid_rows = torch.arange(R, device=dev) < group_offsets[-1]
        handle = LocalDispatchHandle(
            token_of_row=slot_of_row // k, slot_of_row=slot_of_row, row_of_slot=row_of_slot,
            kept_of_slot=kept_of_slot, valid_rows=valid_rows, dropped_per_expert=counts_E - kept_E,
            n_tokens=T,
        )
        return _Gather.apply(x_TD, handle, encoder), group_offsets.to(torch.int32), handle

    def combine(
        self, rows_out_RD: torch.Tensor, weights_Tk: torch.Tensor, handle: LocalDispatchHandle
    ) -> torch.Tensor:
        return _Combine.apply(rows_out_RD, weights_Tk, handle)

    def dropped_per_expert(self, handle: LocalDispatchHandle) -> torch.Tensor:
        return handle.dropped_per_expert


@contextmanager
def dropless_dispatch(model: nn.Module) -> Iterator[None]:
    """Inside the block every :class:`LocalDispatcher` of ``model`` keeps every slot; their
    capacity factors are restored on the way out, also on an error.

    A capacity sized for training batches (``C`` from the slots of the call) drops slots of
    a short call: a prompt's prefill of a few tokens, several routed to one expert. What a
    model writes while it trains (prompt samples) should be what the trained model writes
    at inference, which runs dropless. Other dispatchers (expert parallelism) size their
    capacity by the largest call they were built for, far above one prompt's, and are left
    as they are."""
    local = [m.dispatcher for m in model.modules()
             if isinstance(getattr(m, "dispatcher", None), LocalDispatcher)]
    factors = [d.capacity_factor for d in local]
    try:
        for d in local:
            d.capacity_factor = None
        yield
    finally:
        for d, factor in zip(local, factors, strict=True):
            d.capacity_factor = factor
