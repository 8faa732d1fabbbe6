"""Parallel layouts, checkpoints and resume through the command line (torchrun, gloo, CPU).

Every layout must compute the same losses as one process: the loss is a token sum
divided by the global batch's token count, initialisation depends only on
parameter names, and the data order only on the step. The ``tiny`` preset's
microbatches (2 sequences) are the same on 1, 2 and 4 data-parallel ranks, so even
the per-microbatch load-balancing loss matches; router bias updates and the z-loss
are on. Global-batch load balancing matches when every rank runs one microbatch
(the EP2 run, against a one-process run of one microbatch), also with each MoE layer's
tokens in 3 pipelined chunks (``parallel.ep_overlap_chunks``: 128 tokens in chunks of 43,
43 and 42). EP2 with microbatches interleaved at the transport
(``parallel.ep_overlap_microbatches``: 4 microbatches of one sequence per rank, the first
two a pair) matches one process running the same 8 microbatches one at a time.

Resume: a DP2 run stops after its step-2 checkpoint (``train.stop_after``: the
process ends as if killed right after the commit, and steps 3-4 never run); runs
resumed from that checkpoint on DP2, EP2, PP2 and one process give the
uninterrupted run's step 3-4 losses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from moe_testing import run_process_tree
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.train import train

TIMEOUT_S = 240
REL = 1e-5
COMMON = ["model.bias_update_rate=0.01", "model.z_loss_coef=0.001"]
ONE_MICROBATCH = ["model.lb_loss_granularity=global_batch"]  # plus micro_batch = global / dp


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _pretrain(n_procs: int, args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(n_procs), "-m", "pretrain", "--config", "tiny", *COMMON, *args]
    proc = run_process_tree(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _assert_losses(run_dir: Path, reference: list[dict], steps: list[int]) -> None:
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == steps  # one rank writes, once per step
    for ours in records:
        ref = reference[ours["step"] - 1]
        assert ours["loss"] == pytest.approx(ref["loss"], rel=REL), ours["step"]
        assert not ours["skipped"]
    if steps[0] == 1:
        assert records[0]["expert_load"] == reference[0]["expert_load"]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """Uninterrupted one-process runs: tiny's 4 microbatches, 8 of one sequence, and one of 8."""
    root = tmp_path_factory.mktemp("reference")
    return {
        "micro": train(load_config("tiny", [*COMMON, f"run_dir={root / 'micro'}"])),
        "micro1": train(load_config("tiny", [*COMMON, "train.micro_batch=1", f"run_dir={root / 'micro1'}"])),
        "global": train(load_config("tiny", [*COMMON, *ONE_MICROBATCH, "train.micro_batch=8",
                                             f"run_dir={root / 'global'}"])),
    }


