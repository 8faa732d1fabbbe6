"""The Triton kernels on CPU under TRITON_INTERPRET=1 (in a subprocess, so the variable does not leak)."""

from __future__ import annotations

from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.interpreter
def test_kernels_match_torch_under_interpreter() -> None:
    out = run_under_triton_interpreter(Path(__file__).with_name("_interpret_kernels.py"))
    assert "kernels ok" in out


@pytest.mark.slow
@pytest.mark.interpreter
def test_gpu_path_on_rank_threads_matches_the_reference_ops() -> None:
    out = run_under_triton_interpreter(Path(__file__).with_name("_fused_path_interpret.py"))
    assert "fused path ok" in out
