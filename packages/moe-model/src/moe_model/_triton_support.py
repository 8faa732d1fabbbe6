"""One answer to "do the fused kernels run here?" for every CUDA fast path of the package.

Every fused op is public as ``<op>(..., backend="auto")`` beside its eager
``<op>_reference(...)`` (same arguments, no backend) in the module that owns it, and
picks between them in one call, ``use_fused``: ``"auto"`` takes the kernels where
``fused_kernels_enabled(device)`` holds and the op applies to the inputs, ``"triton"``
insists on them (an error says why they cannot run), ``"reference"`` takes the eager code.

Each fused path (grouped GEMM, RMSNorm, RoPE, SwiGLU, router, dispatch order, combine,
cross-entropy, document attention) asks ``fused_kernels_enabled(device)``: its kernels
for CUDA tensors when Triton is installed and the reference switch is off, its eager
reference path otherwise. ``triton_available`` looks for the package without importing
it, so importing moe_model never loads Triton.

``use_reference_kernels(True)`` is the process-wide switch (like
``torch.backends.cudnn.enabled``) that sends every op of the package to its eager
reference on every device, to bisect a numerical problem between a kernel and its
reference. It is a module-level flag, not a context variable, because autograd runs the
backward on its own threads and the backward must see the same switch as the forward.

Each package keeps its own copy of this module, word for word where the packages agree,
because each installs and runs alone; ``moe_testing.check_reference_switch`` and
``check_backend_api`` hold every copy to the same contract.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Literal

import torch

Backend = Literal["auto", "triton", "reference"]
KERNEL_BACKENDS: tuple[Backend, ...] = ("auto", "triton", "reference")

# Streaming multiprocessors assumed for a CPU tensor: the kernels then run in the
# Triton interpreter (tests), where a few programs exercise the multi-program paths.
_INTERPRETER_SMS = 4


@functools.cache
def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # a module entry without a spec (e.g. import blocked in sys.modules)
        return False


_reference_kernels = False


def fused_kernels_enabled(device: torch.device) -> bool:
    """Whether the fused (Triton, ``torch._grouped_mm``, flex attention) path of an op runs
    for tensors on ``device``: a CUDA device, Triton installed, reference switch off."""
    return device.type == "cuda" and not _reference_kernels and triton_available()


def reference_kernels_enabled() -> bool:
    """Whether ``use_reference_kernels`` currently forces the eager reference paths."""
    return _reference_kernels


class use_reference_kernels:
    """Force (``True``) or release (``False``) every op's eager reference path, process-wide.

    Takes effect when called, like ``torch.set_grad_enabled``; used as a context manager
    it restores the previous setting on exit::

        moe_model.use_reference_kernels(True)      # from here on
        with moe_model.use_reference_kernels(True):  # only inside the block
            ...

    Explicit backends (``grouped_mm(..., backend="triton")``) give way to it too.
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


def use_fused(op: str, backend: str, device: torch.device,
              unfit: Callable[[], str | None] | None = None) -> bool:
    """Whether ``op`` runs its fused kernels (``True``) or its eager reference (``False``).

    ``unfit`` (called only when the kernels could run) says why these inputs do not suit
    them (``None``: they do). ``"auto"``: the kernels where ``fused_kernels_enabled(device)``
    and the inputs suit them; ``"triton"``: the kernels, or an error naming what is missing
    (CPU tensors run them only under the Triton interpreter); ``"reference"``: the eager
    code. Under ``use_reference_kernels(True)`` every backend takes the reference.
    """
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"{op}: backend must be one of {', '.join(map(repr, KERNEL_BACKENDS))}, "
                         f"got {backend!r}")
    if backend == "reference" or _reference_kernels:
        return False
    if backend == "auto":
        return fused_kernels_enabled(device) and (unfit is None or unfit() is None)
    require_triton(op, device)
    why = unfit() if unfit is not None else None
    if why is not None:
        raise ValueError(f"{op}: backend='triton' does not apply: {why}")
    return True


def require_triton(op: str, device: torch.device) -> None:
    """Raise, naming ``op``, unless Triton kernels can run on ``device``: Triton installed,
    and a CUDA device or a CPU under the Triton interpreter (``TRITON_INTERPRET=1``)."""
    if not triton_available():
        raise RuntimeError(f"{op}: backend='triton' needs Triton, which is not installed")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"{op}: backend='triton' needs CUDA tensors (or CPU tensors under the "
                           f"Triton interpreter, TRITON_INTERPRET=1), got {device.type} tensors")


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (Triton's own ``TRITON_INTERPRET``,
    read as Triton reads it, without importing Triton)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors the persistent and per-SM grids on ``device`` spread over.

    Every SM less torch's SM carveout (``torch._C._set_sm_carveout_experimental``), which
    cuBLAS and ``torch._grouped_mm`` leave free too: a persistent program holds its SM until
    the kernel ends, so the carveout is what other streams' kernels (an overlapped
    transport's, NCCL's) can run on meanwhile. At least one.
    """
    sms = _INTERPRETER_SMS if device.type != "cuda" else _cuda_properties(_index(device))[0]
    return max(1, sms - (sm_carveout() or 0))


def sm_carveout() -> int | None:
    """torch's SM carveout for persistent matmul kernels (``None``: unset, or a torch without it)."""
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    return get() if get is not None else None


def row_chunks(rows: int, block_rows: int, device: torch.device, programs_per_sm: int) -> tuple[int, int]:
    """``(programs, rows_per_program)`` for a kernel whose programs each walk a contiguous
    chunk of rows in blocks of ``block_rows`` and keep one partial sum (a weight gradient's
    row of partials): at most ``programs_per_sm`` per SM, every chunk whole blocks."""
    blocks = -(-rows // block_rows)
    programs = min(blocks, num_sms(device) * programs_per_sm)
    rows_per_program = -(-blocks // programs) * block_rows
    return -(-rows // rows_per_program), rows_per_program


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """Compute capability of the CUDA ``device``."""
    return _cuda_properties(_index(device))[1]


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def _cuda_properties(index: int) -> tuple[int, tuple[int, int]]:
    """(SMs, capability), asked once per device: kernel launchers need them on every call,
    and the query costs tens of microseconds of host time each time."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, (props.major, props.minor)
