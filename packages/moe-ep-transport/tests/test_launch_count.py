"""Dispatch and combine launch a small, fixed number of device operations per direction.

The GPU path runs on CPU (:mod:`_launch_counter`: EP ranks as threads, every Triton
kernel under the interpreter, barriers counted as their flag kernel, other launching
aten ops counted one each). The counts are pinned per direction, and they do not grow
with the EP ranks or the experts; neither does the host's Python work per call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter

sys.path.insert(0, str(Path(__file__).parent))
from _launch_counter import KERNELS  # noqa: E402

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def counts() -> list[dict]:
    out = run_under_triton_interpreter(Path(__file__).with_name("_launch_counts_interpret.py"), timeout=600)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("combine", ["source", "destination"])
def test_launches_per_direction_are_pinned(counts: list[dict], combine: str) -> None:
    for run in counts:
        if run["combine"] != combine:
            continue
        for direction, got in run["counts"].items():
            where = (combine, run["ranks"], run["experts"], direction, got)
            assert got["kernels"] == KERNELS[combine][direction], where
            assert not got["aten"], where


@pytest.mark.slow
@pytest.mark.interpreter
def test_launches_and_host_work_do_not_grow_with_experts_or_ranks(counts: list[dict]) -> None:
    """The same kernels and aten ops per direction at EP2 and EP4, 8 and 64 experts, and host
    calls within 2% (a Python loop over experts or ranks would add 8x or 2x of its body)."""
    assert {(r["ranks"], r["experts"]) for r in counts} == {(2, 8), (2, 64), (4, 8)}
    for combine in ("source", "destination"):
        runs = [r for r in counts if r["combine"] == combine]
        want = runs[0]["counts"]
        for run in runs[1:]:
            for direction, got in run["counts"].items():
                where = (combine, run["ranks"], run["experts"], direction)
                same = {k: v for k, v in got.items() if k != "host_calls"}
                assert same == {k: v for k, v in want[direction].items() if k != "host_calls"}, where
                host, want_host = got["host_calls"], want[direction]["host_calls"]
                assert abs(host - want_host) <= 0.02 * want_host, (where, host, want_host)
