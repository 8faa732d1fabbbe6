"""GPU runs of the app: GPU-only metrics, and DP2 over NCCL against one GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pretrain.config import load_config
from pretrain.train import train


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu
def test_tiny_on_a_gpu_reports_mfu_and_peak_memory(tmp_path):
    history = train(load_config("tiny", [f"run_dir={tmp_path}", "train.device=cuda"]))
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2, 3, 4]
    for r in history:
        assert not r["skipped"] and 0 < r["mfu"] < 1 and r["peak_mem_gib"] > 0


@pytest.mark.multigpu(2)
def test_dp2_over_nccl_matches_one_gpu(tmp_path):
    common = ["--config", "tiny", "train.device=cuda", "train.compute_dtype=float32"]
    single = train(load_config(common[1], [*common[2:], f"run_dir={tmp_path / 'one'}"]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "pretrain", *common, f"run_dir={tmp_path / 'two'}"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for ours, ref in zip(_metrics(tmp_path / "two"), single, strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-4)
