"""GPU runs of the app: GPU-only metrics, DP2 over NCCL against one GPU, no host sync in a step,
steps replayed from CUDA graphs against eager ones.

    tools/from_source.sh python3 -m pytest -p moe_testing.pytest_plugin apps/pretrain/tests/test_gpu.py -m "gpu or multigpu"
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from moe_testing import run_distributed, run_process_tree
from pretrain.config import load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.runtime import distributed
from pretrain.train import train
from pretrain.trainer import Trainer

# Widths that torch._grouped_mm takes (16-byte rows), so no expert GEMM reads offsets on the host.
NO_SYNC = ["train.device=cuda", "model.d_model=128", "model.head_dim=32", "model.expert_hidden=128",
           "model.bias_update_rate=0.01", "model.lb_loss_granularity=global_batch",
           "train.steps=8"]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu
def test_tiny_on_a_gpu_reports_mfu_and_peak_memory(tmp_path):
    history = train(load_config("tiny", [f"run_dir={tmp_path}", "train.device=cuda"]))
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]
    for r in history:
        assert not r["skipped"] and 0 < r["mfu"] < 1 and r["peak_mem_gib"] > 0


@pytest.mark.gpu
def test_mxfp8_experts_train_on_a_gpu(tmp_path):
    history = train(load_config("tiny", [f"run_dir={tmp_path}", "train.device=cuda",
                                         "mxfp8.targets=experts", "train.steps=8"]))
    assert all(not r["skipped"] for r in history) and history[-1]["loss"] < history[0]["loss"]


@pytest.mark.gpu
def test_merged_expert_weight_gradients_train_like_unmerged(tmp_path, monkeypatch):
    """Two and four microbatches' expert weight gradients per launch (five microbatches per
    step: a merged window, then what is left of it and the synchronised last one) give the
    losses of one launch per microbatch, in FP32; the launches do merge that many."""
    from moe_model import _grouped_mm_launch

    launch = _grouped_mm_launch.wgrad_accumulate_
    batches_per_launch: list[int] = []

    def counted(*args, more=(), **kwargs):
        batches_per_launch.append(1 + len(more))
        return launch(*args, more=more, **kwargs)

    monkeypatch.setattr(_grouped_mm_launch, "wgrad_accumulate_", counted)
    common = ["train.device=cuda", "train.compute_dtype=float32", "train.global_batch=10", "train.steps=6"]
    runs, widest = {}, {}
    for n in (1, 2, 4):
        batches_per_launch.clear()
        runs[n] = train(load_config("tiny", [*common, f"parallel.merge_expert_grad_microbatches={n}",
                                             f"run_dir={tmp_path / str(n)}"]))
        widest[n] = max(batches_per_launch)
    assert widest == {1: 1, 2: 2, 4: 4}
    for n in (2, 4):
        for merged, plain in zip(runs[n], runs[1], strict=True):
            assert merged["loss"] == pytest.approx(plain["loss"], rel=1e-5), n
    assert runs[1][-1]["loss"] < runs[1][0]["loss"]


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_dp2_and_ep2_over_nccl_match_one_gpu(tmp_path):
    common = ["--config", "tiny", "train.device=cuda", "train.compute_dtype=float32"]
    single = train(load_config(common[1], [*common[2:], f"run_dir={tmp_path / 'one'}"]))
    ep2 = ["parallel.ep=2", "parallel.ep_backend=rowwise"]
    for name, extra in (("dp2", []), ("ep2", ep2), ("ep2-dst", [*ep2, "parallel.ep_combine=destination"]),
                        ("ep2-overlap3", [*ep2, "parallel.ep_overlap_chunks=3"])):
        proc = run_process_tree(  # a hung run's ranks go with it
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "-m", "pretrain", *common, *extra, f"run_dir={tmp_path / name}"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for ours, ref in zip(_metrics(tmp_path / name), single, strict=True):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4), name


def _steady_state_step_syncs(overrides: list[str]) -> list[str]:
    """Run 3 warm-up steps, then one step under sync debug mode "warn": the step's one
    synchronisation is the copy to the host at its end; any other is reported with the
    line of ours that made it."""
    cfg = load_config("tiny", overrides)
    failures = []
    with distributed("cuda") as rt:
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, rt.world_size), "cuda"), rt.device)
        try:
            for step in (1, 2, 3):
                trainer.train_step(step)
                trainer.capture_graphs()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    record = trainer.train_step(4).record
            finally:
                torch.cuda.set_sync_debug_mode(0)
            syncs = [f"{str(w.message).splitlines()[0]} at {Path(w.filename).name}:{w.lineno}"
                     for w in caught if "synchronizing" in str(w.message)]
            if len(syncs) != 1:
                failures.append(f"the step synchronised {len(syncs)} times: {syncs}")
            assert not record["skipped"] and record["peak_mem_gib"] > 0
        finally:
            trainer.close()
    return failures


@pytest.mark.gpu
def test_auto_merge_on_a_gpu_takes_the_most_that_fits():
    """The tiny model's plan fits four merged microbatches on any GPU of a few GiB."""
    cfg = load_config("tiny", ["train.device=cuda", "parallel.merge_expert_grad_microbatches=auto"])
    with distributed("cuda") as rt:
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, rt.world_size), "cuda"), rt.device)
        try:
            assert trainer.cfg.parallel.merge_expert_grad_microbatches == 4
            assert not trainer.train_step(1).record["skipped"]
        finally:
            trainer.close()


