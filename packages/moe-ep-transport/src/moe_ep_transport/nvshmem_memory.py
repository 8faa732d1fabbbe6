"""Peer memory on NVSHMEM symmetric buffers (GPU, NVLink peers), bootstrapped from torch.

NVSHMEM is started once per process over the ranks of a torch process group: rank
0 of the group creates a unique id, ``broadcast_object_list`` carries it to the
others, and every rank calls ``nvshmem.core.init(..., initializer_method="uid")``
with its group rank as PE. The NVSHMEM job is therefore the EP group itself, and
``barrier_all`` is a barrier of that group. A process can join one NVSHMEM job
only: all rowwise transports of a process must share the group (they also should
share one transport: the slabs are scratch space that the MoE layers take turns on).

The symmetric heap must hold both slabs; ``NVSHMEM_SYMMETRIC_SIZE`` (NVSHMEM's own
setting) is set from the requested size before init unless the user set it.

Peers are reached by plain loads/stores through ``nvshmem_ptr`` addresses, so every
peer must be load/store reachable (same node, NVLink or PCIe P2P).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from moe_ep_transport.ops import PeerWait, SlotTable
from moe_ep_transport.peer_memory import N_SLABS

_HEAP_MARGIN = 256 << 20  # NVSHMEM's own symmetric state (barriers, teams) lives on the heap too

_job: dict[str, Any] = {}  # the process's NVSHMEM job: {"ranks": global ranks of its PEs}


class _StreamRef:
    """The ``__cuda_stream__`` protocol nvshmem4py takes, for a torch stream."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._handle = stream.cuda_stream

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self._handle)


def _nvshmem() -> Any:
    try:
        import nvshmem.core
        import nvshmem.core.interop.torch  # noqa: F401 - the torch tensor helpers
    except ImportError as e:
        raise ImportError(
            "the rowwise GPU transport needs nvshmem4py: pip install 'moe-ep-transport[nvshmem]'"
        ) from e
    return nvshmem.core


def bootstrap(group: dist.ProcessGroup | None, device: torch.device, heap_bytes: int) -> Any:
    """Start NVSHMEM over ``group`` (once per process) and return ``nvshmem.core``."""
    nvshmem = _nvshmem()
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if _job:
        if _job["ranks"] != ranks:
            raise RuntimeError(
                f"NVSHMEM already runs over ranks {_job['ranks']}; a process can join one NVSHMEM "
                f"job only, and this transport asks for ranks {ranks}"
            )
        return nvshmem
    import numpy as np
    from cuda.core import Device

    torch.cuda.set_device(device)
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap_bytes + _HEAP_MARGIN))
    rank, nranks = dist.get_rank(group), dist.get_world_size(group)
    uid = nvshmem.get_unique_id(empty=rank != 0)
    uid_bytes = np.asarray(uid._data).view(np.uint8)
    box = [uid_bytes.tobytes() if rank == 0 else None]
    dist.broadcast_object_list(box, src=ranks[0], group=group)
    uid_bytes[:] = np.frombuffer(box[0], dtype=np.uint8)
    cuda_device = Device(device.index)
    cuda_device.set_current()
    nvshmem.init(device=cuda_device, uid=uid, rank=rank, nranks=nranks, initializer_method="uid")
    _job.update(ranks=ranks)
    return nvshmem


def finalize() -> None:
    """End this process's NVSHMEM job (collective); free every transport's slabs first."""
    if _job:
        _nvshmem().finalize()
        _job.clear()


