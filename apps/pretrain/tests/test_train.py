"""The training run through its entry points: outputs, DP2 under torchrun, skips, SIGTERM, errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from pretrain.cli import main
from pretrain.config import OptimConfig, load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog
from pretrain.runtime import distributed
from pretrain.schedule import lr_at
from pretrain.signals import StopRequest
from pretrain.train import train
from pretrain.trainer import Trainer, TrainingAborted

RECORD_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "skipped",
               "lb_loss", "z_loss", "expert_load_imbalance", "dropped_token_rate", "expert_load"}


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_writes_config_and_metrics(tmp_path):
    history = train(load_config("tiny", [f"run_dir={tmp_path}"]))
    records = _metrics(tmp_path)
    assert records == history and [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert RECORD_KEYS <= set(r), RECORD_KEYS - set(r)
        assert r["skipped"] is False and np.isfinite(r["loss"]) and r["dropped_token_rate"] == 0.0
        assert len(r["expert_load"]) == 2 and sum(r["expert_load"][0]) == 4 * 32 * 2  # tokens x top_k
    assert records[-1]["loss"] < records[0]["loss"]
    assert load_config(str(tmp_path / "config.toml")) == load_config("tiny", [f"run_dir={tmp_path}"])


def test_router_bias_steps_once_per_optimizer_step(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "model.bias_update_rate=0.01"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        record = trainer.step(1)
    for (_, layer), load in zip(trainer.model.moe_layers(), record["expert_load"], strict=True):
        load_E = torch.tensor(load, dtype=torch.float32)
        expected = 0.01 * torch.sign(load_E.mean() - load_E)
        assert torch.equal(layer.router.expert_bias, expected)


def test_dp2_under_torchrun_matches_one_process(tmp_path):
    """Two ranks read disjoint halves of each global batch and sum gradients: same losses.

    Global-batch load balancing and the routers' bias step both need the expert load
    summed over DP; with one microbatch per rank on each side they see the same tokens.
    """
    balance = ["model.lb_loss_granularity=global_batch", "model.bias_update_rate=0.01"]
    reference = train(load_config("tiny", [*balance, "train.micro_batch=4",
                                           f"run_dir={tmp_path / 'one'}"]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pretrain", "--config", "tiny", *balance, f"run_dir={tmp_path / 'two'}"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2 = pp 1 x dp 2 (dp = ep 1 x ep_dp 2); microbatches per rank: 1" in proc.stdout
    progress = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 4  # one rank prints
    records = _metrics(tmp_path / "two")
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # one rank writes
    for ours, ref in zip(records, reference):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["expert_load"] == ref["expert_load"]


def _trainer(cfg):
    return Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))


class _Collect:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


def test_non_finite_steps_are_skipped_and_abort_after_the_limit(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=10",
                               "train.max_consecutive_skips=3"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        with torch.no_grad():
            trainer.model.norm.weight[0] = float("nan")  # every logit becomes NaN
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        collect = _Collect()
        with pytest.raises(TrainingAborted) as e, StopRequest() as stop:
            trainer.fit(MetricsLog([collect], 10, echo=False), stop)
    assert "3 consecutive steps (to step 3) had a non-finite loss or gradient norm" in str(e.value)
    assert "train.max_consecutive_skips" in str(e.value)
    assert [r["skipped"] for r in collect.records] == [True, True, True]
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]) or name == "norm.weight", name


def test_a_skipped_step_leaves_weights_and_counter_recovers(tmp_path, monkeypatch):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=6",
                               "train.max_consecutive_skips=3"])
    with distributed("cpu"):
        trainer = _trainer(cfg)
        clip, calls = trainer._clip, []

        def flaky_clip() -> float:
            calls.append(1)
            return float("inf") if len(calls) in (2, 3) else clip()

        monkeypatch.setattr(trainer, "_clip", flaky_clip)
        trainer.step(1)
        after_1 = [p.detach().clone() for p in trainer.model.parameters()]
        assert trainer.step(2)["skipped"] and trainer.step(3)["skipped"]
        assert all(torch.equal(a, p) for a, p in zip(after_1, trainer.model.parameters()))
        assert not trainer.step(4)["skipped"]
        assert not all(torch.equal(a, p) for a, p in zip(after_1, trainer.model.parameters()))
        calls.clear()
        with StopRequest() as stop:  # two skips in a row, then fine: the limit of 3 is not hit
            records = trainer.fit(MetricsLog([], 6, echo=False), stop)
    assert [r["skipped"] for r in records] == [False, True, True, False, False, False]


class _SigtermAt(_Collect):
    """A tracker that sends this process SIGTERM while logging step ``at``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at

    def log(self, record) -> None:
        super().log(record)
        if record["step"] == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_at_the_next_step_boundary(tmp_path, capsys):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=1000"])
    previous = signal.getsignal(signal.SIGTERM)
    with distributed("cpu"):
        trainer = _trainer(cfg)
        tracker = _SigtermAt(2)
        with StopRequest() as stop:
            records = trainer.fit(MetricsLog([tracker], 1000, echo=False), stop)
    assert [r["step"] for r in records] == [1, 2] == [r["step"] for r in tracker.records]
    assert capsys.readouterr().out.strip() == "stopping after step 2: received SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler was removed


@pytest.mark.parametrize("overrides, status, message", [
    (["parallel.pp=3"], 2, "world size 1 is not divisible by parallel.pp=3"),
    (["parallel.ep=2"], 2, "parallel.ep=2 does not divide the data-parallel size 1"),
    (["optim.name=muon"], 2, "not available in this build yet: optim.name=muon"),
    (["data.path=/no/such/dir"], 1, "data.path '/no/such/dir' does not exist"),
    (["train.seq_len=1000000000"], 1, "fewer than one sequence of train.seq_len + 1"),
])
def test_bad_runs_exit_with_one_line(tmp_path, capsys, overrides, status, message):
    assert main(["--config", "tiny", f"run_dir={tmp_path}", *overrides]) == status
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain: error: ") and "\n" not in err and message in err, err


def test_token_ids_beyond_the_vocab_exit_with_the_file_name(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    ids = np.arange(4000, dtype="<u2") % 256
    ids[1234] = 4321
    (data / "shard.bin").write_bytes(ids.tobytes())
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'run'}", f"data.path={data}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"pretrain: error: {data / 'shard.bin'}: token id 4321 at position 1234 is >= "
                   "model.vocab_size=256")


def test_lr_schedules():
    cos = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(1, cos, 100) == pytest.approx(0.1) and lr_at(10, cos, 100) == 1.0
    assert lr_at(55, cos, 100) == pytest.approx(0.55) and lr_at(100, cos, 100) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, wsd, 100) for s in (50, 80)] == [1.0, 1.0]
    assert lr_at(90, wsd, 100) == pytest.approx(0.5) and lr_at(100, wsd, 100) == 0.0
    const = OptimConfig(lr=2.0, warmup_steps=0, schedule="constant")
    assert lr_at(1, const, 10) == lr_at(10, const, 10) == 2.0
