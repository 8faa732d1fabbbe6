"""The GPU path of the rowwise transport on CPU: EP ranks as threads of one process.

Every rank's slabs live in this process, so a rank's Triton put kernel (run by the
interpreter, ``TRITON_INTERPRET=1``) stores into a peer's slab through the same table
of addresses as on NVSHMEM, and a barrier is a ``threading.Barrier``. With the ``ops``
kernels switched on for CPU tensors (:func:`kernels_on_cpu`), dispatch and combine run
exactly the launches they issue on CUDA. The interpreter is not thread-safe (it patches
``triton.language`` while a kernel runs), so kernel launches take turns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from moe_ep_transport import _transport_kernels as kernels
from moe_ep_transport.ops import SlotTable
from moe_ep_transport.peer_memory import N_SLABS

_LAUNCH_LOCK = threading.Lock()


def kernels_on_cpu() -> None:
    """Run every ``ops`` Triton kernel for CPU tensors (``backend="auto"`` as on CUDA), one launch at a time."""
    import triton.runtime.interpreter as interpreter
    from moe_ep_transport import _triton_support

    _triton_support.fused_kernels_enabled = lambda device: not _triton_support.reference_kernels_enabled()
    run = interpreter.InterpretedFunction.run
    if getattr(run, "takes_turns", False):
        return

    def run_alone(self, *args, **kwargs):
        with _LAUNCH_LOCK:
            return run(self, *args, **kwargs)

    run_alone.takes_turns = True
    interpreter.InterpretedFunction.run = run_alone


class ThreadPeers:
    """The slabs of ``world_size`` ranks and their address tables (shared by the rank threads)."""

    def __init__(self, world_size: int, slab_bytes: int) -> None:
        self.world_size = world_size
        self.slab_bytes = slab_bytes
        # 16-byte aligned like NVSHMEM's (the put kernel assumes it): over-allocate and slice.
        self._raw = [[torch.zeros(slab_bytes + 16, dtype=torch.uint8) for _ in range(N_SLABS)]
                     for _ in range(world_size)]
        self.slabs = [[raw[-raw.data_ptr() % 16 :][:slab_bytes] for raw in mine] for mine in self._raw]
        self.tables = [torch.tensor([self.slabs[r][i].data_ptr() for r in range(world_size)])
                       for i in range(N_SLABS)]
        self.barrier = threading.Barrier(world_size, timeout=120)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``fn(rank)`` on one thread per rank; the results by rank (a rank's error is raised)."""
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def main(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


class ThreadPeerMemory:
    """``PeerMemory`` of one rank thread: :class:`~moe_ep_transport.nvshmem_memory.NvshmemPeerMemory`'s
    calls over :class:`ThreadPeers`."""

    def __init__(self, peers: ThreadPeers, rank: int) -> None:
        self.peers = peers
        self.rank = rank
        self.world_size = peers.world_size
        self.slab_bytes = peers.slab_bytes
        self.barriers_in_kernels = False  # kernels cannot spin while launches take turns

    def slab(self, index: int) -> torch.Tensor:
        return self.peers.slabs[self.rank][index]

    def peer_table(self, index: int) -> torch.Tensor:
        return self.peers.tables[index]

    def _bulk_to(self, slab: int, bulk: bool) -> list[int] | None:
        return self.peers.tables[slab].tolist() if bulk else None

    def put_rows(self, slab: int, byte_offset: int, src_RW: torch.Tensor, dst_rank_N: torch.Tensor,
                 dst_row_N: torch.Tensor, *, bulk: bool = False, **kwargs: Any) -> None:
        kernels.put_rows(src_RW, dst_rank_N, dst_row_N, self.peers.tables[slab], byte_offset=byte_offset,
                         me=self.rank, bulk_to=self._bulk_to(slab, bulk), **kwargs)

    def put_partial_sums(self, slab: int, byte_offset: int, rows_CD: torch.Tensor, w_C: torch.Tensor | None,
                         slots: SlotTable, *, top_k: int, max_tokens: int, acc_dtype: torch.dtype,
                         bulk: bool = False) -> None:
        kernels.put_partial_sums(rows_CD, w_C, slots, self.peers.tables[slab], top_k=top_k,
                                 max_tokens=max_tokens, byte_offset=byte_offset, me=self.rank,
                                 bulk_to=self._bulk_to(slab, bulk))

    def barrier(self) -> None:
        self.peers.barrier.wait()

    def deferred_barrier(self) -> None:
        """Passed here, at once (kernels cannot spin while launches take turns); on NVSHMEM the
        next kernel passes it (no launch of its own)."""
        self.peers.barrier.wait()
