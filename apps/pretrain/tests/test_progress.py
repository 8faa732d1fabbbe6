"""What a run prints: step lines with elapsed time and ETA (or a bar), checkpoint notes, the summary."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from pretrain import progress as progress_module
from pretrain.cli import main
from pretrain.progress import Progress, format_duration, progress_line
from pretrain.summary import RunFiles, run_summary


def _record(step: int, **extra) -> dict:
    return {"step": step, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 12345.6,
            "skipped": False, **extra}


def test_progress_line():
    record = _record(3, mfu=0.4, peak_mem_gib=70.25)
    assert progress_line(record, 10) == ("step     3/10  loss 2.5000  lr 1.00e-03  grad_norm 0.500  "
                                         "tok/s 12,346  mfu 40.0%  mem 70.2 GiB")
    assert format_duration(3725.4) == "1:02:05" and format_duration(-1) == "0:00:00"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_carry_elapsed_and_an_eta_without_the_first_step(monkeypatch):
    """Piped: one line per step. The first step (warm-up) costs 5 s, the next 1 s each: the
    ETA after step 1 extrapolates 5 s, from step 2 on 1 s per remaining step."""
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    out = io.StringIO()
    progress = Progress(total_steps=12, last_step=10, start_step=1, stream=out)
    for step, now in [(1, 105.0), (2, 106.0), (3, 107.0)]:
        clock.now = now
        progress.log(_record(step))
    progress.write("a note")
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step     1/12  loss 2.5000")
    assert [line.split("tok/s 12,346  ")[1] for line in lines[:3]] == [
        "elapsed 0:00:05  eta 0:00:45", "elapsed 0:00:06  eta 0:00:08",
        "elapsed 0:00:07  eta 0:00:07"]
    assert lines[3] == "a note"


def test_eta_counts_from_a_resumed_step(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    progress = Progress(total_steps=100, last_step=100, start_step=51, stream=io.StringIO())
    clock.now = 102.0
    progress.log(_record(51))
    clock.now = 104.0
    assert progress.eta_s(52, clock.now) == 2.0 * 48


def test_a_terminal_gets_a_bar_with_notes_above_it():
    out = io.StringIO()
    progress = Progress(total_steps=4, last_step=4, stream=out, bar=True)
    progress.log(_record(1))
    progress.write("saved checkpoint x (0.1 s)")
    progress.log(_record(2))
    progress.close()
    text = out.getvalue()
    assert "saved checkpoint x (0.1 s)\n" in text
    assert re.search(r"2/4 .*\[\d\d:\d\d<\d\d:\d\d, loss 2\.5000  lr", text), text
    assert "elapsed" not in text  # the bar shows tqdm's [elapsed<remaining]


def test_summary_names_results_files_and_next_commands(tmp_path):
    files = RunFiles(tmp_path, tmp_path / "metrics.jsonl", tmp_path / "config.toml",
                     tmp_path / "checkpoints" / "step_0000000003")
    records = [_record(2, mfu=0.9), _record(3, loss=1.25, mfu=0.3, val_loss=1.5)]
    text = run_summary(records, files, total_steps=3, tokens_per_step=256, wall_s=75.0)
    assert text.splitlines()[:2] == [
        "done: step 3, 2 steps in this process, wall time 0:01:15",
        "  loss 1.2500 (step 3)  validation loss 1.5000 (step 3)  tokens 768  mfu 30.0% (mean)"]
    assert f"  checkpoint  {files.checkpoint}" in text
    assert f"  pretrain plot {tmp_path}" in text
    assert f"  pretrain export-hf {files.checkpoint} {tmp_path / 'hf'}" in text
    assert f"pretrain --config {files.config} train.steps=N" in text
    stopped = run_summary(records, files, total_steps=10, tokens_per_step=256, wall_s=1.0)
    assert f"pretrain --config {files.config}   # resume to step 10" in stopped
    traced = RunFiles(tmp_path, files.metrics, files.config, None, tmp_path / "tb", tmp_path / "wb")
    text = run_summary(records, traced, 3, 256, 1.0)
    assert f"  tensorboard {tmp_path / 'tb'}\n  wandb       {tmp_path / 'wb'}\nnext:" in text
    assert f"  tensorboard --logdir {tmp_path / 'tb'}" in text
    without = run_summary(records, RunFiles(tmp_path, files.metrics, files.config, None), 3, 256, 1.0)
    assert "export-hf" not in without and "checkpoint" not in without


def test_a_run_saves_its_last_step_says_so_and_ends_with_the_summary(tmp_path, capsys):
    assert main(["--config", "tiny", f"run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    checkpoint = tmp_path / "checkpoints" / "step_0000000004"
    assert checkpoint.is_dir()
    assert re.search(rf"^saved checkpoint {re.escape(str(checkpoint))} \(\d+\.\d s\)$", out, re.M), out
    assert re.search(r"^step     4/4  loss .*  elapsed \d:\d\d:\d\d  eta 0:00:00$", out, re.M), out
    summary = out[out.index("done: step 4"):]
    assert f"pretrain export-hf {checkpoint} {tmp_path / 'hf'}" in summary


@pytest.mark.parametrize("stop_after", [None, 2])
def test_checkpoint_final_false_keeps_no_weights_unless_stopped(tmp_path, capsys, stop_after):
    extra = [] if stop_after is None else [f"train.stop_after={stop_after}"]
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "checkpoint.final=false", *extra]) == 0
    saved = sorted(p.name for p in Path(tmp_path / "checkpoints").glob("step_*"))
    assert saved == ([] if stop_after is None else ["step_0000000002"])
    assert ("export-hf" in capsys.readouterr().out) == (stop_after is not None)
