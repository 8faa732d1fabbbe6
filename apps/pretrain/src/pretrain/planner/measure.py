"""Measuring what a piece of training code keeps in memory, on any device.

``LiveBytes`` is a ``TorchDispatchMode`` that sees every tensor an operator
returns. A storage that is none of the operator's inputs' storages is a new
allocation: its bytes are added to ``live`` and subtracted when the storage is
freed (a ``weakref.finalize`` on the storage; PyTorch keeps one Python object per
storage, so the finalizer runs exactly when the memory is released). ``peak`` is
the high-water mark of ``live``. On a CPU this stands in for
``torch.cuda.max_memory_allocated``: it counts the same tensors, without the
caching allocator's rounding and without buffers kernels allocate internally.

Why not ``torch.autograd.graph.saved_tensors_hooks``: it sees the tensors passed
to ``save_for_backward`` but not those a custom ``autograd.Function`` keeps as
context attributes (the local dispatcher's index vectors, the EP route plan), nor
what activation checkpointing caches. Counting storages as they are created and
freed sees all of it, deduplicated by construction (views share a storage).

Storages that existed before entering (parameters, inputs) are never counted,
even when an operator returns a view of them.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage_ptrs(values: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_flatten(values)[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"}


class LiveBytes(TorchDispatchMode):
    """Bytes of storages allocated by operators since entering and still alive; their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def reset_peak(self) -> None:
        """Start a new high-water mark at the current live bytes."""
        self.peak = self.live

    def _release(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._tracked.discard(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = _storage_ptrs((args, kwargs))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in inputs or key in self._tracked:
                continue
            self._tracked.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, nbytes)
        return out
