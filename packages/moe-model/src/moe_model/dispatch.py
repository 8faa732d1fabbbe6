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

The local dispatcher's capacity policy (``capacity_factor`` set): each expert keeps
at most ``C = ceil(capacity_factor * T * k / E)`` rows. Within an expert, slots are
ranked by (choice rank ``j``, then a fixed bijective hash of the token index): a
token's first choice beats anyone's second choice, and among equals the order is a
position-independent scramble. Nothing favours low expert ids or early tokens, and
the outcome is deterministic (activation recompute reproduces it exactly).

Fused combine on CUDA: the combine forward and backward and the dispatch gather's
backward run as Triton kernels (``_combine_kernels``) that touch each byte once:
the forward reads each token's ``k`` rows once (``T*k*D`` elements) and writes
``y`` once (``T*D``), accumulating in FP32 registers; the backward reads ``rows_out``
and ``dy`` once and writes ``d_rows`` once, with the routing-weight gradients reduced
in the same pass. No ``[T*k, D]`` FP32 (or gathered ``[T, k, D]``) tensor is
materialised, and nothing uses atomics, so results are deterministic. Elsewhere
(CPU, FP64, no Triton) the plain torch code below runs; it is the exact reference
the layout-equivalence tests compare bit for bit. Triton is imported lazily.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from moe_model._triton_support import triton_available
from moe_model.router import count_per_expert

_HASH_MULTIPLIER = 2654435761  # odd, so t -> t * m mod 2^32 is a bijection (Knuth)


@runtime_checkable
class TokenDispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, rows_out: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor: ...


@runtime_checkable
class ReportsDrops(Protocol):
    def dropped_per_expert(self, handle: Any) -> torch.Tensor:
        """[E] int64: routed slots of this dispatch that no expert processed."""
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


class _Gather(torch.autograd.Function):
    """``rows[r] = x[token_of_row[r]]`` (padding rows zero). The backward sums each
    token's ``k`` row gradients by gathering them, without atomics, so it is
    deterministic (an ``index_select`` backward would scatter-add)."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, h: LocalDispatchHandle) -> torch.Tensor:
        ctx.handle = h
        rows_RD = x_TD.index_select(0, h.token_of_row)
        if h.valid_rows is not None:
            rows_RD = torch.where(h.valid_rows[:, None], rows_RD, 0)
        return rows_RD

    @staticmethod
    def backward(ctx: Any, d_rows_RD: torch.Tensor) -> tuple[torch.Tensor, None]:
        h: LocalDispatchHandle = ctx.handle
        if _fused(d_rows_RD):
            return weighted_gather_sum(d_rows_RD, h.row_of_slot, h.n_tokens, None, h.kept_of_slot), None
        d_slots = d_rows_RD.index_select(0, h.row_of_slot).view(h.n_tokens, -1, d_rows_RD.shape[1])
        if h.kept_of_slot is not None:
            d_slots = d_slots * h.kept_of_slot.view(h.n_tokens, -1, 1).to(d_slots.dtype)
        return d_slots.sum(1), None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# ------------------------------------------------------------ fused (Triton) combine
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# GPU tiles: elements per program tile (tokens x D, times the padded k in the
# backward) and the widest D block; CPU runs are the Triton interpreter (tests),
# where small blocks exercise the tails.
_GPU_BLOCK_D = 256
_GPU_GATHER_TILE = 2048
_GPU_BACKWARD_TILE = 4096
_GPU_NUM_WARPS = 4
_CPU_BLOCK_T, _CPU_BLOCK_D = 4, 16


def _fused(t: torch.Tensor) -> bool:
    """Whether the combine of rows like ``t`` runs the fused Triton kernels."""
    return t.device.type == "cuda" and t.dtype in _FUSED_DTYPES and triton_available()


def _kernels():  # noqa: ANN202 - the Triton module and its jitted kernels
    import triton

    from moe_model import _combine_kernels as k

    return triton, k.weighted_gather_sum_kernel, k.combine_backward_kernel


def _blocks(device: torch.device, T: int, D: int, tile: int, triton: Any) -> tuple[int, int]:
    """(tokens, D columns) per program: ``tokens * columns`` about ``tile`` on a GPU."""
    if device.type != "cuda":
        return _CPU_BLOCK_T, _CPU_BLOCK_D
    block_d = min(_GPU_BLOCK_D, triton.next_power_of_2(max(D, 1)))
    block_t = max(1, min(tile // block_d, triton.next_power_of_2(max(T, 1))))
    return block_t, block_d


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (row strides are passed to the kernels)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def weighted_gather_sum(
    rows_RD: torch.Tensor, row_of_slot_S: torch.Tensor, n_tokens: int,
    weights: torch.Tensor | None = None, kept_S: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * kept[t,j] * rows[row_of_slot[t*k+j]]`` (Triton; FP32 accumulation).

    ``weights`` (``[T,k]`` or ``[T*k]``, FP32) and ``kept_S`` (``[T*k]`` FP32, 1 kept /
    0 dropped; dropped slots' rows are not read) default to ones. Returns ``[T, D]``
    in ``out_dtype`` (default: ``rows_RD``'s dtype). One program per (token block,
    D block): it reads its tokens' ``k`` rows once and writes ``y`` once.
    """
    T, D = n_tokens, rows_RD.shape[1]
    k = row_of_slot_S.shape[0] // max(T, 1)
    y_TD = torch.empty(T, D, dtype=out_dtype or rows_RD.dtype, device=rows_RD.device)
    if T == 0 or D == 0:
        return y_TD
    if k == 0:
        return y_TD.zero_()
    rows_RD = _row_major(rows_RD)
    triton, gather_kernel, _ = _kernels()
    block_t, block_d = _blocks(rows_RD.device, T, D, _GPU_GATHER_TILE, triton)
    row_of_slot_S = row_of_slot_S.contiguous()
    w_S = weights.reshape(-1).contiguous() if weights is not None else None
    kept_S = kept_S.contiguous() if kept_S is not None else None
    grid = (triton.cdiv(T, block_t), triton.cdiv(D, block_d))
    gather_kernel[grid](
        rows_RD, row_of_slot_S, w_S if w_S is not None else row_of_slot_S,
        kept_S if kept_S is not None else row_of_slot_S, y_TD,
        T, D, rows_RD.stride(0), y_TD.stride(0),
        K=k, HAS_W=w_S is not None, HAS_KEPT=kept_S is not None,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=_GPU_NUM_WARPS,
    )
    return y_TD


