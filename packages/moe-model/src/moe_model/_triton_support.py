"""One answer to "can the Triton kernels run here?" for every CUDA fast path of the package.

Each fused path (grouped GEMM, RMSNorm, RoPE, combine, cross-entropy) takes its Triton
kernels for CUDA tensors when Triton is installed, and its eager reference path
otherwise. The check looks for the package without importing it, so importing
moe_model never loads Triton.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_available() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # a module entry without a spec (e.g. import blocked in sys.modules)
        return False
