"""Device operations of dispatch and combine, each one launch on CUDA.

Every op here with a Triton path (CUDA tensors with Triton installed) has a public
PyTorch reference beside it, ``<op>_reference`` (CPU, and every device under
``use_reference_kernels``; the plan steps' are defined in ``plan_reference``), computing
the same values bit for bit: integer planning, row moves, and FP32 products then sums,
slot by slot, without fused multiply-add. Each op takes ``backend``: ``"auto"`` (the
kernel where ``fused_kernels_enabled``), ``"triton"`` (the kernel, or a one-line error
where it cannot run) or ``"reference"``; the reference switch overrides it
(``_triton_support.resolve_backend``).
Dispatch and combine do little else between these calls and the transport's puts
and barriers, so their launch count is small and fixed (a CPU test bounds it).

Shape legend: N slots (T tokens x k), E experts, C receive rows, W words, D width.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_ep_transport._triton_support import Backend, resolve_backend
from moe_ep_transport.plan_reference import (
    CellPlan,
    SlotRanks,
    plan_cells_reference,
    plan_rows_reference,
    rank_slots_reference,
)

_constants: dict[tuple, torch.Tensor] = {}


def _constant(kind: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached read-only 1-D tensor of at least ``n`` elements, sliced to ``n`` (no launch per call)."""
    key = (kind, dtype, device)
    have = _constants.get(key)
    if have is None or have.numel() < n:
        size = max(n, 2 * have.numel() if have is not None else 0)
        if kind == "range":
            have = torch.arange(size, dtype=dtype, device=device)
        else:
            have = torch.ones(size, dtype=dtype, device=device)
        _constants[key] = have
    return have[:n]


