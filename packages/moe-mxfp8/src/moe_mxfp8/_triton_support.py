"""One answer to "do this package's fused kernels run here?".

``triton_available`` looks for Triton without importing it (importing moe_mxfp8 never
loads Triton). ``fused_kernels_enabled(device)`` is what every ``backend="auto"`` path
asks: a CUDA device, Triton installed, reference switch off. ``resolve_backend`` is the
one place every op turns its ``backend`` argument into kernel-or-reference.

``use_reference_kernels(True)`` is the process-wide switch (like
``torch.backends.cudnn.enabled``) that sends every op of the package to its eager
reference on every device, explicit ``backend="triton"`` included, to bisect a
numerical problem between a kernel and its reference. The native scaled GEMMs
(``gemm="native"``, ``native_mx_mm``) are opted into by configuration and stay outside
it. It is a module-level flag, not a context variable, because autograd runs the
backward on its own threads and the backward must see the same switch as the forward.

Each package keeps its own copy of this module, word for word where the packages agree,
because each installs and runs alone; ``moe_testing.check_reference_switch`` and
``check_backend_api`` hold every copy to the same contract.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

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
    """Whether an ``auto`` op runs its Triton kernels (or ``torch._grouped_mm``) for
    tensors on ``device``: a CUDA device, Triton installed, reference switch off."""
    return device.type == "cuda" and not _reference_kernels and triton_available()


def reference_kernels_enabled() -> bool:
    """Whether ``use_reference_kernels`` currently forces the eager reference paths."""
    return _reference_kernels


Backend = Literal["auto", "triton", "reference"]
BACKENDS: tuple[Backend, ...] = ("auto", "triton", "reference")


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own ``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def resolve_backend(backend: Backend, device: torch.device) -> bool:
    """The package's one decision: whether an op called with ``backend`` on ``device``
    tensors runs its Triton kernel (``True``) or its eager reference (``False``).

    ``"auto"``: the kernel where ``fused_kernels_enabled(device)``; ``"reference"``: the
    reference; ``"triton"``: the kernel, or ``RuntimeError`` where it cannot run (Triton
    not installed; a non-CUDA device outside Triton's interpreter). The reference switch
    overrides every choice, ``"triton"`` included. Any other value: ``ValueError``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if _reference_kernels or backend == "reference":
        return False
    if backend == "auto":
        return fused_kernels_enabled(device)
    if not triton_available():
        raise RuntimeError("backend='triton' needs Triton, which is not installed")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"backend='triton' needs CUDA tensors (or CPU tensors under the Triton "
                           f"interpreter, TRITON_INTERPRET=1), got {device.type} tensors")
    return True


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
