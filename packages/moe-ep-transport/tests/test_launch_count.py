"""Dispatch and combine launch a small, fixed number of device operations per direction.

The GPU path runs on CPU (:mod:`_launch_counter`: EP ranks as threads, every Triton
kernel under the interpreter, barriers counted as their flag kernel, other launching
aten ops counted one each). The counts are pinned per direction, and they do not grow
with the EP ranks or the experts; neither does the host's Python work per call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")

# Launches per direction (Triton kernels + barrier kernels, aten ops), by combine site.
# Every put's barrier is passed by the kernel that reads what it put. Dispatch: slot ranks
# (hist, block scan + count put), cell plan (+ the counts' barrier, telemetry), row plan,
# token put, receive. On NVSHMEM the cell plan runs in the block scan's last program (five),
# which the rank threads cannot do: their barriers are host waits between launches
# (``barriers_in_kernels``); ``test_gpu`` runs that path. Combine: put, sum. Combine's backward at the source: scaled
# gradients, put, receive; at the destination: token put, receive (+ row and weight
# gradients), weight put (+ zeroing the dropped slots), the copy out of the slab.
_KERNELS = {
    "source": {"dispatch": 6, "combine": 2, "combine_backward": 3, "dispatch_backward": 2, "no_grad": 8},
    "destination": {"dispatch": 6, "combine": 2, "combine_backward": 4, "dispatch_backward": 2, "no_grad": 8},
}
_ATEN: dict[str, dict[str, int]] = {"source": {}, "destination": {}}


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
            assert got["kernels"] == _KERNELS[combine][direction], where
            assert sum(got["aten"].values()) == _ATEN[combine].get(direction, 0), where


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