@pytest.mark.gpu
def test_a_warmed_up_step_with_local_experts_does_not_sync_the_host():
    assert _steady_state_step_syncs(NO_SYNC) == []


def _ep2_rowwise_syncs() -> list[str]:
    return _steady_state_step_syncs([*NO_SYNC, "parallel.ep=2", "parallel.ep_backend=rowwise"])


@pytest.mark.gpu
def test_a_step_replayed_from_cuda_graphs_does_not_sync_the_host():
    assert _steady_state_step_syncs([*NO_SYNC, "train.cuda_graphs=true",
                                     "parallel.merge_expert_grad_microbatches=2"]) == []


def _train_steps(overrides: list[str], steps: int, between=None) -> tuple[list[dict], Trainer]:
    """``steps`` steps of a one-GPU trainer; ``between(trainer, step)`` before each."""
    cfg = load_config("tiny", overrides)
    with distributed("cuda") as rt:
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, rt.world_size), "cuda"), rt.device)
        try:
            records = []
            for step in range(1, steps + 1):
                if between is not None:
                    between(trainer, step)
                records.append(trainer.train_step(step).record)
                if step < steps:
                    trainer.capture_graphs()
            params = {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()}
        finally:
            trainer.close()
    return records, params


@pytest.mark.gpu
@pytest.mark.parametrize("merge, recompute", [(1, "none"), (2, "none"), (2, "block"), (2, "selective")])
def test_steps_replayed_from_cuda_graphs_train_exactly_like_eager_steps(merge, recompute):
    """Five microbatches per step (merge 2: two middle units replayed, then a last unit of
    one), global-batch balancing with the bias step (the running counts and statistics the
    graphs add into), activation recompute in the backward: the same losses, norms, expert
    loads and weights, bit for bit."""
    common = [*NO_SYNC, "train.global_batch=10", f"parallel.merge_expert_grad_microbatches={merge}",
              f"model.recompute={recompute}"]
    eager, eager_params = _train_steps(common, 6)
    graphed, graphed_params = _train_steps([*common, "train.cuda_graphs=true"], 6)
    for ours, ref in zip(graphed, eager, strict=True):
        for key in ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load"):
            assert ours[key] == ref[key], (ours["step"], key, ours[key], ref[key])
    for name, ref in eager_params.items():
        assert torch.equal(graphed_params[name], ref), name
    assert graphed[-1]["loss"] < graphed[0]["loss"]


def _one_gpu_interleaved(graphs: bool, pairs: bool) -> tuple:
    """Five steps of an EP group of one GPU on NVSHMEM (its own process: a process joins one
    NVSHMEM job), five microbatches a step."""
    overrides = [*NO_SYNC, "train.global_batch=10", "parallel.ep_backend=rowwise",
                 f"parallel.ep_overlap_microbatches={str(pairs).lower()}",
                 f"train.cuda_graphs={str(graphs).lower()}"]
    records, params = _train_steps(overrides, 5)
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load")
    return [tuple(r[k] for k in keys) for r in records], params


def _one_gpu_interleaved_syncs() -> list[str]:
    return _steady_state_step_syncs([*NO_SYNC, "train.cuda_graphs=true", "train.global_batch=12",
                                     "parallel.ep_backend=rowwise", "parallel.ep_overlap_microbatches=true"])


