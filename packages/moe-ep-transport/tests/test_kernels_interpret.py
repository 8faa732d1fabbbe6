"""The Triton kernels on CPU under TRITON_INTERPRET=1 (in a subprocess, so the variable does not leak)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


@pytest.mark.interpreter
def test_kernels_match_torch_under_interpreter() -> None:
    script = Path(__file__).with_name("_interpret_kernels.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kernels ok" in proc.stdout
