"""Every tool under ``tools/`` imports and answers ``--help`` on a CPU machine (each in a
fresh interpreter, run as the GPU machine runs it: ``python tools/<name>.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SCRIPTS = sorted(p for p in TOOLS.glob("*.py") if not p.name.startswith("_"))


def test_the_tools_are_found():
    assert len(SCRIPTS) >= 10 and (TOOLS / "_bench.py").is_file()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_tool_answers_help_on_cpu(script: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "usage:" in done.stdout
