"""One answer to "can the Triton kernels run here?" for every CUDA fast path of the package.

Each fused path (grouped GEMM, RMSNorm, RoPE, SwiGLU, router, dispatch order, combine,
cross-entropy) takes its Triton kernels for CUDA tensors when Triton is installed, and
its eager reference path otherwise. The check looks for the package without importing it, so importing
moe_model never loads Triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# Streaming multiprocessors assumed for a CPU tensor: the kernels then run in the
# Triton interpreter (tests), where a few programs exercise the multi-program paths.
_INTERPRETER_SMS = 4


@functools.cache
def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # a module entry without a spec (e.g. import blocked in sys.modules)
        return False


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (persistent and per-SM grids)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _cuda_properties(_index(device))[0]


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
