"""The embedded default trains: a shortened run must clearly lower the loss."""

import json
import subprocess
import sys

import pytest
from pretrain.config import load_config
from pretrain.train import train


@pytest.mark.slow
def test_shortened_default_run_lowers_loss(tmp_path):
    cfg = load_config("default", [f"run_dir={tmp_path}", "train.steps=30", "optim.warmup_steps=5"])
    history = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 31))
    assert lines == history
    first, last = lines[0]["loss"], lines[-1]["loss"]
    assert first > 5.0  # ~ln(256) at initialisation
    assert last < 0.7 * first, (first, last)
    assert (tmp_path / "config.toml").is_file()
    assert (tmp_path / "checkpoints" / "step_0000000030").is_dir()  # the default keeps its weights


@pytest.mark.multiprocess
def test_unknown_key_fails_with_suggestion(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", "tiny", "train.stpes=3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown config key 'train.stpes'; did you mean 'train.steps'?" in proc.stderr


@pytest.mark.multiprocess
def test_wrong_type_fails(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain", "--config", "tiny", "train.steps=many"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "train.steps expects an integer, got 'many'" in proc.stderr
