"""tools/probe_ep_overlap.py on the CPU (gloo, the emulated transport): a run of the app
through the stack-dumping launcher is recorded step by step, and a run past its time limit
is killed with its ranks (the stall it looks for needs two GPUs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from moe_testing import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "probe_ep_overlap.py"


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


@pytest.mark.multiprocess
def test_a_pipelined_ep2_run_is_recorded_with_its_stack_dumps(tmp_path, capsys):
    tool = load_script(TOOL)
    out = tmp_path / "probe.json"
    report = tool.main(["--device", "cpu", "--variants", "base", "--repeats", "1", "--steps", "3",
                        "--chunks", "2", "--timeout", "240", "--out", str(out)])
    (run,) = report["runs"]
    assert run["finished"] and not run["timed_out"] and run["returncode"] == 0, run
    assert run["steps"] == 3 and run["slowest_step_s"] == max(run["step_times_s"]) > 0
    run_dir = Path(run["run_dir"])
    assert run_dir.parent == tmp_path / "probe"
    assert sorted(p.name for p in (run_dir / "stacks").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert json.loads(out.read_text())["runs"][0]["steps"] == 3
    assert "base" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_a_run_past_its_time_limit_is_killed_with_its_ranks(tmp_path):
    tool = load_script(TOOL)
    report = tool.main(["--device", "cpu", "--variants", "base", "--repeats", "1", "--steps", "400",
                        "--chunks", "2", "--timeout", "10", "--out", str(tmp_path / "probe.json")])
    (run,) = report["runs"]
    assert run["timed_out"] and not run["finished"] and run["returncode"] is None
    assert _processes_naming(run["run_dir"]) == []  # torchrun's ranks included


def test_the_variants_change_one_setting_each(tmp_path):
    tool = load_script(TOOL)
    a = tool.parse_args(["--out", str(tmp_path / "p.json"), "--chunks", "4"])
    base = tool.command(a, tool.VARIANTS[1], tmp_path / "run")
    assert "parallel.ep_overlap_chunks=4" in base and "train.device=cuda" in base
    assert base[base.index("--nproc-per-node") + 1] == "2" and "parallel.ep_backend=rowwise" in base
    for v in tool.VARIANTS:
        cmd = tool.command(a, v, tmp_path / "run")
        assert (len(v.env) + len(v.overrides) == 1) == (v.name != "base"), v.name
        assert cmd[: len(base)] == base and cmd[len(base):] == list(v.overrides)
    for argv in (["--chunks", "1"], ["--timeout", "0"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(["--out", str(tmp_path / "p.json"), *argv])
