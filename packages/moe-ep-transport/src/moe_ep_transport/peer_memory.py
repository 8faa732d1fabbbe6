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

N_SLABS = 2


class PeerMemory(Protocol):
    rank: int
    world_size: int
    slab_bytes: int

    def slab(self, index: int) -> torch.Tensor:
        """This rank's slab ``index`` (uint8 ``[slab_bytes]``)."""
        ...

    def put_rows(
        self,
        slab: int,
        byte_offset: int,
        src_RW: torch.Tensor,
        src_index_N: torch.Tensor,
        dst_rank_N: torch.Tensor,
        dst_row_N: torch.Tensor,
        *,
        local_dst: torch.Tensor | None = None,
        skip_local: bool = False,
        meta_N: torch.Tensor | None = None,
    ) -> None:
        """Write ``src[src_index[i]]`` into row ``dst_row[i]`` of rank ``dst_rank[i]``'s slab.

        Rows start at ``byte_offset`` and have ``src``'s dtype and width. Slots with
        ``dst_rank < 0`` are skipped. Rows for this rank go to ``local_dst`` instead
        when given, or are skipped with ``skip_local``. ``meta_N`` (int64) is written
        at the slab's start, one per row. Collective: every rank calls it; completion
        is only guaranteed after :meth:`barrier`. One kernel launch on the GPU.
        """
        ...

    def barrier(self) -> None:
        """Stream-ordered barrier: every rank's earlier puts are visible after it."""
        ...


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
        self._slabs = [torch.zeros(slab_bytes, dtype=torch.uint8, device=device) for _ in range(N_SLABS)]

    def slab(self, index: int) -> torch.Tensor:
        return self._slabs[index]

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
        src_index_N: torch.Tensor,
        dst_rank_N: torch.Tensor,
        dst_row_N: torch.Tensor,
        *,
        local_dst: torch.Tensor | None = None,
        skip_local: bool = False,
        meta_N: torch.Tensor | None = None,
    ) -> None:
        if local_dst is not None and skip_local:
            raise ValueError("put_rows: local_dst and skip_local exclude each other")
        n = torch.tensor([dst_rank_N.numel()], device=dst_rank_N.device)
        sizes = [torch.empty_like(n) for _ in range(self.world_size)]
        dist.all_gather(sizes, n, group=self.group)
        sizes = [int(s) for s in sizes]
        n_max = max(sizes)
        # Padding slots carry rank -1 and are skipped like dropped slots.
        ranks = self._all_gather(dst_rank_N, n_max)
        for s, size in enumerate(sizes):
            ranks[s][size:] = -1
        rows = self._all_gather(dst_row_N, n_max)
        payload = self._all_gather(src_RW.index_select(0, src_index_N), n_max)
        metas = self._all_gather(meta_N, n_max) if meta_N is not None else None
        inbox = slab_view(self._slabs[slab], byte_offset, src_RW.dtype, src_RW.shape[1])
        meta_inbox = self._slabs[slab][: self.slab_bytes // 8 * 8].view(torch.int64)
        for s in range(self.world_size):
            if skip_local and s == self.rank:
                continue
            mine = ranks[s] == self.rank
            target = local_dst if (s == self.rank and local_dst is not None) else inbox
            target[rows[s][mine]] = payload[s][mine]
            if metas is not None:
                meta_inbox[rows[s][mine]] = metas[s][mine]

    def barrier(self) -> None:
        """Nothing to order: every emulated put already completed collectively."""