@pytest.mark.multiprocess
@pytest.mark.gpu
def test_interleaved_microbatches_on_one_gpu_replay_like_eager_steps_without_host_syncs():
    """An EP group of one GPU: the transport's kernels run (every row local), the pairs
    interleave on the two streams. Replayed from CUDA graphs (units of one pair) the steps
    equal eager interleaved steps bit for bit, without a host synchronisation; against steps
    one microbatch at a time the losses agree to the last bits the reordered gradient sums
    move."""
    (eager, eager_params), = run_distributed(_one_gpu_interleaved, 1, False, True, backend="nccl", timeout=300)
    (graphed, graphed_params), = run_distributed(_one_gpu_interleaved, 1, True, True, backend="nccl",
                                                 timeout=300)
    assert graphed == eager
    for name, ref in eager_params.items():
        assert torch.equal(graphed_params[name], ref), name
    (plain, _), = run_distributed(_one_gpu_interleaved, 1, False, False, backend="nccl", timeout=300)
    for ours, ref in zip(eager, plain, strict=True):
        assert ours[0] == pytest.approx(ref[0], rel=1e-3)
    assert run_distributed(_one_gpu_interleaved_syncs, 1, backend="nccl", timeout=300) == [[]]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe, gemm, targets, dense_gemm", [
    ("mxfp8", "emulated", "experts", None), ("mxfp8", "emulated", "[experts,attn.w?]", None),
    ("fp8_rowwise", "native", "experts", None),
    ("fp8_rowwise_gw_hp", "native", "experts", None), ("fp8_rowwise", "triton", "experts", None),
    ("fp8_blockwise", "triton", "experts", None),
    ("fp8_rowwise_gw_hp", "native", "[experts,attn.w?,head]", None),
    ("fp8_rowwise_gw_hp", "triton", "[experts,attn.w?,head]", "native"),
    ("fp8_blockwise", "triton", "[experts,attn.w?,head]", None)])
def test_low_precision_experts_replayed_from_cuda_graphs_train_exactly_like_eager(recipe, gemm,
                                                                                  targets, dense_gemm):
    """The weight caches (the experts', and the dense layers' where targeted) refresh in place
    after every update, so the replayed graphs read this step's quantised weights: the same
    losses and weights as eager steps, bit for bit
    (a cache refreshed into new tensors would leave the graphs on the first step's)."""
    if "native" in (gemm, dense_gemm) and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the native FP8 GEMMs need compute capability 9.x")
    if gemm == "triton" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Triton FP8 grouped GEMM needs compute capability 8.9 or up")
    common = [*NO_SYNC, "train.global_batch=8", f"mxfp8.targets={targets}",
              f"mxfp8.recipe={recipe}", f"mxfp8.gemm={gemm}"]
    if dense_gemm is not None:
        common.append(f"mxfp8.dense_gemm={dense_gemm}")
    eager, eager_params = _train_steps(common, 5)
    graphed, graphed_params = _train_steps([*common, "train.cuda_graphs=true"], 5)
    for ours, ref in zip(graphed, eager, strict=True):
        for key in ("loss", "grad_norm"):
            assert ours[key] == ref[key], (ours["step"], key, ours[key], ref[key])
    for name, ref in eager_params.items():
        assert torch.equal(graphed_params[name], ref), name
    assert graphed[-1]["loss"] < graphed[0]["loss"]


@pytest.mark.gpu
def test_a_hook_installed_after_the_capture_takes_effect_in_the_next_step():
    """Graphs replay what they recorded; a routing hook installed after the capture changes
    the model's launch fingerprint, so that step runs eagerly (with the hook) and the
    graphs are captured again."""
    from pretrain.routing_override import force_routing

    def install_balanced(trainer: Trainer, step: int) -> None:
        if step == 3:
            assert trainer.graphs.captured
            force_routing(trainer.model, "balanced")

    records, _ = _train_steps([*NO_SYNC, "train.cuda_graphs=true", "train.global_batch=8"], 5,
                              install_balanced)
    per_expert = 8 * 32 * 2 // 4  # 8 sequences of 32 tokens, top-2 over 4 experts
    balanced = [[per_expert] * 4] * len(records[0]["expert_load"])
    assert records[1]["expert_load"] != balanced
    assert [r["expert_load"] for r in records[2:]] == [balanced] * 3


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_a_warmed_up_ep2_step_on_nvshmem_does_not_sync_the_host():
    assert run_distributed(_ep2_rowwise_syncs, 2, backend="nccl", timeout=300) == [[], []]


