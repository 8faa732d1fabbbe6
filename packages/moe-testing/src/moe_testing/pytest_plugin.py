"""Pytest markers shared by all moe-stack test suites.

- ``@pytest.mark.gpu``: needs CUDA; skipped without it.
- ``@pytest.mark.multigpu(n)``: needs at least ``n`` GPUs (default 2); skipped otherwise.
- ``@pytest.mark.slow``: runs by default; ``pytest -m "not slow"`` is the fast subset.
- ``@pytest.mark.multiprocess``: starts processes (gloo ranks, torchrun, a subprocess).
- ``@pytest.mark.interpreter``: runs Triton kernels under the Triton interpreter on CPU
  (``moe_testing.run_under_triton_interpreter``).

The workspace runs pytest with ``--strict-markers``: a marker not registered here is an
error, not a silently ignored typo.

Registered through the ``pytest11`` entry point when moe-testing is installed; when
running from source, pass ``-p moe_testing.pytest_plugin``.
"""

from __future__ import annotations

import pytest

MARKERS = (
    "slow: longer than ~20 s on 2 CPU cores; deselect with -m 'not slow'",
    "multiprocess: starts processes (gloo ranks, torchrun or a subprocess); has a timeout",
    "interpreter: Triton kernels under the Triton interpreter in a subprocess",
    "gpu: needs a CUDA GPU; skipped without one",
    "multigpu(n=2): needs at least n CUDA GPUs; skipped with fewer",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    multi = item.get_closest_marker("multigpu")
    if multi is not None:
        need = multi.args[0] if multi.args else multi.kwargs.get("n", 2)
        have = _gpu_count()
        if have < need:
            pytest.skip(f"needs {need} GPUs, found {have}")
    elif item.get_closest_marker("gpu") is not None and _gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
