"""Ctrl-C and SIGTERM on a running training process (one process, and two ranks under torchrun).

The first signal stops after the current step, saves and exits 0; the run resumed from
that checkpoint computes the uninterrupted run's losses. A second signal aborts at once
without a traceback.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.train import train

DEADLINE_S = 180  # to the step line that triggers the signal, then again to the exit
STEPS = 8
REL = 1e-5


class _Lines:
    """A pipe's lines, read by a daemon thread, so that waiting for one can time out."""

    def __init__(self, pipe) -> None:
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, prefix: str, deadline: float) -> bool:
        """Read up to a line starting with ``prefix`` (True) or the end of the pipe (False)."""
        while True:
            line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                return False
            self.seen.append(line)
            if line.startswith(prefix):
                return True

    def rest(self, timeout: float) -> str:
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return "".join(self.seen)


def _start(cmd: list[str]) -> tuple[subprocess.Popen, _Lines, _Lines]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, _Lines(proc.stdout), _Lines(proc.stderr)


def _finish(proc: subprocess.Popen, out: _Lines, err: _Lines) -> tuple[str, str]:
    try:
        proc.wait(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"no exit within {DEADLINE_S} s after the signal: killed it\n"
                    f"{out.rest(5)[-2000:]}\n{err.rest(5)[-2000:]}")
    return out.rest(DEADLINE_S), err.rest(DEADLINE_S)


def _wait_for_step(proc, out: _Lines, err: _Lines, step: int) -> None:
    try:
        if out.wait_for(f"step {step:>5}/", time.monotonic() + DEADLINE_S):
            return
    except queue.Empty:
        pass
    proc.kill()
    proc.wait()
    pytest.fail(f"no 'step {step}' line within {DEADLINE_S} s\n{out.rest(5)[-2000:]}\n"
                f"{err.rest(5)[-2000:]}")


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference")
    return {r["step"]: r["loss"] for r in train(load_config("tiny", [
        f"run_dir={run}", f"train.steps={STEPS}"]))}


def _stopped_step(out: str, reason: str = "received SIGINT") -> int:
    stops = [x for x in out.splitlines() if x.startswith("stopping after step ")]
    assert len(stops) == 1 and stops[0].endswith(f": {reason}"), out[-2000:]
    return int(stops[0].split("stopping after step ")[1].split(":")[0])


def _resume_matches(run: Path, stopped: int, uninterrupted: dict[int, float], capsys) -> None:
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert checkpoints == [f"step_{stopped:010d}"]  # committed (the partial ones are *.partial)
    capsys.readouterr()
    assert main(["--config", "tiny", f"run_dir={run}", f"train.steps={STEPS}"]) == 0
    assert f"resumed after step {stopped}" in capsys.readouterr().out
    losses = _losses(run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in range(stopped + 1, STEPS + 1):
        assert losses[step] == pytest.approx(uninterrupted[step], rel=REL), step


@pytest.mark.timeout(2 * DEADLINE_S + 120)
def test_sigint_stops_saves_exits_0_and_the_run_resumes_exactly(tmp_path, uninterrupted, capsys):
    run = tmp_path / "run"
    proc, out, err = _start([sys.executable, "-m", "pretrain", "--config", "tiny",
                             f"train.steps={STEPS}", f"run_dir={run}"])
    _wait_for_step(proc, out, err, 2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out, err)
    assert proc.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr
    assert "pretrain: received SIGINT: stopping after the current step and saving a checkpoint; " \
           "SIGINT again aborts at once without saving" in stderr
    stopped = _stopped_step(stdout)
    assert 2 <= stopped < STEPS
    assert f"saved checkpoint {run / 'checkpoints' / f'step_{stopped:010d}'}" in stdout
    _resume_matches(run, stopped, uninterrupted, capsys)


@pytest.mark.timeout(DEADLINE_S + 60)
def test_a_second_sigint_aborts_at_once_without_a_traceback(tmp_path):
    proc, out, err = _start([sys.executable, "-m", "pretrain", "--config", "tiny",
                             "train.steps=100000", f"run_dir={tmp_path}"])
    _wait_for_step(proc, out, err, 1)
    proc.send_signal(signal.SIGINT)
    try:
        noted = err.wait_for("pretrain: received SIGINT", time.monotonic() + DEADLINE_S)
    except queue.Empty:
        noted = False
    assert noted, err.rest(5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = _finish(proc, out, err)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr and "stopping after step" not in stdout


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (from /proc: their RANK variable)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher:
            rank = [v for v in env if v.startswith(b"RANK=")]
            if rank:
                ranks[int(rank[0][5:])] = int(entry.name)
    return ranks


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads worker pids from /proc")
@pytest.mark.slow
@pytest.mark.timeout(2 * DEADLINE_S + 180)
def test_sigint_to_one_rank_under_torchrun_stops_every_rank_and_resumes_exactly(
        tmp_path, uninterrupted, capsys):
    """Rank 1 alone gets the signal (rank 0 logs): the flag rides on the step's all-reduce,
    both ranks save the same step and exit 0, and so does the launcher."""
    run = tmp_path / "run"
    proc, out, err = _start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "-m", "pretrain", "--config", "tiny",
                             f"train.steps={STEPS}", f"run_dir={run}"])
    _wait_for_step(proc, out, err, 2)
    workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1], workers
    os.kill(workers[1], signal.SIGINT)
    stdout, stderr = _finish(proc, out, err)
    assert proc.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    stopped = _stopped_step(stdout, "another rank received a stop signal")  # rank 0 prints
    _resume_matches(run, stopped, uninterrupted, capsys)