@pytest.mark.gpu
def test_phase_timer_host_lead_tells_host_bound_from_device_bound():
    """A device busy with a sleep kernel keeps the host far ahead; tiny kernels launched
    slower than they run leave the host no lead."""
    import time

    from pretrain.phases import PhaseTimer

    timer = PhaseTimer(torch.device("cuda"))
    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    timer.mark("first")  # the first phase is not counted: it starts with nothing queued
    timer.mark("busy")
    torch.cuda._sleep(int(2e8))  # ~0.1 s of device time, enqueued at once
    timer.mark(None)
    torch.cuda.synchronize()
    timer.collect()
    assert timer.min_host_lead_s > 0.05
    timer.mark("first")
    timer.mark("starved")
    for _ in range(5):
        x += 1
        time.sleep(0.01)  # the host is the slow side
        timer.mark("starved")
    timer.mark(None)
    torch.cuda.synchronize()
    timer.collect()
    assert abs(timer.min_host_lead_s) < 0.005


def _two_ranks_steps(overrides: list[str]) -> tuple:
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load")
    records, params = _train_steps(overrides, 6)
    return [tuple(r[k] for k in keys) for r in records], params


EP2 = ["parallel.ep=2", "parallel.ep_backend=rowwise"]


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
@pytest.mark.parametrize("extra", [
    ["parallel.ddp_mode=all_reduce"], ["parallel.ddp_mode=reduce_scatter"],
    EP2, [*EP2, "parallel.ep_combine=destination"], [*EP2, "model.n_layers=1"],
    [*EP2, "model.recompute=block"], [*EP2, "parallel.ep_payload=fp8_rowwise"],
    [*EP2, "parallel.ep_payload=mxfp8"], [*EP2, "parallel.ep_overlap_chunks=2"],
    [*EP2, "parallel.ep_overlap_microbatches=true"],
    [*EP2, "parallel.ep_overlap_microbatches=true", "parallel.ep_copy_engine=true"],
], ids=["dp2-all-reduce", "dp2-reduce-scatter", "ep2", "ep2-dst", "ep2-one-layer", "ep2-recompute",
        "ep2-fp8-payload", "ep2-mxfp8-payload", "ep2-overlap2", "ep2-interleaved", "ep2-interleaved-ce"])
def test_steps_replayed_from_cuda_graphs_on_two_ranks_equal_eager_steps(extra):
    """Five microbatches per rank (two middle units, a last one holding the gradient
    reductions over NCCL), the balancing counts all-reduced in every forward; with EP2 the
    NVSHMEM puts and flag barriers in every unit (one MoE layer: units of an odd number of
    exchanges, rounded up; recompute: the dispatches run again in the backward; overlap:
    two token chunks per layer on two streams, forward and backward captured across them;
    interleaved: microbatches 0-1 and 2-3 in pairs, in units of one pair). The same losses,
    norms, loads and weights as eager steps, bit for bit (a sum of two is exact in any
    order)."""
    common = [*NO_SYNC, "train.global_batch=20", "parallel.merge_expert_grad_microbatches=2", *extra]
    # one process per run: a process joins one NVSHMEM job
    eager_runs = run_distributed(_two_ranks_steps, 2, common, backend="nccl", timeout=300)
    graphed_runs = run_distributed(_two_ranks_steps, 2, [*common, "train.cuda_graphs=true"],
                                   backend="nccl", timeout=300)
    for (eager, eager_params), (graphed, graphed_params) in zip(eager_runs, graphed_runs, strict=True):
        assert graphed == eager
        for name, ref in eager_params.items():
            assert torch.equal(graphed_params[name], ref), name
        assert graphed[-1][0] < graphed[0][0]


def _two_ranks_graphed_syncs(extra: list[str]) -> list[str]:
    return _steady_state_step_syncs([*NO_SYNC, "train.cuda_graphs=true", "train.global_batch=12",
                                     "parallel.merge_expert_grad_microbatches=2", *extra])


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
@pytest.mark.parametrize("extra", [[], EP2, [*EP2, "parallel.ep_payload=fp8_rowwise"],
                                   [*EP2, "parallel.ep_overlap_chunks=2"],
                                   [*EP2, "parallel.ep_overlap_microbatches=true"],
                                   [*EP2, "parallel.ep_overlap_microbatches=true", "parallel.ep_copy_engine=true"]],
                         ids=["dp2", "ep2", "ep2-fp8-payload", "ep2-overlap2", "ep2-interleaved",
                              "ep2-interleaved-ce"])
def test_a_step_replayed_from_cuda_graphs_on_two_ranks_does_not_sync_the_host(extra):
    assert run_distributed(_two_ranks_graphed_syncs, 2, extra, backend="nccl", timeout=300) == [[], []]
