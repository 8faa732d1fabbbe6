"""Peer memory: symmetric buffers that every rank of a group can write into.

The rowwise transport is written against this small interface so that its
algorithm (count exchange, destination planning, puts, capacity handling) runs
unchanged on CPU: :class:`EmulatedPeerMemory` emulates one-sided puts with
all-gathers over gloo, :class:`~moe_ep_transport.nvshmem_memory.NvshmemPeerMemory`
does them with a Triton kernel that stores straight into peers' NVSHMEM buffers.

Each rank holds two *slabs* (byte buffers of the same size on every rank). A
transport uses one slab per communication phase, alternating, so that a phase
never writes into a buffer that a peer may still be reading from the previous
phase (the barrier between the two phases orders it).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from moe_ep_transport.ops import PeerWait, SlotTable

N_SLABS = 2


class PeerMemory(Protocol):
    rank: int
    world_size: int
    slab_bytes: int
    # Whether :meth:`deferred_barrier` hands its barrier to the next kernel (which may then
    # also put before it, in the same launch) rather than passing it at once on the host.
    barriers_in_kernels: bool

    def slab(self, index: int) -> torch.Tensor:
        """This rank's slab ``index`` (uint8 ``[slab_bytes]``)."""
        ...

    def peer_table(self, index: int) -> torch.Tensor | None:
        """int64 addresses of every rank's slab ``index``, through which a kernel stores into
        peers (on the device), or None where peers are not reachable by address."""
        ...

    def put_rows(
        self,
        slab: int,
        byte_offset: int,
        src_RW: torch.Tensor,
        dst_rank_N: torch.Tensor,
        dst_row_N: torch.Tensor,
        *,
        per_src: int = 1,
        local_dst: torch.Tensor | None = None,
        skip_local: bool = False,
        meta_N: torch.Tensor | None = None,
        inbox_stride: int = 0,
        meta_w_N: torch.Tensor | None = None,
        clear_N: torch.Tensor | None = None,
        bulk: bool = False,
    ) -> None:
        """Write ``src[i // per_src]`` into row ``dst_row[i]`` of rank ``dst_rank[i]``'s slab.

        Rows start at ``byte_offset`` and have ``src``'s dtype and width. Slots with
        ``dst_rank < 0`` are skipped. Rows for this rank go to ``local_dst`` instead
        when given, or are skipped with ``skip_local``. ``meta_N`` (int64) is written
        at the slab's start, at row ``dst_row[i]``; with ``meta_w_N`` (float32) it is
        ``ops.pack_meta(meta_N, meta_w_N)`` (the slot's weight travels with its index).
        With ``inbox_stride=S > 0`` rows for other ranks travel once per source row
        instead (see :func:`inbox_targets`); with ``bulk`` too, every source row lands in
        every other rank's inbox, needed there or not (:func:`inbox_blocks`: one block per
        rank, which a GPU's copy engines move without SMs).
        With ``clear_N``, this rank's own rows ``i`` from ``byte_offset`` are zeroed
        where ``clear_N[i] < 0`` (rows no put writes; same launch).
        Collective: every rank calls it; completion is only guaranteed after
        :meth:`barrier`. One kernel launch on the GPU.
        """
        ...

    def put_partial_sums(
        self,
        slab: int,
        byte_offset: int,
        rows_CD: torch.Tensor,
        w_C: torch.Tensor | None,
        slots: SlotTable,
        *,
        top_k: int,
        max_tokens: int,
        acc_dtype: torch.dtype,
        bulk: bool = False,
    ) -> None:
        """Sum each (source ``s``, token ``t``)'s rows here and write the partial into ``s``.

        The partial (:func:`moe_ep_transport.ops.partial_sums_reference`, rows of
        ``acc_dtype``) lands at row ``rank * max_tokens + t`` of ``s``'s slab from
        ``byte_offset``; tokens without a row here write nothing, or with ``bulk`` rows
        whose content is unspecified (``s``'s ``max_tokens`` rows move as one block, which
        a GPU's copy engines move without SMs). Collective like :meth:`put_rows`; one kernel
        launch on the GPU (FP32 only there), and with ``bulk`` one copy per other rank.
        """
        ...

    def barrier(self) -> None:
        """Stream-ordered barrier: every rank's earlier puts are visible after it."""
        ...

    def deferred_barrier(self) -> PeerWait | None:
        """A :meth:`barrier` that the caller's next kernel performs before it reads (pass it as
        that op's ``wait``: one launch fewer), or None where the barrier is already passed."""
        ...


