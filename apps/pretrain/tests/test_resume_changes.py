"""A resume that changes the step count, the LR or the schedule says so, with the next step's
LR old -> new; keys a resume cannot change stay refused."""

from __future__ import annotations

import json
import math

import pytest
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.config_tree import to_tree
from pretrain.resume_changes import resume_changes


def _cosine(step: int, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """The cosine schedule written out (the oracle for the LR lines)."""
    progress = (min(step, total) - warmup) / (total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_lines_name_changed_keys_and_the_next_steps_lr():
    saved = to_tree(load_config("tiny", ["run_dir=a", "checkpoint.resume=auto"]))
    cfg = load_config("tiny", ["run_dir=b", "checkpoint.resume=none", "train.steps=8",
                               "optim.lr=0.001", "optim.schedule=wsd"])
    lines = resume_changes(saved, cfg, 5)
    wsd = 0.001  # warmup 2, decay over the last round(0.2 * 8) = 2 steps: step 5 is at the peak
    assert lines == [
        "changed since the checkpoint (its config -> this run's):",
        "  optim.lr: 0.003 -> 0.001",
        "  optim.schedule: cosine -> wsd",
        "  train.steps: 4 -> 8",
        f"  lr at step 5: {_cosine(5, 3e-3, 2, 4):.3e} -> {wsd:.3e}",
    ]
    assert resume_changes(saved, load_config("tiny", ["run_dir=b"]), 5) == []  # where, not what


def test_a_key_without_an_lr_effect_is_listed_without_an_lr_line():
    saved = to_tree(load_config("tiny"))
    assert resume_changes(saved, load_config("tiny", ["checkpoint.every=2"]), 3) == [
        "changed since the checkpoint (its config -> this run's):", "  checkpoint.every: 0 -> 2"]


def test_extending_a_finished_run_prints_the_change_and_trains_at_that_lr(tmp_path, capsys):
    assert main(["--config", "tiny", f"run_dir={tmp_path}"]) == 0  # 4 steps, saved at step 4
    capsys.readouterr()
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=8", "optim.lr=0.001"]) == 0
    out = capsys.readouterr().out
    new = _cosine(5, 1e-3, 2, 8)
    assert (f"changed since the checkpoint (its config -> this run's):\n"
            f"  optim.lr: 0.003 -> 0.001\n  train.steps: 4 -> 8\n"
            f"  lr at step 5: {_cosine(5, 3e-3, 2, 4):.3e} -> {new:.3e}\n") in out
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[4]["lr"] == pytest.approx(new, rel=1e-12)
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=9", "optim.lr=0.001"]) == 0
    assert "  train.steps: 8 -> 9\n" in capsys.readouterr().out  # against the newest checkpoint


@pytest.mark.parametrize("override, message", [
    ("train.seq_len=16", "was trained with train.seq_len=32, this run has 16"),
    ("model.rope_theta=500000", "holds a model with model.rope_theta=10000.0, this run has 500000.0"),
])
def test_keys_a_resume_cannot_change_stay_refused(tmp_path, capsys, override, message):
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.stop_after=1"]) == 0
    capsys.readouterr()
    assert main(["--config", "tiny", f"run_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pretrain: error: checkpoint.resume: the checkpoint of step 1 ") and \
        message in err, err
