"""Helpers for kernel tests: the Triton interpreter in a subprocess, host-sync checks,
the bytes autograd saves, the Triton kernels a step launches.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, and never in
the test process itself (it would turn every later kernel into interpreted code), so
interpreter checks live in a small script that runs in a child process.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def run_under_triton_interpreter(script: str | Path, timeout: float = 240.0) -> str:
    """Run ``script`` with ``TRITON_INTERPRET=1``; its stdout. Fails unless it exits 0 and
    its output ends with ``ok`` (so a script that silently checks nothing fails)."""
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok"), done.stdout[-2000:]
    return done.stdout


def assert_no_host_sync(step: Callable[[], object], warmup: int = 2) -> None:
    """Run ``step`` ``warmup`` times (compilation, allocator), then once under
    ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call raises."""
    import torch

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def saved_tensor_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn`` runs (views counted
    at their own size): what a layer's activation memory is made of."""
    import torch

    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def package_triton_kernels(package: ModuleType) -> set[str]:
    """Names of the ``@triton.jit`` functions in ``package``'s ``_<op>_kernels`` modules
    (autotuner and heuristics wrappers unwrapped): the names a profiler shows them by."""
    from triton.runtime.jit import JITFunction

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.endswith("_kernels"):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for obj in vars(module).values():
                while hasattr(obj, "fn") and not isinstance(obj, JITFunction):
                    obj = obj.fn
                if isinstance(obj, JITFunction):
                    names.add(obj.fn.__name__)
    return names


def launched_triton_kernels(step: Callable[[], object], *packages: ModuleType) -> set[str]:
    """Run ``step`` (CUDA) under the profiler; the names of the kernels it launched that are
    ``packages``' Triton kernels or TorchInductor's generated ones (``triton_*``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    ours = set().union(*(package_triton_kernels(p) for p in packages))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if e.key in ours or e.key.startswith("triton_")}


def check_reference_switch(support: ModuleType) -> None:
    """The contract every package's ``_triton_support`` module keeps, checked on CPU.

    ``fused_kernels_enabled`` is never true for a CPU device, true for a CUDA device
    (a device object only: no GPU is touched) exactly when Triton is installed and the
    switch is off; ``use_reference_kernels(flag)`` holds when called and restores the
    previous setting when used as a context manager; it takes only a bool. The switch
    is left off.
    """
    import pytest
    import torch

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    use, enabled = support.use_reference_kernels, support.reference_kernels_enabled
    use(False)
    assert support.fused_kernels_enabled(cuda) == support.triton_available()
    assert not support.fused_kernels_enabled(cpu)
    with use(True):
        assert enabled() and not support.fused_kernels_enabled(cuda)
    assert not enabled() and support.fused_kernels_enabled(cuda) == support.triton_available()
    use(True)
    with use(False):
        assert not enabled()
    assert enabled()
    use(False)
    assert not enabled()
    with pytest.raises(TypeError, match="use_reference_kernels takes a bool"):
        use(1)
    assert not enabled()
