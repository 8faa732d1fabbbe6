"""``parallel.sm_carveout``: SMs every persistent GEMM leaves free, for one trainer's life.

A persistent GEMM (cuBLAS's on Hopper, ``torch._grouped_mm``'s CUTLASS kernels, moe_model's
grouped GEMM and moe_mxfp8's FP8 GEMM) starts one program per SM and holds every SM until
it ends, so a kernel of another stream, the EP transport's on its communication stream
or NCCL's, gets an SM only between GEMMs however high its stream's priority. torch's SM
carveout (``torch._C._set_sm_carveout_experimental``: cuBLASLt's SM count target, the
CUTLASS kernels' SM count) makes them leave that many SMs free, and moe_model's and
moe_mxfp8's persistent grids read the same setting. torch keeps it process-wide, so a
trainer sets it for its life and puts the previous value back when it closes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch


def carveout_supported() -> bool:
    """Whether this torch has the SM carveout (an experimental API it may drop)."""
    return hasattr(torch._C, "_set_sm_carveout_experimental")


@contextmanager
def _carved_out(sms: int) -> Iterator[None]:
    previous = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)


def sm_carveout(sms: int | None) -> ExitStack:
    """Leave ``sms`` SMs free in every persistent GEMM (``None``: leave the setting as it is);
    closing the returned stack restores the previous carveout."""
    stack = ExitStack()
    if sms is not None:
        stack.enter_context(_carved_out(sms))
    return stack