def inbox_targets(
    dst_rank_N: torch.Tensor, dst_row_N: torch.Tensor, per_src: int, me: int, inbox_stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the rows of a deduplicating put go: ``(rank_N, row_N)``, rank -1 = not stored.

    Slots ``i`` come in groups of ``per_src`` that carry the same source row ``i //
    per_src`` (a token's top-k copies). A row bound for another rank ``r`` is stored
    once, by the group's first slot bound to ``r``, at row ``me * inbox_stride + i //
    per_src`` of ``r``'s slab (rank ``me``'s part of ``r``'s token inbox); ``r`` then
    finds it from the slot index in the metadata. Rows for this rank keep
    ``dst_row``. On two ranks with top-8 this moves about a quarter of the bytes of one
    row per slot.
    """
    n = dst_rank_N.numel()
    ranks_GK = dst_rank_N.view(n // per_src, per_src)
    earlier_KK = torch.ones(per_src, per_src, dtype=torch.bool, device=dst_rank_N.device).tril(-1)
    repeat_N = ((ranks_GK[:, :, None] == ranks_GK[:, None, :]) & earlier_KK).any(2).view(n)
    remote_N = (dst_rank_N >= 0) & (dst_rank_N != me)
    slot_N = torch.arange(n, device=dst_rank_N.device)
    rank_N = torch.where(remote_N & repeat_N, -1, dst_rank_N)
    row_N = torch.where(remote_N, me * inbox_stride + slot_N // per_src, dst_row_N)
    return rank_N, row_N


def inbox_blocks(
    dst_rank_N: torch.Tensor, dst_row_N: torch.Tensor, per_src: int, me: int, inbox_stride: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the rows of a bulk token inbox put go: ``(rank_B, row_B, src_row_B)``.

    Every source row ``j`` lands at row ``me * inbox_stride + j`` of every other rank,
    needed there or not (one contiguous block per rank); slots bound for this rank keep
    their ``dst_row`` as in :func:`inbox_targets`.
    """
    device = dst_rank_N.device
    n_src = dst_rank_N.numel() // per_src
    others = torch.tensor([r for r in range(world_size) if r != me], dtype=torch.int64, device=device)
    j = torch.arange(n_src, device=device)
    local_N = dst_rank_N == me
    local_slots = local_N.nonzero().view(-1)
    rank_B = torch.cat([others.repeat_interleave(n_src), dst_rank_N[local_slots]])
    row_B = torch.cat([(me * inbox_stride + j).repeat(others.numel()), dst_row_N[local_slots]])
    src_row_B = torch.cat([j.repeat(others.numel()), local_slots // per_src])
    return rank_B, row_B, src_row_B


def slab_view(slab: torch.Tensor, byte_offset: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rows ``[*, width]`` of ``dtype`` starting ``byte_offset`` bytes into a slab."""
    row_bytes = width * dtype.itemsize
    n_rows = (slab.numel() - byte_offset) // row_bytes
    return slab[byte_offset : byte_offset + n_rows * row_bytes].view(dtype).view(n_rows, width)


class EmulatedPeerMemory:
    """Peer memory emulated with all-gathers (any backend; meant for CPU tests).

    Every put gathers all ranks' rows and addresses and each rank applies the ones
    addressed to it, which is the outcome of one-sided puts followed by a barrier.
    """

    def __init__(self, slab_bytes: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.slab_bytes = slab_bytes
        self.barriers_in_kernels = False
        self._slabs = [torch.zeros(slab_bytes, dtype=torch.uint8, device=device) for _ in range(N_SLABS)]

    def slab(self, index: int) -> torch.Tensor:
        return self._slabs[index]

    def peer_table(self, index: int) -> None:
        """Other processes' slabs have no address here."""
        return None

    def _all_gather(self, t: torch.Tensor, n_max: int) -> list[torch.Tensor]:
        padded = t.new_zeros((n_max, *t.shape[1:]))
        padded[: t.shape[0]] = t
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return parts

    def put_rows(
        self,
        slab: int,
        byte_offset: int,
        src_RW: torch.Tensor,
        dst_rank_N: torch.Tensor,
        dst_row_N: torch.Tensor,
        *,
        per_src: int = 1,
        local_dst: torch.Tensor | None = None,
        skip_local: bool = False,
        meta_N: torch.Tensor | None = None,
        inbox_stride: int = 0,
        meta_w_N: torch.Tensor | None = None,
        clear_N: torch.Tensor | None = None,
        bulk: bool = False,
    ) -> None:
        if local_dst is not None and skip_local:
            raise ValueError("put_rows: local_dst and skip_local exclude each other")
        def deliver(rank_N: torch.Tensor, row_N: torch.Tensor, value_N: torch.Tensor, target) -> None:
            """Every rank's ``value[i]`` with ``rank[i] == me`` lands at ``target(source)[row[i]]``."""
            n = torch.tensor([rank_N.numel()], device=rank_N.device)
            sizes = [torch.empty_like(n) for _ in range(self.world_size)]
            dist.all_gather(sizes, n, group=self.group)
            n_max = max(int(size) for size in sizes)
            ranks, rows = self._all_gather(rank_N, n_max), self._all_gather(row_N, n_max)
            values = self._all_gather(value_N, n_max)
            for s in range(self.world_size):
                if skip_local and s == self.rank:
                    continue
                mine = ranks[s][: int(sizes[s])] == self.rank  # padding entries are never delivered
                target(s)[rows[s][: int(sizes[s])][mine]] = values[s][: int(sizes[s])][mine]

        if bulk and inbox_stride <= 0:
            raise ValueError("put_rows: bulk moves token inbox blocks: it needs inbox_stride > 0")
        row_rank_N, row_at_N = dst_rank_N, dst_row_N
        src_N = torch.arange(dst_rank_N.numel(), device=src_RW.device) // per_src
        if bulk:
            row_rank_N, row_at_N, src_N = inbox_blocks(dst_rank_N, dst_row_N, per_src, self.rank, inbox_stride,
                                                       self.world_size)
        elif inbox_stride > 0:
            row_rank_N, row_at_N = inbox_targets(dst_rank_N, dst_row_N, per_src, self.rank, inbox_stride)
        inbox = slab_view(self._slabs[slab], byte_offset, src_RW.dtype, src_RW.shape[1])
        deliver(row_rank_N, row_at_N, src_RW.index_select(0, src_N),
                lambda s: local_dst if (s == self.rank and local_dst is not None) else inbox)
        if meta_N is not None:
            if meta_w_N is not None:
                from moe_ep_transport import ops

                meta_N = ops.pack_meta(meta_N, meta_w_N)
            meta_inbox = self._slabs[slab][: self.slab_bytes // 8 * 8].view(torch.int64)
            deliver(dst_rank_N, dst_row_N, meta_N, lambda s: meta_inbox)
        if clear_N is not None:
            inbox[: clear_N.numel()][clear_N < 0] = 0

    def put_partial_sums(
        self,
        slab: int,
        byte_offset: int,
        rows_CD: torch.Tensor,
        w_C: torch.Tensor | None,
        slots: SlotTable,
        *,
        top_k: int,
        max_tokens: int,
        acc_dtype: torch.dtype,
        bulk: bool = False,
    ) -> None:
        from moe_ep_transport import ops

        partials_QD = ops.partial_sums_reference(rows_CD, w_C, slots, top_k, acc_dtype)
        q = torch.arange(partials_QD.shape[0], device=rows_CD.device)
        present = ops.slot_rows_valid(slots, top_k)[1].any(1)
        if bulk:  # whole blocks to the other ranks (zeros where no row is here: unspecified)
            present = present | (q // max_tokens != self.rank)
        dst_rank_Q = torch.where(present, q // max_tokens, -1)
        dst_row_Q = self.rank * max_tokens + q % max_tokens
        self.put_rows(slab, byte_offset, ops.as_words(partials_QD), dst_rank_Q, dst_row_Q)

    def barrier(self) -> None:
        """Nothing to order: every emulated put already completed collectively."""

    def deferred_barrier(self) -> None:
        """Nothing to wait for (:meth:`barrier`)."""
        return None