class NvshmemPeerMemory:
    """Two symmetric slabs per rank and the table of every peer's slab addresses."""

    def __init__(self, slab_bytes: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str | int | None = None) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NvshmemPeerMemory needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.slab_bytes = slab_bytes
        self.barriers_in_kernels = True
        self._nvshmem = bootstrap(group, device, N_SLABS * slab_bytes)
        interop = self._nvshmem.interop.torch
        self._slabs = [interop.tensor((slab_bytes,), dtype=torch.uint8) for _ in range(N_SLABS)]
        self._tables = [self._peer_table(slab, device) for slab in self._slabs]
        self._addresses = [table.tolist() for table in self._tables]  # for the copy engines (host side)
        # The barrier's flags: slot s of rank r's flags holds the last barrier s announced to r.
        self._flags = interop.tensor((self.world_size,), dtype=torch.int64)
        self._flags.zero_()
        self._flag_table = self._peer_table(self._flags, device)
        # The barriers' numbers by parity (_kernel_parts): the first is 1, the next is left in
        # the other counter; the host counts the barriers for their parity.
        self._epochs = torch.tensor([1, 0], dtype=torch.int64, device=device)
        self._barriers = 0
        self._host_barrier()  # no rank signals before every rank's flags are zero

    def _peer_table(self, buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
        """int64 addresses of every rank's copy of a symmetric ``buffer``."""
        interop = self._nvshmem.interop.torch
        addresses = []
        for pe in range(self.world_size):
            peer = buffer if pe == self.rank else interop.get_peer_tensor(buffer, pe)
            if peer is None or peer.data_ptr() == 0:
                raise RuntimeError(
                    f"rank {pe} of the EP group is not load/store reachable from rank "
                    f"{self.rank}: the rowwise transport needs peers on one NVLink domain"
                )
            addresses.append(peer.data_ptr())
        return torch.tensor(addresses, dtype=torch.int64, device=device)

    def _host_barrier(self) -> None:
        """NVSHMEM's barrier, waited for on the host (set-up and tear-down only)."""
        stream = torch.cuda.current_stream()
        self._nvshmem.barrier_all(stream=_StreamRef(stream))
        stream.synchronize()

    def slab(self, index: int) -> torch.Tensor:
        return self._slabs[index]

    def peer_table(self, index: int) -> torch.Tensor:
        return self._tables[index]

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
        from moe_ep_transport import _transport_kernels as kernels

        if byte_offset % 16:
            raise ValueError(f"slab offset {byte_offset} is not 16-byte aligned")
        kernels.put_rows(
            src_RW, dst_rank_N, dst_row_N, self._tables[slab], per_src=per_src,
            byte_offset=byte_offset, me=self.rank, local_dst=local_dst, skip_local=skip_local,
            meta_N=meta_N, inbox_stride=inbox_stride, meta_w_N=meta_w_N, clear_N=clear_N,
            bulk_to=self._addresses[slab] if bulk else None,
        )

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
        from moe_ep_transport import _transport_kernels as kernels

        if acc_dtype != torch.float32:
            raise ValueError(f"NVSHMEM partial sums are float32, got accumulation dtype {acc_dtype}")
        if byte_offset % 16:
            raise ValueError(f"slab offset {byte_offset} is not 16-byte aligned")
        kernels.put_partial_sums(
            rows_CD, w_C, slots, self._tables[slab], top_k=top_k, max_tokens=max_tokens,
            byte_offset=byte_offset, me=self.rank, bulk_to=self._addresses[slab] if bulk else None,
        )

    def barrier(self) -> None:
        """A flag barrier through peer pointers (one small kernel; a dispatch + combine
        passes three or four barriers, so their latency counts at small sizes)."""
        from moe_ep_transport import _transport_kernels as kernels

        kernels.signal_barrier(*self.deferred_barrier())

    def deferred_barrier(self) -> PeerWait:
        """:meth:`barrier`'s flag wait, for the next kernel to run first (``ops.PeerWait``)."""
        parity, self._barriers = self._barriers % 2, self._barriers + 1
        return PeerWait(self._epochs, self._flag_table, self.rank, parity)

    def close(self) -> None:
        """Free the slabs (collective). The memory is unusable afterwards."""
        torch.cuda.current_stream().synchronize()
        self._host_barrier()  # no peer still signals into the flags
        for buffer in (*self._slabs, self._flags):
            self._nvshmem.interop.torch.free_tensor(buffer)
        self._slabs, self._tables, self._addresses = [], [], []
