"""tools/kernel_census.py's attribution on synthetic profiler events: each kernel goes to the
outermost op around its launch call and to the autograd node it ran in (with its innermost
op in the row's parts), and the idle time before a kernel is counted once, against the
latest end of the kernels before it; a replay's kernels by name, its span and its gaps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from moe_testing import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_census.py"


def _tool():
    return load_script(TOOL)


@dataclass
class _Event:
    """The parts of a kineto event the census reads."""
    _name: str
    start: int
    duration: int
    on_device: bool = False
    correlation: int = 0

    def name(self) -> str:
        return self._name

    def start_ns(self) -> int:
        return self.start

    def duration_ns(self) -> int:
        return self.duration

    def correlation_id(self) -> int:
        return self.correlation

    def device_type(self):
        return torch.autograd.DeviceType.CUDA if self.on_device else torch.autograd.DeviceType.CPU


def test_kernels_are_attributed_to_the_launching_op_and_node():
    host = [
        _Event("ProfilerStep#3", 0, 10_000),
        _Event("aten::linear", 100, 300),               # forward op with an inner op
        _Event("aten::mm", 150, 200),
        _Event("cudaLaunchKernel", 160, 10, correlation=1),
        _Event("autograd::engine::evaluate_function: MmBackward0", 1_000, 500),
        _Event("MmBackward0", 1_010, 480),
        _Event("cudaLaunchKernel", 1_100, 10, correlation=2),
        _Event("cuLaunchKernel", 1_200, 10, correlation=3),
        _Event("cudaLaunchKernel", 5_000, 10, correlation=4),  # no op around it
    ]
    device = [
        _Event("gemm", 2_000, 1_000, on_device=True, correlation=1),
        _Event("gemm_bwd", 3_500, 1_000, on_device=True, correlation=2),   # 500 ns idle before
        _Event("small", 3_600, 100, on_device=True, correlation=3),        # overlaps: no gap
        _Event("tail", 6_000, 100, on_device=True, correlation=4),         # 1_500 ns idle
    ]
    rows = {(r["node"], r["op"]): r for r in _tool().census(host + device)}
    fwd = rows[("forward", "aten::linear")]
    assert (fwd["kernels"], fwd["gap_ms"]) == (1, 0.0) and abs(fwd["device_ms"] - 1e-3) < 1e-12
    bwd = rows[("MmBackward0", "MmBackward0")]
    assert bwd["kernels"] == 2 and abs(bwd["gap_ms"] - 500e-6) < 1e-12
    lost = rows[("forward", "(unattributed)")]
    assert lost["kernels"] == 1 and abs(lost["gap_ms"] - 1_500e-6) < 1e-12
    assert sum(r["kernels"] for r in rows.values()) == len(device)


def test_replay_timeline_and_names_count_overlaps_once():
    kernels = [
        _Event("gemm<float, 128>", 1_000, 1_000, on_device=True),
        _Event("gemm<bf16, 64>", 1_500, 1_000, on_device=True),   # overlaps the first by 500
        _Event("small", 3_000, 100, on_device=True),              # 500 ns idle before
        _Event("inside", 3_020, 20, on_device=True),              # inside "small": no gap
        _Event("tail", 13_100, 100, on_device=True),              # 10_000 ns idle before
    ]
    tool = _tool()
    names = tool.by_kernel(kernels)
    assert names["gemm"]["kernels"] == 2 and abs(names["gemm"]["device_ms"] - 2e-3) < 1e-12
    assert abs(names["tail"]["gap_ms"] - 10e-3) < 1e-12 and names["inside"]["gap_ms"] == 0.0
    span = tool.timeline(kernels)
    assert abs(span["span_ms"] - 12.2e-3) < 1e-12           # 1_000 to 13_200
    assert abs(span["busy_ms"] - 1.7e-3) < 1e-12            # 1_500 + 100 + 100
    assert abs(span["idle_ms"] - 10.5e-3) < 1e-12
    assert span["gaps_over_10us"] == 0                      # 10 us exactly is not over
    largest = span["largest_gaps"][0]
    assert (largest["after"], largest["before"]) == ("small", "tail")
    assert abs(largest["ms"] - 10e-3) < 1e-12
    rows = tool.differences(names, {"gemm": {"kernels": 2, "device_ms": 1e-3}}, 1)
    assert rows == [{"kernel": "gemm", "replay_ms": names["gemm"]["device_ms"], "eager_ms": 1e-3,
                     "replay_kernels": 2, "eager_kernels": 2}]


def test_rows_name_their_kernels_and_innermost_ops():
    host = [
        _Event("_FP8ExpertsFnBackward", 0, 1_000),
        _Event("aten::contiguous", 10, 100),
        _Event("aten::copy_", 20, 50),
        _Event("cudaLaunchKernel", 30, 5, correlation=1),
        _Event("cuLaunchKernel", 500, 5, correlation=2),
    ]
    device = [
        _Event("elementwise_kernel<128, 4>", 2_000, 300, on_device=True, correlation=1),
        _Event("fp8_rows_kernel", 2_400, 900, on_device=True, correlation=2),
    ]
    (row,) = _tool().census(host + device)
    assert (row["op"], row["kernels"]) == ("_FP8ExpertsFnBackward", 2)
    assert [(q["kernel"], q["inner_op"], q["kernels"]) for q in row["parts"]] == [
        ("fp8_rows_kernel", "_FP8ExpertsFnBackward", 1), ("elementwise_kernel", "aten::copy_", 1)]
