"""One answer to "do this package's fused kernels run here?".

``triton_available`` looks for Triton without importing it (importing moe_ep_transport
never loads Triton). ``fused_kernels_enabled(device)`` is what every device operation
of ``ops`` asks: a CUDA device, Triton installed, reference switch off.

``use_reference_kernels(True)`` is the process-wide switch (like
``torch.backends.cudnn.enabled``) that sends the planning, row moves and combine sums
of ``ops`` to their PyTorch reference on every device, to bisect a numerical problem
between a kernel and its reference. The rowwise transport's peer-memory puts and
barriers (NVSHMEM on CUDA) have no eager CUDA counterpart and stay outside the switch:
they copy bytes and compute nothing. It is a module-level flag, not a context
variable, because autograd runs the backward (the combine's and dispatch's reverse
moves) on its own threads.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

_reference_kernels = False


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (found, not imported)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # a module entry without a spec (e.g. import blocked in sys.modules)
        return False


def fused_kernels_enabled(device: torch.device) -> bool:
    """Whether an op runs its Triton kernel for tensors on ``device``: a CUDA device,
    Triton installed, reference switch off."""
    return device.type == "cuda" and not _reference_kernels and triton_available()


def reference_kernels_enabled() -> bool:
    """Whether ``use_reference_kernels`` currently forces the eager reference paths."""
    return _reference_kernels


class use_reference_kernels:
    """Force (``True``) or release (``False``) every op's eager reference path, process-wide.

    Takes effect when called, like ``torch.set_grad_enabled``; used as a context manager
    it restores the previous setting on exit.
    """

    def __init__(self, enabled: bool = True) -> None:
        global _reference_kernels
        if not isinstance(enabled, bool):
            raise TypeError(f"use_reference_kernels takes a bool, got {enabled!r}")
        self.previous = _reference_kernels
        _reference_kernels = enabled

    def __enter__(self) -> use_reference_kernels:
        return self

    def __exit__(self, *exc: object) -> None:
        global _reference_kernels
        _reference_kernels = self.previous
