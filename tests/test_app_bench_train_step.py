"""Smoke test of tools/bench_train_step.py on the CPU: every method (the app's Trainer for DDP
and EP, the FSDP2 baseline) and every routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_testing import load_script, run_distributed

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_train_step.py"


def _tool():
    return load_script(TOOL)


def test_bench_train_step_runs_tiny_on_cpu(tmp_path, capsys):
    bench = _tool()
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    try:
        report = bench.main(["--config", "tiny", "--device", "cpu", "--warmup", "1", "--steps", "2",
                             "--methods", "ddp", "ep", "fsdp2", "--out", str(out),
                             "train.global_batch=2"])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == report
    runs = {(r["method"], r["routing"]): r for r in report["runs"]}
    methods = ("ddp", "ep", "fsdp2")
    assert set(runs) == {(m, r) for m in methods for r in ("model", "balanced", "zipf")}
    for (method, _), r in runs.items():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and len(r["loss"]) == 2
        assert r["phase_ms"]["forward"] > 0 and r["phase_ms"]["backward"] > 0
        assert r["phase_ms"]["optimizer"] > 0
        assert (r["phase_ms"]["weight_rebuild"] > 0) == (method != "fsdp2")  # FSDP2 has none
        assert r["mfu"] is None and r["peak_mem_gib"] is None  # GPU-only figures
    for routing in ("model", "balanced", "zipf"):
        # Same single-process data, model and optimizer policy: the app's DDP and EP paths
        # agree exactly (measured), the FSDP2 baseline to rounding (measured <= 1 ulp).
        ddp, ep, fsdp2 = (runs[m, routing]["loss"] for m in methods)
        assert ep == ddp, (routing, ddp, ep)
        for ours, ref in zip(fsdp2, ddp, strict=True):
            assert abs(ours - ref) <= 1e-6 * abs(ref), (routing, ddp, fsdp2)
    assert runs["ddp", "balanced"]["expert_load_imbalance"] == 1.0  # forced: 2*32*2 slots / 4
    assert runs["ddp", "zipf"]["expert_load_imbalance"] > 1.5
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-10].split()[:2] == ["method", "routing"]
    assert lines[-1].split()[:2] == ["fsdp2", "zipf"]


def test_device_busy_merges_overlapping_kernels_and_counts_launch_gaps():
    bench = _tool()
    # Two streams overlap in [10, 40]; a 5 us gap (back to back) and a 100 us gap (a wait).
    busy = bench.device_busy([(0, 30), (10, 40), (45, 60), (160, 200), (170, 180)])
    assert busy == {"span_ms": 0.2, "busy_ms": 0.095, "idle_ms": 0.105, "gaps": 1, "gap_ms": 0.1}
    assert bench.device_busy([])["span_ms"] == 0.0


def test_comm_overlap_measures_what_of_the_communication_ran_under_compute():
    bench = _tool()
    # Compute: [0, 100] and [150, 250]. Communication: a kernel half under compute [80, 120],
    # a copy wholly under it [160, 200] and one in the open [300, 320]; a kernel overlapping
    # the copy counts once.
    got = bench.comm_overlap([(False, 0, 100, False), (False, 150, 250, False), (True, 80, 120, False),
                              (True, 160, 200, True), (True, 170, 190, False), (True, 300, 320, True)])
    assert got == {"comm_ms": 0.1, "comm_copy_ms": 0.06, "compute_ms": 0.2, "comm_under_compute_ms": 0.06}
    assert bench.comm_overlap([])["comm_ms"] == 0.0


def test_communication_is_told_by_kernel_name():
    bench = _tool()
    names = bench.communication_kernels()
    for kernel in ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "Memcpy PtoP (Device -> Device)",
                   "_put_rows_kernel", "_finish_receive_kernel", "_plan_cells_kernel", "_sum_partials_kernel"):
        assert bench.is_communication(kernel, names), kernel
    for kernel in ("rows_kernel", "_swiglu_forward_kernel", "flash_fwd_kernel", "Memset (Device)"):
        assert not bench.is_communication(kernel, names), kernel


def test_methods_whose_layout_refuses_graphs_run_eagerly_and_say_why(tmp_path):
    """bench-1gpu replays CUDA graphs, and so does EP on the (default) rowwise transport; EP on
    all_to_all and FSDP2 cannot, so their rows must say they ran eagerly rather than fail or be
    compared unlabelled."""
    bench = _tool()
    cuda = torch.device("cuda")  # only decides the EP backend; nothing is allocated
    rowwise = bench.parse_args(["--config", "bench-1gpu", "--methods", "ep"])
    cfg, why = bench.method_config(rowwise, "ep", cuda, 1, tmp_path)
    assert cfg.parallel.resolved_ep_backend(cfg.train.cuda_graphs) == "rowwise" and cfg.train.cuda_graphs and why is None
    a = bench.parse_args(["--config", "bench-1gpu", "--methods", "ddp", "ep", "fsdp2",
                          "--ep-backend", "all_to_all"])
    got = {m: bench.method_config(a, m, cuda, 1, tmp_path) for m in a.methods}
    assert got["ddp"][0].train.cuda_graphs and got["ddp"][1] is None
    assert not got["ep"][0].train.cuda_graphs and "use parallel.ep_backend=rowwise" in got["ep"][1]
    assert not got["fsdp2"][0].train.cuda_graphs and "FSDP2" in got["fsdp2"][1]
    bench.refuse_warmup_before_capture(1, {m: cfg for m, (cfg, _) in got.items()})
    with pytest.raises(SystemExit, match=r"--warmup 0 with train.cuda_graphs \(ddp\)"):
        bench.refuse_warmup_before_capture(0, {m: cfg for m, (cfg, _) in got.items()})


@pytest.mark.multiprocess
def test_a_method_whose_layout_is_refused_fails_after_the_methods_before_it(tmp_path):
    """EP over 2 ranks cannot split 3 experts: DDP before it is still measured and written,
    and the error names EP, so the figure-8 sweep blames the right method."""
    out = tmp_path / "bench.json"
    errors = run_distributed(_refused_second_method, 2, str(out), timeout=300)
    assert all("--methods ep: " in e and "not divisible by parallel.ep=2" in e for e in errors), errors
    report = json.loads(out.read_text())
    assert {r["method"] for r in report["runs"]} == {"ddp"}


def _refused_second_method(out: str) -> str:
    from pretrain.config import ConfigError

    bench = _tool()
    torch.set_num_threads(1)
    try:
        bench.main(["--config", "tiny", "--device", "cpu", "--warmup", "0", "--steps", "1",
                    "--methods", "ddp", "ep", "--routing", "model", "--out", out,
                    "train.global_batch=4", "model.n_experts=3"])
    except ConfigError as e:
        return str(e)
    return "no error"
