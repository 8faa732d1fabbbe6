"""tools/bench_ep_2gpu.py on the CPU: its options, the parts it would run and its target checks
(the measurement itself needs two GPUs)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from moe_testing import load_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_ep_2gpu.py"


def _tool():
    return load_script(TOOL)


@pytest.mark.multiprocess
def test_help_answers_without_a_gpu():
    proc = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--graphs" in proc.stdout and "--out" in proc.stdout


def test_parts_follow_the_options(tmp_path):
    bench = _tool()
    out = tmp_path / "ep.json"
    parts = bench.commands(bench.parse_args(["--out", str(out)]))
    assert list(parts) == ["train_graphs", "train_graphs_overlap2", "train_graphs_overlap4", "train_graphs_mb1",
                           "train_graphs_interleave", "train_graphs_interleave16", "train_graphs_interleave_ce",
                           "train_graphs_interleave_ce_carve16", "train_eager", "train_eager_overlap2",
                           "train_eager_overlap4", "train_eager_mb1", "train_eager_interleave",
                           "train_eager_interleave16", "train_eager_interleave_ce",
                           "train_eager_interleave_ce_carve16", "transport"]
    carved = parts["train_graphs_interleave_ce_carve16"][0]
    assert {"parallel.ep_copy_engine=true", "parallel.sm_carveout=16"} <= set(carved)
    assert not any(c.startswith("parallel.ep_comm_sms") for c in carved)
    assert "parallel.ep_copy_engine=true" in parts["train_graphs_interleave_ce"][0]
    assert "parallel.ep_copy_engine=true" not in parts["train_graphs_interleave16"][0]
    custom = bench.commands(bench.parse_args(["--out", str(out), "--interleave", "16+ce,all+carve8"]))
    assert {"parallel.ep_comm_sms=16", "parallel.ep_copy_engine=true"} <= set(
        custom["train_graphs_interleave16_ce"][0])
    assert "parallel.sm_carveout=8" in custom["train_graphs_interleave_carve8"][0]
    runs = bench.parse_args(["--out", str(out), "--interleave", "all,16,16+ce,all+ce+carve16"]).interleave_runs
    assert len({run.part for run in runs}) == len(runs)  # main finds each run by its part's name
    interleave_cmd = parts["train_graphs_interleave16"][0]
    assert {"parallel.ep_overlap_microbatches=true", "parallel.ep_comm_sms=16",
            "train.micro_batch=1"} <= set(interleave_cmd)
    assert "parallel.ep_overlap_microbatches=true" not in parts["train_graphs_mb1"][0]
    assert "train.micro_batch=1" in parts["train_graphs_mb1"][0]
    assert not any(c.startswith("parallel.ep_comm_sms") for c in parts["train_graphs_interleave"][0])
    overlap_cmd = parts["train_eager_overlap4"][0]
    assert "parallel.ep_overlap_chunks=4" in overlap_cmd and "train.cuda_graphs=false" in overlap_cmd
    assert overlap_cmd[overlap_cmd.index("--methods") + 1:overlap_cmd.index("--routing")] == ["ep"]
    assert not any(c.startswith("parallel.ep_comm_sms") for c in overlap_cmd)
    parts = bench.commands(bench.parse_args(["--out", str(out), "--overlap-chunks", "3", "--comm-sms", "24"]))
    assert "parallel.ep_comm_sms=24" in parts["train_graphs_overlap3"][0]
    parts = bench.commands(bench.parse_args(["--out", str(out), "--overlap-chunks", "none", "--interleave", "none"]))
    assert list(parts) == ["train_graphs", "train_eager", "transport"]
    train_cmd, train_json = parts["train_graphs"]
    assert "train.cuda_graphs=true" in train_cmd and train_json.parent == tmp_path
    assert train_cmd[train_cmd.index("--profile") + 1] == str(train_json.with_suffix(".profile.txt"))
    assert train_cmd[train_cmd.index("--nproc-per-node") + 1] == "2"
    parts = bench.commands(bench.parse_args(["--out", str(out), "--graphs", "off", "--tests", "--skip",
                                             "transport", "--overlap-chunks", "none", "--interleave", "none"]))
    assert list(parts) == ["train_eager", "tests"]
    assert "train.cuda_graphs=false" in parts["train_eager"][0]
    tests_cmd = parts["tests"][0]
    assert tests_cmd[:3] == [sys.executable, "-m", "pytest"]
    files = [c for c in tests_cmd if c.endswith("test_gpu.py")]
    assert [Path(f).parts[-3] for f in files] == ["pretrain", "moe-ep-transport"] and all(Path(f).exists() for f in files)
    assert tests_cmd[tests_cmd.index("-k") + 1] == "cuda_graphs_on_two_ranks or interleaved or rowwise"


@pytest.mark.multiprocess
@pytest.mark.parametrize("setsid", [False, True], ids=["same-group", "setsid"])
def test_a_part_past_its_timeout_is_killed_with_its_children(tmp_path, setsid):
    """Also a child detached with setsid, as torchrun starts its ranks: a process-group
    kill would leave it running."""
    marker = tmp_path / "child_survived"
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    parent = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], "
              f"start_new_session={setsid})")
    code, timed_out = _tool().run_part([sys.executable, "-c", parent], 1.0)
    assert timed_out and code != 0
    time.sleep(4)
    assert not marker.exists()  # the grandchild went with the part
    assert _tool().run_part([sys.executable, "-c", "pass"], 30) == (0, False)


@pytest.mark.parametrize("argv, message", [
    (["--warmup", "0"], "the first step captures the graphs"),
    (["--gpus", "1"], "needs at least 2"),
    (["--skip", "train", "--skip", "transport"], "leaves nothing to run"),
    (["--part-timeout", "0"], "positive seconds expected"),
    (["--overlap-chunks", "1,2"], "2 or more chunks"),
    (["--overlap-chunks", "two"], "comma-separated integers or 'none'"),
    (["--overlap-chunks", "none", "--comm-sms", "8"], "for the --overlap-chunks runs"),
    (["--interleave", "all,x"], "comma-separated SM counts or 'all', each with an optional '+ce' and "
     "'+carveN', or 'none'"),
    (["--interleave", "16+cx"], "comma-separated SM counts or 'all'"),
    (["--interleave", "all+carve0"], "positive SM counts expected"),
    (["--interleave", "16+carve8"], "a carveout goes with 'all'"),
    (["--interleave", "0"], "positive SM counts expected"),
    (["--interleave-micro-batch", "0"], "a positive sequence count expected"),
])
def test_bad_options_name_the_option(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        _tool().parse_args(["--out", str(tmp_path / "x.json"), *argv])
    assert message in capsys.readouterr().err


def _run(method, routing, tok, mfu):
    return {"method": method, "routing": routing, "tokens_per_s_per_gpu": tok, "mfu": mfu,
            "cuda_graphs": True}


def test_train_checks_compare_ep_with_dp_per_routing():
    report = {"runs": [_run("ddp", "model", 40_000, 0.43), _run("ep", "model", 42_400, 0.45),
                       _run("ddp", "balanced", 40_000, 0.43), _run("ep", "balanced", 41_600, 0.44),
                       _run("ddp", "zipf", 40_000, 0.41), _run("ep", "zipf", 44_000, 0.45)]}
    checks = {c["routing"]: c for c in _tool().train_checks(report, "graphs")}
    assert checks["model"]["met"] and checks["model"]["ep_over_dp"] == pytest.approx(1.06)
    assert not checks["balanced"]["met"]  # 1.04x
    assert not checks["zipf"]["met"]  # DP's MFU under 42%


def _row(tokens, routing, backend, payload, x_nccl, put):
    return {"tokens": tokens, "routing": routing, "backend": backend, "payload_mib": payload,
            "x_nccl": x_nccl, "pct_put_ceiling": put}


def test_transport_checks_use_the_graph_replay_and_the_size_targets():
    rows = [_row(512, "balanced", "rowwise", 16, 0.9, 50), _row(512, "balanced", "rowwise:graph", 16, 1.6, 72),
            _row(1024, "balanced", "rowwise:graph", 32, 1.4, 90),
            _row(65536, "balanced", "rowwise:graph", 2048, 1.2, 79)]
    checks = _tool().transport_checks({"rows": rows})
    assert [(c["tokens"], c["backend"], c["met"]) for c in checks] == [
        (512, "rowwise:graph", True), (1024, "rowwise:graph", False), (65536, "rowwise:graph", False)]


def test_overlap_checks_compare_with_dp_and_unsplit_ep_of_the_same_mode():
    base = {"runs": [_run("ddp", "model", 40_000, 0.43), _run("ep", "model", 38_000, 0.41)]}
    report = {"runs": [_run("ep", "model", 43_000, 0.46), _run("ep", "zipf", 41_000, 0.44)]}
    checks = {c["routing"]: c for c in _tool().overlap_checks(report, base, "eager", 2)}
    assert checks["model"]["met"] and checks["model"]["over_dp"] == pytest.approx(1.075)
    assert checks["model"]["over_ep"] == pytest.approx(43 / 38) and checks["model"]["chunks"] == 2
    assert checks["zipf"]["over_dp"] is None and not checks["zipf"]["met"]  # no DP run to compare
    assert all(c["over_dp"] is None for c in _tool().overlap_checks(report, None, "graphs", 4))


def _main_on_reports(tmp_path, monkeypatch, reports: dict, graphs: str) -> dict:
    """``main`` with its parts replaced by ``reports`` (part name -> the JSON it would write)."""
    bench = _tool()
    parts = {}
    for name, report in reports.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(report))
        parts[name] = (["true"], path)
    monkeypatch.setattr(bench, "commands", lambda a: parts)
    monkeypatch.setattr(bench, "run_part", lambda cmd, timeout_s: (0, False))
    return bench.main(["--out", str(tmp_path / "ep.json"), "--graphs", graphs])


def test_main_checks_each_overlap_run_against_its_modes_dp_and_ep(tmp_path, monkeypatch, capsys):
    result = _main_on_reports(tmp_path, monkeypatch, {
        "train_eager": {"runs": [_run("ddp", "model", 40_000, 0.43), _run("ep", "model", 38_000, 0.41)]},
        "train_eager_overlap2": {"runs": [_run("ep", "model", 42_800, 0.46)]},
    }, "off")
    (check,) = result["overlap_eager_checks"]
    assert check["chunks"] == 2 and check["over_dp"] == pytest.approx(1.07) and check["met"]
    assert "EP in 2 chunks 42,800 tok/s/GPU = 1.070x DP, 1.126x EP unsplit" in capsys.readouterr().out


def test_main_checks_each_interleaved_run_against_dp_and_its_unsplit_baseline(tmp_path, monkeypatch, capsys):
    result = _main_on_reports(tmp_path, monkeypatch, {
        "train_graphs": {"runs": [_run("ddp", "model", 40_000, 0.43), _run("ep", "model", 38_000, 0.41)]},
        "train_graphs_mb1": {"runs": [_run("ep", "model", 36_000, 0.39)]},
        "train_graphs_interleave": {"runs": [_run("ep", "model", 41_000, 0.44)]},
        "train_graphs_interleave16": {"runs": [_run("ep", "model", 42_400, 0.45)]},
        "train_graphs_interleave_ce_carve16": {"runs": [{**_run("ep", "model", 43_000, 0.46), "profile": {
            "overlap": {"comm_ms": 300.0, "comm_copy_ms": 200.0, "compute_ms": 2000.0,
                        "comm_under_compute_ms": 240.0}}}]},
    }, "on")
    every, bounded, copy_engine = result["interleave_graphs_checks"]
    assert not every["copy_engine"] and not bounded["copy_engine"] and bounded["sm_carveout"] is None
    assert copy_engine["copy_engine"] and copy_engine["comm_sms"] is None and copy_engine["sm_carveout"] == 16
    assert copy_engine["over_dp"] == pytest.approx(1.075) and copy_engine["met"]
    assert copy_engine["hidden"] == pytest.approx(0.8) and every["hidden"] is None  # no profile there
    assert every["comm_sms"] is None and every["over_dp"] == pytest.approx(1.025) and not every["met"]
    assert every["over_unsplit"] == pytest.approx(41 / 36)
    assert bounded["comm_sms"] == 16 and bounded["over_dp"] == pytest.approx(1.06) and bounded["met"]
    out = capsys.readouterr().out
    assert "EP interleaved (16 SMs) 42,400 tok/s/GPU = 1.060x DP, 1.178x unsplit, MFU 45.0%: met" in out
    assert "EP interleaved (every SM, copy engines, GEMMs leave 16 SMs) 43,000 tok/s/GPU = 1.075x DP" in out
    assert "MFU 46.0%, communication 80% hidden: met" in out
    assert "train_graphs_mb1_checks" not in result  # the baseline is checked with the interleaved runs
