"""Pytest markers shared by all moe-stack test suites.

- ``@pytest.mark.gpu``: needs CUDA; skipped without it.
- ``@pytest.mark.multigpu(n)``: needs at least ``n`` GPUs (default 2); skipped otherwise.
- ``@pytest.mark.slow``: too slow for CI's time budget (a scaled-down version runs
  always); skipped unless ``pytest --run-slow``.

Registered through the ``pytest11`` entry point when moe-testing is installed; when
running from source, pass ``-p moe_testing.pytest_plugin``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: too slow for CI; runs with --run-slow")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line(
        "markers", "multigpu(n=2): needs at least n CUDA GPUs; skipped with fewer"
    )


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slow") is not None and not item.config.getoption("--run-slow"):
        pytest.skip("slow: run with --run-slow")
    multi = item.get_closest_marker("multigpu")
    if multi is not None:
        need = multi.args[0] if multi.args else multi.kwargs.get("n", 2)
        have = _gpu_count()
        if have < need:
            pytest.skip(f"needs {need} GPUs, found {have}")
    elif item.get_closest_marker("gpu") is not None and _gpu_count() == 0:
        pytest.skip("needs a CUDA GPU")