def index_range(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` (int64), shared between calls."""
    return _constant("range", n, torch.int64, device)


def ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``ones(n)``, shared between calls."""
    return _constant("ones", n, dtype, device)


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """View ``rows[R, D]`` as ``[R, W]`` 32-bit words (bytes when the row size is not a multiple of 4).

    Transports move words, whatever the payload dtype: fewer, wider memory
    operations, and one collective dtype that every backend (gloo included) supports.
    """
    rows = rows.contiguous()
    nbytes = rows.shape[1] * rows.element_size()
    word = torch.int32 if nbytes % 4 == 0 else torch.uint8
    return rows.view(torch.uint8).view(word) if rows.dtype != word else rows


def from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_words` for rows of ``dtype``."""
    return words.view(torch.uint8).view(dtype) if words.dtype != dtype else words


# --- the routing plan (definitions in plan_reference) ------------------------------


class PeerWait(NamedTuple):
    """A peer-memory barrier that the next kernel performs before it reads (one launch fewer):
    ``_transport_kernels.signal_barrier``'s arguments (``PeerMemory.deferred_barrier``):
    the two barrier counters, the flags' addresses, this rank, and the barrier's parity
    (``_kernel_parts``)."""

    epochs_2: torch.Tensor
    flag_table_M: torch.Tensor
    me: int
    parity: int


def wait_for_peers(wait: PeerWait | None) -> None:
    """The barrier of ``wait`` as a kernel of its own (for a step that runs no kernel)."""
    if wait is not None:
        from moe_ep_transport import _transport_kernels as kernels

        kernels.signal_barrier(*wait)


def rank_slots(expert_N: torch.Tensor, n_experts: int, backend: Backend = "auto") -> SlotRanks:
    """Per-block expert counts and ranks of the slots (plan step 1; :func:`rank_slots_reference`).

    The rowwise transport's ``plan_routes`` folds the count exchange's put into the block
    scan, and where its memory passes barriers in kernels, the exchange's barrier and
    step 2 too (``_plan_kernels.rank_slots_and_cells``)."""
    if resolve_backend(backend, expert_N.device):
        from moe_ep_transport import _plan_kernels as plan_kernels

        return plan_kernels.rank_slots(expert_N, n_experts)
    return rank_slots_reference(expert_N, n_experts)


def plan_cells(counts_ME: torch.Tensor, capacity: int, salt: int, rank: int,
               stats_sum_2ME: torch.Tensor | None = None, wait: PeerWait | None = None,
               backend: Backend = "auto") -> CellPlan:
    """Fair overflow allocation and receive layout from the count matrix (plan step 2;
    :func:`plan_cells_reference`); with ``stats_sum_2ME``, its stats are added to that
    running sum in the same launch (the telemetry); with ``wait``, the count exchange's
    barrier runs first, in the same launch (the reference path launches it alone)."""
    if resolve_backend(backend, counts_ME.device):
        from moe_ep_transport import _plan_kernels as plan_kernels

        return plan_kernels.plan_cells(counts_ME, capacity, salt, rank, stats_sum_2ME, wait)
    wait_for_peers(wait)
    return plan_cells_reference(counts_ME, capacity, salt, rank, stats_sum_2ME)


def plan_rows(
    expert_N: torch.Tensor, slots: SlotRanks, cells: CellPlan, ep_size: int, capacity: int,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Destination of every slot and source of every receive row (plan step 3;
    :func:`plan_rows_reference`)."""
    if resolve_backend(backend, expert_N.device):
        from moe_ep_transport import _plan_kernels as plan_kernels

        return plan_kernels.plan_rows(expert_N, slots, cells, ep_size, capacity)
    return plan_rows_reference(expert_N, slots, cells, ep_size, capacity)


# --- row movement and reduction ----------------------------------------------------


def finish_receive(
    out_CW: torch.Tensor,
    inbox_CW: torch.Tensor,
    row_src_C: torch.Tensor,
    me: int,
    origin_in_C: torch.Tensor | None = None,
    origin_out_C: torch.Tensor | None = None,
    per_src: int = 1,
    inbox_stride: int = 0,
    slot_rows_out: torch.Tensor | None = None,
    max_slots: int = 0,
    w_out_C: torch.Tensor | None = None,
    backend: Backend = "auto",
    wait: PeerWait | None = None,
) -> None:
    """Move rows from other ranks out of the symmetric inbox into ``out``; zero the padding.

    Receive row ``c`` is inbox row ``c``, or with ``inbox_stride=S > 0`` the token
    inbox's row ``row_src[c] * S + origin_in[c] // per_src`` (a deduplicating put,
    :func:`moe_ep_transport.peer_memory.inbox_targets`). With ``origin_out_C``, also
    copy the rows' origins (``origin_in_C``: packed metadata, :func:`pack_meta`; the slot
    index at the source in its low 32 bits). With ``slot_rows_out``, also write the rows
    of a :class:`SlotTable` (``N_max = max_slots``); with ``w_out_C`` (float32), each
    row's weight from the metadata's high 32 bits (zero for padding rows). ``wait``: the
    put's barrier, passed first (by the kernel; the reference path launches it alone).
    """
    needs_meta = origin_out_C is not None or inbox_stride > 0 or slot_rows_out is not None or w_out_C is not None
    if needs_meta and origin_in_C is None:
        raise ValueError("finish_receive: origin_out_C, inbox_stride, slot_rows_out and w_out_C need origin_in_C")
    if resolve_backend(backend, out_CW.device):
        from moe_ep_transport import _transport_kernels as kernels

        kernels.finish_receive(
            out_CW, inbox_CW, row_src_C, me, origin_in_C, origin_out_C, per_src, inbox_stride,
            slot_rows_out, max_slots, w_out_C, wait=wait,
        )
    else:
        wait_for_peers(wait)
        finish_receive_reference(
            out_CW, inbox_CW, row_src_C, me, origin_in_C, origin_out_C, per_src, inbox_stride,
            slot_rows_out, max_slots, w_out_C,
        )


def finish_receive_reference(
    out_CW: torch.Tensor,
    inbox_CW: torch.Tensor,
    row_src_C: torch.Tensor,
    me: int,
    origin_in_C: torch.Tensor | None = None,
    origin_out_C: torch.Tensor | None = None,
    per_src: int = 1,
    inbox_stride: int = 0,
    slot_rows_out: torch.Tensor | None = None,
    max_slots: int = 0,
    w_out_C: torch.Tensor | None = None,
) -> None:
    """PyTorch version of :func:`finish_receive` (boolean indexing: synchronises on CUDA)."""
    if origin_in_C is not None:
        meta_C, origin_in_C = origin_in_C, unpack_meta(origin_in_C)[0]
    remote = (row_src_C != me) & (row_src_C >= 0)
    if inbox_stride > 0:
        at = row_src_C[remote] * inbox_stride + origin_in_C[remote] // per_src
        out_CW[remote] = inbox_CW[at]
    else:
        out_CW[remote] = inbox_CW[remote]
    out_CW[row_src_C < 0] = 0
    if origin_out_C is not None:
        origin_out_C.copy_(origin_in_C)
    if slot_rows_out is not None:
        sent = row_src_C >= 0
        rows = index_range(row_src_C.numel(), row_src_C.device)
        slot_rows_out[row_src_C[sent] * max_slots + origin_in_C[sent]] = rows[sent]
    if w_out_C is not None:
        w_out_C.copy_(torch.where(row_src_C >= 0, unpack_meta(meta_C)[1], 0))


def copy_rows(src_RW: torch.Tensor, wait: PeerWait | None = None, backend: Backend = "auto") -> torch.Tensor:
    """A copy of ``src_RW`` (rows a put wrote into a slab, which the next phase reuses), read
    after ``wait``'s barrier (passed by the copy's kernel; the reference path launches it alone)."""
    if resolve_backend(backend, src_RW.device):
        from moe_ep_transport import _transport_kernels as kernels

        return kernels.copy_rows(src_RW, wait)
    wait_for_peers(wait)
    return src_RW.clone()


def pack_meta(index_N: torch.Tensor, w_N: torch.Tensor) -> torch.Tensor:
    """A slot's metadata with its weight: ``index | (float32 bits of w) << 32`` (int64).

    Slot indices are below 2^31, so the low half holds the index and the high half the
    weight's bits; the put kernel packs the same way (``put_rows(meta_w_N=...)``).
    """
    w_bits = w_N.to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    return (index_N & 0xFFFFFFFF) | (w_bits << 32)


def unpack_meta(meta_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index_N, w_N)`` of :func:`pack_meta` (the weight is whatever the high bits hold)."""
    return meta_N & 0xFFFFFFFF, (meta_N >> 32).to(torch.int32).view(torch.float32)


def topk_gather_sum(
    inbox_ND: torch.Tensor,
    local_CD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    me: int,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
    backend: Backend = "auto",
    wait: PeerWait | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weighted top-k sum per token of the rows that came back, in ``w_N``'s dtype.

    Slot ``i = t*k + j`` reads ``local[dst_row[i]]`` if ``dst_rank[i] == me`` (its row
    never left this rank), ``inbox[i]`` if it went to another rank, and zeros with
    weight zero if it was dropped (``dst_rank[i] < 0``, whatever ``w[i]`` holds).
    ``y[t] = ((0 + x_0 w_0) + x_1 w_1) + ...``, cast to ``out_dtype``. With
    ``store_rows`` the gathered rows ``[N, D]`` are returned too (for the gradient of
    the weights). ``wait``: the return's barrier, passed first (as in :func:`finish_receive`).
    """
    if resolve_backend(backend, local_CD.device):
        from moe_ep_transport import _transport_kernels as kernels

        return kernels.topk_gather_sum(
            inbox_ND, local_CD, dst_rank_N, dst_row_N, me, w_N, top_k, out_dtype, store_rows, wait=wait
        )
    wait_for_peers(wait)
    return topk_gather_sum_reference(
        inbox_ND, local_CD, dst_rank_N, dst_row_N, me, w_N, top_k, out_dtype, store_rows
    )


def topk_gather_sum_reference(
    inbox_ND: torch.Tensor,
    local_CD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    me: int,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch version of :func:`topk_gather_sum` (boolean indexing: synchronises on CUDA)."""
    n, width = dst_rank_N.numel(), local_CD.shape[1]
    x_ND = local_CD.new_zeros(n, width)
    local = dst_rank_N == me
    remote = (dst_rank_N >= 0) & ~local
    x_ND[local] = local_CD[dst_row_N[local]]
    x_ND[remote] = inbox_ND[:n][remote]
    T = n // top_k
    x_TkD = x_ND.view(T, top_k, width)
    weights_Tk = torch.where(dst_rank_N >= 0, w_N, 0).view(T, top_k)
    acc = torch.zeros(T, width, dtype=w_N.dtype, device=local_CD.device)
    for j in range(top_k):
        acc = acc + x_TkD[:, j].to(w_N.dtype) * weights_Tk[:, j, None]
    return acc.to(out_dtype), (x_ND if store_rows else None)


def combine_grads(
    g_TD: torch.Tensor,
    w_N: torch.Tensor,
    rows_ND: torch.Tensor | None,
    rows_dtype: torch.dtype,
    scaled: bool,
    bound: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Combine's backward on this rank: the gradient rows to send back and the weights' gradient.

    Slot ``i = t*k + j``: ``scaled[i] = (w[i] * g[t]).to(rows_dtype)`` (``scaled``) and
    ``grad_w[i] = sum_d rows[i, d] * g[t, d]`` (when ``rows_ND`` is given), both in
    ``w``'s dtype, ``g`` converted to it first. One launch on CUDA (the sum's order
    differs from the reference's, within rounding). ``bound`` (a one-element integer
    device tensor): tokens at or past it are padding whose outputs are unspecified; the
    kernel skips them (a receive buffer sized for the worst case costs what it holds).
    The kernel takes a power-of-two ``k`` (``backend="auto"`` takes the reference for
    another; ``"triton"`` refuses it) and no tokens at all.
    """
    k = w_N.numel() // max(1, g_TD.shape[0])
    if resolve_backend(backend, g_TD.device):
        if g_TD.shape[0] == 0 or (k > 0 and k & (k - 1) == 0):  # no tokens: no launch
            from moe_ep_transport import _transport_kernels as kernels

            return kernels.combine_grads(g_TD, w_N, rows_ND, rows_dtype, scaled, bound)
        if backend == "triton":
            raise ValueError(f"combine_grads(backend='triton') needs a power-of-two top-k, got {k}")
    return combine_grads_reference(g_TD, w_N, rows_ND, rows_dtype, scaled)


def combine_grads_reference(
    g_TD: torch.Tensor,
    w_N: torch.Tensor,
    rows_ND: torch.Tensor | None,
    rows_dtype: torch.dtype,
    scaled: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """PyTorch version of :func:`combine_grads`."""
    T, D = g_TD.shape
    k = w_N.numel() // max(1, T)
    g_TD = g_TD.to(w_N.dtype)
    scaled_ND = grad_w_N = None
    if scaled:
        scaled_ND = (g_TD.unsqueeze(1) * w_N.view(T, k, 1)).to(rows_dtype).view(T * k, D)
    if rows_ND is not None:
        grad_w_N = torch.einsum("tkd,td->tk", rows_ND.view(T, k, D).to(w_N.dtype), g_TD).reshape(-1)
    return scaled_ND, grad_w_N


# --- summing at the destination (EPConfig.combine) ---------------------------------


class SlotTable(NamedTuple):
    """The inverse of the receive layout: which receive row here holds source ``s``'s slot ``i``.

    ``rows_S[s * N_max + i]`` names a receive row ``c``; the entry is valid only if
    ``row_src_C[c] == s`` and ``origin_C[c] == i`` (readers check), so the table needs
    no fill: the receive kernel writes every valid entry and whatever else is there
    is ignored. A token's rows here are the entries ``s * N_max + t * k + j``.
    """

    rows_S: torch.Tensor  # int64 [M * N_max]
    row_src_C: torch.Tensor  # int64 [C]: source rank of each receive row, -1 for padding
    origin_C: torch.Tensor  # int64 [C]: slot index of each receive row at its source
    max_slots: int  # N_max = T_max * k: entries per source


def slot_table(row_src_C: torch.Tensor, origin_C: torch.Tensor, n_ranks: int, max_slots: int) -> SlotTable:
    """Build a :class:`SlotTable` with PyTorch ops (entries without a row hold -1).

    The rowwise transport gets its table from the receive kernel instead
    (:func:`finish_receive` with ``slot_rows_out``), without a launch of its own.
    """
    dump = n_ranks * max_slots  # padding rows write one past the end
    table = torch.full((dump + 1,), -1, dtype=torch.int64, device=row_src_C.device)
    at = torch.where(row_src_C >= 0, row_src_C * max_slots + origin_C, dump)
    table.index_copy_(0, at, index_range(row_src_C.numel(), row_src_C.device))
    return SlotTable(table[:dump], row_src_C, origin_C, max_slots)


def slot_rows_valid(slots: SlotTable, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_QK, valid_QK)``: each (source, token)'s receive row per slot, and which exist."""
    C = slots.row_src_C.numel()
    rows_QK = slots.rows_S.view(-1, top_k)
    Q, T_max = rows_QK.shape[0], slots.max_slots // top_k
    at_QK = rows_QK.clamp(0, max(C - 1, 0))
    if C == 0:
        return at_QK, torch.zeros_like(rows_QK, dtype=torch.bool)
    q = index_range(Q, rows_QK.device).view(Q, 1)
    slot_QK = (q % T_max) * top_k + index_range(top_k, rows_QK.device)
    valid = (rows_QK >= 0) & (rows_QK < C)
    valid &= (slots.row_src_C[at_QK] == q // T_max) & (slots.origin_C[at_QK] == slot_QK)
    return at_QK, valid


def partial_sums_reference(
    rows_CD: torch.Tensor,
    w_C: torch.Tensor | None,
    slots: SlotTable,
    top_k: int,
    acc_dtype: torch.dtype,
) -> torch.Tensor:
    """Each (source, token)'s contributions here: ``[M * T_max, D]`` in ``acc_dtype``.

    Row ``q = s * T_max + t`` is ``((0 + x_0 w_0) + x_1 w_1) + ...`` over the token's
    slots ``j`` with a row here, in slot order, products and sums rounded separately;
    ``w_C=None`` means unit weights. Zero where the token has no row here. The
    rowwise transport's put kernel computes the same rows and stores them straight
    into the sources (``PeerMemory.put_partial_sums``).
    """
    at_QK, valid_QK = slot_rows_valid(slots, top_k)
    acc = torch.zeros(at_QK.shape[0], rows_CD.shape[1], dtype=acc_dtype, device=rows_CD.device)
    for j in range(top_k):
        x = torch.where(valid_QK[:, j, None], rows_CD[at_QK[:, j]].to(acc_dtype), 0)
        w = w_C[at_QK[:, j]] if w_C is not None else torch.ones((), dtype=acc_dtype, device=acc.device)
        acc = acc + x * torch.where(valid_QK[:, j], w, 0)[:, None]
    return acc


def sum_partials(
    partials_QD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    n_ranks: int,
    max_tokens: int,
    top_k: int,
    out_dtype: torch.dtype,
    backend: Backend = "auto",
    wait: PeerWait | None = None,
) -> torch.Tensor:
    """``y[t] = ((0 + P_0[t]) + P_1[t]) + ...`` over the ranks holding any of token ``t``'s rows.

    ``partials_QD`` row ``r * T_max + t`` is rank ``r``'s partial for this rank's token
    ``t``; a rank none of the token's kept slots went to contributes nothing (its row
    is not read). Rank order, products none: the same on every backend. ``wait``: the
    partials' barrier, passed first (as in :func:`finish_receive`).
    """
    if resolve_backend(backend, partials_QD.device):
        from moe_ep_transport import _transport_kernels as kernels

        return kernels.sum_partials(partials_QD, dst_rank_N, n_ranks, max_tokens, top_k, out_dtype, wait=wait)
    wait_for_peers(wait)
    return sum_partials_reference(partials_QD, dst_rank_N, n_ranks, max_tokens, top_k, out_dtype)


def sum_partials_reference(
    partials_QD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    n_ranks: int,
    max_tokens: int,
    top_k: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """PyTorch version of :func:`sum_partials`."""
    T = dst_rank_N.numel() // top_k
    ranks_Tk = dst_rank_N.view(T, top_k)
    acc = torch.zeros(T, partials_QD.shape[1], dtype=partials_QD.dtype, device=partials_QD.device)
    for r in range(n_ranks):
        present = (ranks_Tk == r).any(1, keepdim=True)
        acc = acc + torch.where(present, partials_QD[r * max_tokens : r * max_tokens + T], 0)
    return acc.to(out_dtype)