@pytest.fixture(scope="module")
def dp2_stopped(tmp_path_factory, references) -> Path:
    """A DP2 run that ends right after committing its step-2 checkpoint."""
    run = tmp_path_factory.mktemp("dp2") / "run"
    proc = _pretrain(2, ["checkpoint.every=2", "train.stop_after=2", f"run_dir={run}"])
    assert "world 2 = pp 1 x dp 2 (dp = ep 1 x ep_dp 2); microbatches per rank: 2" in proc.stdout
    assert "\nstopping after step 2: train.stop_after\n" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_0000000002"]
    _assert_losses(run, references["micro"], [1, 2])
    return run


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_resumes_its_own_checkpoint(dp2_stopped, references):
    proc = _pretrain(2, [f"run_dir={dp2_stopped}"])  # checkpoint.resume=auto
    assert "resumed after step 2 (checkpoint.resume=auto" in proc.stdout
    assert len([x for x in proc.stdout.splitlines() if x.startswith("step ")]) == 2  # one rank prints
    _assert_losses(dp2_stopped, references["micro"], [1, 2, 3, 4])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("n_procs, overrides, reference, layout", [
    (2, ["parallel.ep=2", "train.micro_batch=4", *ONE_MICROBATCH], "global",
     "world 2 = pp 1 x dp 2 (dp = ep 2 x ep_dp 1); microbatches per rank: 1"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], "micro",
     "world 2 = pp 2 x dp 1 (dp = ep 1 x ep_dp 1); microbatches per rank: 4"),
    (4, ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.ddp_mode=all_reduce"], "micro",
     "world 4 = pp 2 x dp 2 (dp = ep 1 x ep_dp 2); microbatches per rank: 2"),
    (4, ["parallel.ep=2", "parallel.ep_backend=rowwise", "parallel.ep_combine=destination",
         "parallel.ep_copy_engine=true"], "micro",
     "world 4 = pp 1 x dp 4 (dp = ep 2 x ep_dp 2); microbatches per rank: 1"),
    (2, ["parallel.ep=2", "parallel.ep_backend=rowwise", "parallel.ep_overlap_chunks=3",
         "train.micro_batch=4", *ONE_MICROBATCH], "global",
     "world 2 = pp 1 x dp 2 (dp = ep 2 x ep_dp 1); microbatches per rank: 1"),
    (2, ["parallel.ep=2", "parallel.ep_backend=rowwise", "parallel.ep_overlap_microbatches=true",
         "train.micro_batch=1"], "micro1",
     "world 2 = pp 1 x dp 2 (dp = ep 2 x ep_dp 1); microbatches per rank: 4"),
], ids=["ep2", "pp2", "dp2xpp2", "ep2xdp2", "ep2-overlap3", "ep2-interleaved"])
def test_layouts_match_one_process(tmp_path, references, n_procs, overrides, reference, layout):
    proc = _pretrain(n_procs, [*overrides, f"run_dir={tmp_path}"])
    assert layout in proc.stdout
    _assert_losses(tmp_path, references[reference], [1, 2, 3, 4])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("n_procs, overrides", [
    (2, ["parallel.ep=2"]), (2, ["parallel.pp=2"]), (1, []),
], ids=["dp2-to-ep2", "dp2-to-pp2", "dp2-to-one-process"])
def test_resume_on_another_layout(tmp_path, dp2_stopped, references, n_procs, overrides, capsys):
    checkpoint = dp2_stopped / "checkpoints" / "step_0000000002"
    args = [*overrides, f"checkpoint.resume={checkpoint}", f"run_dir={tmp_path}"]
    if n_procs == 1:
        assert main(["--config", "tiny", *COMMON, *args]) == 0
        out = capsys.readouterr().out
    else:
        out = _pretrain(n_procs, args).stdout
    assert "resumed after step 2" in out and "saved on world 2 = pp 1 x dp 2, ep 1" in out
    _assert_losses(tmp_path, references["micro"], [3, 4])


@pytest.mark.multiprocess
def test_resume_refuses_a_different_data_stream_or_a_used_run_dir(tmp_path, dp2_stopped, capsys):
    checkpoint = dp2_stopped / "checkpoints" / "step_0000000002"
    assert main(["--config", "tiny", *COMMON, "train.global_batch=16", f"run_dir={tmp_path}",
                 f"checkpoint.resume={checkpoint}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("pretrain: error: checkpoint.resume: the checkpoint of step 2 was trained with "
                   "train.global_batch=8, this run has 16; the data position would not carry over")
    assert main(["--config", "tiny", *COMMON, f"run_dir={dp2_stopped}", "checkpoint.resume=none"]) == 2
    err = capsys.readouterr().err.strip()
    # (steps [2, 4] once test_dp2_resumes_its_own_checkpoint trained it on and saved its end)
    assert "checkpoint.resume=none, but" in err and re.search(r"already holds checkpoints \(steps \[2(, 4)?\]\)", err), err


@pytest.mark.multiprocess
@pytest.mark.parametrize("overrides, message", [
    (["model.tie_embeddings=true"], "holds a model with model.tie_embeddings=False, this run has True"),
    # every tensor of the same shape, other rotary frequencies (a shape change fails the load)
    (["model.rope_theta=500000"], "model.rope_theta=10000.0, this run has 500000.0"),
    (["model.bias_update_rate=0"], r"no place for 2 tensor\(s\) of the checkpoint of step 2 \(buffer/"
                                   r"blocks.0.mlp.router.expert_bias, buffer/blocks.1.mlp.router.expert_bias\)"),
], ids=["tied-head", "same-shapes-other-rope", "router-bias-dropped"])
def test_resume_refuses_a_model_that_would_read_the_checkpoint_differently(
        tmp_path, dp2_stopped, capsys, overrides, message):
    checkpoint = dp2_stopped / "checkpoints" / "step_0000000002"
    assert main(["--config", "tiny", *COMMON, *overrides, f"run_dir={tmp_path}",
                 f"checkpoint.resume={checkpoint}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain: error: checkpoint.resume: ") and re.search(message, err), err