def combine_backward(
    dy_TD: torch.Tensor, rows_out_RD: torch.Tensor, row_of_slot_S: torch.Tensor,
    w_S: torch.Tensor, kept_S: torch.Tensor | None, n_rows: int, zero_fill: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``y[t] = sum_j w_S[t*k+j] * rows_out[row_of_slot[t*k+j]]`` (Triton).

    ``w_S`` are the FP32 slot weights already multiplied by ``kept_S``. Returns
    ``d_rows[n_rows, D]`` in ``rows_out``'s dtype, ``d_rows[row_of_slot[s]] = w_S[s] *
    dy[t(s)]`` for kept slots (each row is written by at most one kept slot) and zero
    for rows no kept slot writes when ``zero_fill`` (default: ``kept_S is not None``;
    in dropless mode every row is written), and ``d_w[T, k]`` FP32, ``d_w[t,j] =
    kept * dot(rows_out[row_of_slot[t*k+j]], dy[t])``. One program per token block
    walks all of D: it reads ``rows_out`` and ``dy`` once and writes ``d_rows`` once.
    """
    T, D = dy_TD.shape
    k = w_S.shape[0] // max(T, 1)
    if zero_fill is None:
        zero_fill = kept_S is not None
    alloc = torch.zeros if zero_fill else torch.empty
    d_rows_RD = alloc(n_rows, D, dtype=rows_out_RD.dtype, device=rows_out_RD.device)
    d_w_Tk = torch.empty(T, k, dtype=torch.float32, device=rows_out_RD.device)
    if T == 0 or k == 0:
        return d_rows_RD, d_w_Tk
    if D == 0:
        return d_rows_RD, d_w_Tk.zero_()
    dy_TD, rows_out_RD = _row_major(dy_TD), _row_major(rows_out_RD)
    row_of_slot_S, w_S = row_of_slot_S.contiguous(), w_S.contiguous()
    kept_S = kept_S.contiguous() if kept_S is not None else None
    triton, _, backward_kernel = _kernels()
    k_block = triton.next_power_of_2(k)
    block_t, block_d = _blocks(rows_out_RD.device, T, D, _GPU_BACKWARD_TILE // k_block, triton)
    backward_kernel[(triton.cdiv(T, block_t),)](
        dy_TD, rows_out_RD, row_of_slot_S, w_S, kept_S if kept_S is not None else w_S,
        d_rows_RD, d_w_Tk,
        T, D, dy_TD.stride(0), rows_out_RD.stride(0), d_rows_RD.stride(0),
        K=k, K_BLOCK=k_block, HAS_KEPT=kept_S is not None,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=_GPU_NUM_WARPS,
    )
    return d_rows_RD, d_w_Tk


class _Combine(torch.autograd.Function):
    """``y[t] = sum_j w[t,j] * rows_out[row_of_slot[t,j]]`` in (at least) FP32; saves only
    ``rows_out`` and the (kept-masked) slot weights."""

    @staticmethod
    def forward(ctx: Any, rows_out_RD: torch.Tensor, weights_Tk: torch.Tensor,
                h: LocalDispatchHandle) -> torch.Tensor:
        T, k = weights_Tk.shape
        acc = _accumulation_dtype(rows_out_RD.dtype)
        w_S = weights_Tk.reshape(-1).to(acc)
        if h.kept_of_slot is not None:
            w_S = w_S * h.kept_of_slot.to(acc)
        ctx.save_for_backward(rows_out_RD, w_S)
        ctx.handle, ctx.weights_dtype = h, weights_Tk.dtype
        if _fused(rows_out_RD):
            return weighted_gather_sum(rows_out_RD, h.row_of_slot, T, w_S, h.kept_of_slot)
        g_TkD = rows_out_RD.index_select(0, h.row_of_slot).view(T, k, -1)
        y_TD = torch.bmm(w_S.view(T, 1, k), g_TkD.to(acc)).view(T, -1)
        return y_TD.to(rows_out_RD.dtype)

    @staticmethod
    def backward(ctx: Any, dy_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        rows_out_RD, w_S = ctx.saved_tensors
        h: LocalDispatchHandle = ctx.handle
        T, D = dy_TD.shape
        k = w_S.shape[0] // T
        if _fused(rows_out_RD):
            d_rows, d_w_Tk = combine_backward(
                dy_TD, rows_out_RD, h.row_of_slot, w_S, h.kept_of_slot, rows_out_RD.shape[0],
                zero_fill=h.kept_of_slot is not None or h.valid_rows is not None)
            return d_rows, d_w_Tk.to(ctx.weights_dtype), None
        dy32_TD = dy_TD.to(w_S.dtype)
        d_rows = dy32_TD.index_select(0, h.token_of_row) * w_S.index_select(0, h.slot_of_row)[:, None]
        if h.valid_rows is not None:
            d_rows = torch.where(h.valid_rows[:, None], d_rows, 0.0)
        g_TkD = rows_out_RD.index_select(0, h.row_of_slot).view(T, k, D)
        d_w_Tk = torch.bmm(g_TkD.to(w_S.dtype), dy32_TD.unsqueeze(-1)).view(T, k)
        if h.kept_of_slot is not None:
            d_w_Tk = d_w_Tk * h.kept_of_slot.view(T, k).to(w_S.dtype)
        return d_rows.to(rows_out_RD.dtype), d_w_Tk.to(ctx.weights_dtype), None


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
        self, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, LocalDispatchHandle]:
        T, k = expert_ids_Tk.shape
        S, E, dev = T * k, self.n_experts, x_TD.device
        e_S = expert_ids_Tk.reshape(-1)
        counts_E = count_per_expert(e_S, E)
        slots_S = torch.arange(S, device=dev)
        if self.capacity_factor is None:
            order_R = torch.argsort(e_S, stable=True)  # row r holds slot order_R[r]
            row_of_slot = torch.empty_like(order_R).scatter_(0, order_R, slots_S)
            handle = LocalDispatchHandle(
                token_of_row=order_R // k, slot_of_row=order_R, row_of_slot=row_of_slot,
                kept_of_slot=None, valid_rows=None, dropped_per_expert=torch.zeros_like(counts_E),
                n_tokens=T,
            )
            return _Gather.apply(x_TD, handle), counts_E.cumsum(0).to(torch.int32), handle

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
        return _Gather.apply(x_TD, handle), group_offsets.to(torch.int32), handle

    def combine(
        self, rows_out_RD: torch.Tensor, weights_Tk: torch.Tensor, handle: LocalDispatchHandle
    ) -> torch.Tensor:
        return _Combine.apply(rows_out_RD, weights_Tk, handle)

    def dropped_per_expert(self, handle: LocalDispatchHandle) -> torch.Tensor:
        return handle.dropped_per_expert
