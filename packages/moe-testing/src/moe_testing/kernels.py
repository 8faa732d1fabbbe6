"""Helpers for kernel tests: the Triton interpreter in a subprocess, host-sync checks,
the bytes autograd saves, the Triton kernels a step launches, and the contracts every
package's kernel switch and public ops keep.

``TRITON_INTERPRET=1`` must be set before Triton is first imported, and never in
the test process itself (it would turn every later kernel into interpreted code), so
interpreter checks live in a small script that runs in a child process.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock


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


def _tensors(value: Any) -> list[Any]:
    """Every tensor of an op's result, in order: tensors, and those inside tuples, lists,
    dataclasses and plain objects (a quantised tensor's data and scales)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        value = list(vars(value).values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _bits_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaNs and FP8 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8),
                       b.detach().reshape(-1).contiguous().view(torch.uint8))


def same_bits(a: Any, b: Any) -> bool:
    """Whether two op results hold the same tensors bit for bit (dtype, shape and bytes;
    NaNs and FP8 included), walking tuples, lists, dataclasses and objects alike."""
    x, y = _tensors(a), _tensors(b)
    return len(x) == len(y) and all(_bits_equal(p, q) for p, q in zip(x, y, strict=True))


def _outputs_and_grads(op: Callable[..., Any], make_args: Callable[[], tuple],
                       out: Callable[[Any, tuple], Any], **backend: str) -> list[Any]:
    """The op's output tensors (``out(result, args)``) and the gradients of a fixed
    function of them with respect to the arguments that require one."""
    import torch

    args = make_args()
    outputs = _tensors(out(op(*args, **backend), args))
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    differentiable = [o for o in outputs if o.requires_grad]
    if not inputs or not differentiable:
        return [o.detach() for o in outputs]
    loss = sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape)).sum()
               for o in differentiable)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [o.detach() for o in outputs] + [g for g in grads if g is not None]


def check_backend_api(support: ModuleType, op: Callable[..., Any], reference: Callable[..., Any],
                      make_args: Callable[[], tuple],
                      out: Callable[[Any, tuple], Any] = lambda result, args: result) -> None:
    """The public-op contract of the kernel convention, checked on CPU (no kernel runs).

    ``op(*args, backend=...)`` is a package's public op, ``reference(*args)`` its
    ``<op>_reference``, ``support`` the package's ``_triton_support`` module, ``make_args``
    fresh arguments per call (an in-place op names what it wrote through ``out``). Checked:
    ``"reference"`` and ``"auto"`` give exactly the reference's tensors, forward and
    gradients; an unknown backend is a ``ValueError`` naming it and the three choices;
    ``"triton"`` on CPU outside the Triton interpreter is a ``RuntimeError`` saying what it
    needs; under ``use_reference_kernels(True)`` ``"triton"`` gives the reference, and so
    does ``"auto"`` even where the kernels would run (``fused_kernels_enabled`` made to say
    yes, as on a GPU).
    """
    import pytest

    switch = support.use_reference_kernels
    with switch(False), mock.patch.dict(os.environ):
        os.environ.pop("TRITON_INTERPRET", None)
        want = _outputs_and_grads(reference, make_args, out)
        assert want, "the op gave no tensor to compare"
        for backend in ("reference", "auto"):
            got = _outputs_and_grads(op, make_args, out, backend=backend)
            assert len(got) == len(want), f"backend={backend!r}: {len(got)} tensors, the reference {len(want)}"
            assert all(_bits_equal(g, w) for g, w in zip(got, want, strict=True)), (
                f"backend={backend!r} differs from the reference")
        with pytest.raises(ValueError, match="backend must be one of 'auto', 'triton', 'reference', "
                                             "got 'cuda'"):
            op(*make_args(), backend="cuda")
        if support.triton_available():
            with pytest.raises(RuntimeError, match="backend='triton' needs CUDA tensors"):
                op(*make_args(), backend="triton")
        with switch(True):
            try:
                under_switch = {"triton": _outputs_and_grads(op, make_args, out, backend="triton")}
            except RuntimeError as e:  # the kernel was asked for despite the switch
                raise AssertionError("backend='triton' under use_reference_kernels(True) did not "
                                     f"take the reference: {e}") from e
            with mock.patch.object(support, "fused_kernels_enabled", lambda device: True):
                under_switch["auto"] = _outputs_and_grads(op, make_args, out, backend="auto")
    for backend, got in under_switch.items():
        assert len(got) == len(want) and all(_bits_equal(g, w) for g, w in zip(got, want, strict=True)), (
            f"backend={backend!r} under use_reference_kernels(True) is not the reference")
