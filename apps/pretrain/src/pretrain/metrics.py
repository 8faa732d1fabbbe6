"""Per-step metrics: pluggable trackers and the JSONL file.

Only the logging rank (the last pipeline stage's DP rank 0) opens trackers and
prints; the record it receives is already reduced over the ranks. A tracker is
anything with ``log(record)`` and ``close()``: ``metrics.jsonl`` is always
written (it is what ``pretrain plot`` and the tests read); TensorBoard and
Weights & Biases are optional extras, imported only when asked for, log the same
scalars (``scalar_fields``), and their absence costs one line of warning (with
the command that installs them) rather than the run.

Record fields (one JSON object per optimizer step; absent means not measured):
``step``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_s`` (all ranks),
``step_time_s``, ``skipped`` (non-finite loss or gradient: no update),
``lb_loss`` / ``z_loss`` (unweighted, per token, averaged over MoE layers; a
uniform load gives ``lb_loss`` 1), ``expert_load_imbalance`` (worst layer's
max/mean tokens per expert), ``dropped_token_rate`` (routed slots
no expert processed), on GPU ``mfu`` and ``peak_mem_gib``, and at step 1 and
every ``metrics.expert_load_every`` steps ``expert_load`` (tokens per expert, one
list per MoE layer), on evaluation steps (``eval.every`` and the run's last)
``val_loss`` (mean loss per target token of the held-out windows of
``data.val_path``) and ``val_ppl`` (its ``exp``). Non-finite floats are written as ``null``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from pretrain.errors import PretrainError

METRICS_FILE = "metrics.jsonl"


class Tracker(Protocol):
    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _finite_or_none(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


class JsonlTracker:
    """Appends one JSON object per step to ``run_dir/metrics.jsonl`` (line-buffered).

    ``keep_through``: the step the run starts after (a resumed run's checkpoint,
    0 for a fresh one). Records of later steps, written by the run before it
    stopped or crashed, are dropped, so the file always holds one trajectory.
    """

    def __init__(self, run_dir: Path, keep_through: int | None = None) -> None:
        self.path = run_dir / METRICS_FILE
        with _written(self.path, "opening it"):
            if keep_through is not None and self.path.is_file():
                kept = [line for line in _records(self.path)
                        if json.loads(line)["step"] <= keep_through]
                tmp = self.path.with_name(METRICS_FILE + ".tmp")  # a crash here keeps the old file
                tmp.write_text("".join(line + "\n" for line in kept))
                tmp.replace(self.path)
            self._file: TextIO = self.path.open("a", buffering=1)

    def log(self, record: Mapping[str, Any]) -> None:
        with _written(self.path, f"writing step {record['step']}"):
            self._file.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        with _written(self.path, "closing it"):
            self._file.close()


class MetricsError(PretrainError):
    """The metrics file cannot be read or written (a full disk, a file that is not text)."""


@contextmanager
def _written(path: Path, doing: str) -> Iterator[None]:
    """An ``OSError`` (a full disk) or undecodable bytes as one line naming ``path``. The run
    ends there: the checkpoints before it are intact and the same command resumes."""
    try:
        yield
    except OSError as e:
        raise MetricsError(f"{path}: {doing} failed: {e.strerror or e}; make room and run the "
                           "same command again (it resumes from the last checkpoint)") from None
    except UnicodeDecodeError as e:
        raise MetricsError(f"{path}: not a metrics file (not UTF-8 text: byte {e.start}); move it "
                           "away to start a new one") from None


def _records(path: Path) -> list[str]:
    """The JSON lines of ``path``; a line that does not parse (a record being written when
    the run was killed) is dropped with a warning, as the truncation drops later steps."""
    lines = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            if isinstance(json.loads(line).get("step"), int):
                lines.append(line)
                continue
        except (json.JSONDecodeError, AttributeError):
            pass
        print(f"pretrain: warning: {path}:{n}: not a complete record (written when the run "
              "stopped?); dropped", file=sys.stderr, flush=True)
    return lines


def scalar_fields(record: Mapping[str, Any]) -> dict[str, float | int]:
    """The record's scalars as the trackers log them: every finite number (a flag as 0 or
    1), without ``step`` (their x axis) and the per-expert lists."""
    return {key: int(value) if isinstance(value, bool) else value
            for key, value in record.items()
            if key != "step" and isinstance(value, (bool, int, float))
            and (not isinstance(value, float) or math.isfinite(value))}


class TensorBoardTracker:
    """Scalar fields as TensorBoard scalars under ``run_dir/tensorboard``; with
    ``keep_through`` (as for the JSONL file), events of later steps are purged."""

    def __init__(self, run_dir: Path, keep_through: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard extra

        purge = None if keep_through is None else keep_through + 1
        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def log(self, record: Mapping[str, Any]) -> None:
        for key, value in scalar_fields(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self._writer.close()


# the install commands of the optional trackers: the uv workspace's extra, then pip
INSTALL_HINTS = {
    "tensorboard": "uv sync --extra tensorboard, or pip install tensorboard",
    "wandb": "uv sync --extra wandb, or pip install wandb",
}


def _missing(option: str, package: str) -> None:
    print(f"pretrain: warning: {option}=true but {package} is not installed "
          f"(install it: {INSTALL_HINTS[package]}); logging to metrics.jsonl without it",
          file=sys.stderr, flush=True)


@dataclass(frozen=True)
class WandbOptions:
    """``metrics.wandb_project``, ``wandb_name``, ``wandb_mode`` and the run's config tree."""

    project: str | None
    name: str | None
    mode: str
    config: Mapping[str, Any]


def open_trackers(run_dir: Path, tensorboard: bool, keep_through: int | None = None,
                  wandb: WandbOptions | None = None) -> list[Tracker]:
    """The JSONL tracker (see ``keep_through`` there), plus TensorBoard and Weights & Biases
    (``pretrain.wandb_tracker``) when asked for and installed."""
    trackers: list[Tracker] = [JsonlTracker(run_dir, keep_through)]
    if tensorboard:
        try:
            trackers.append(TensorBoardTracker(run_dir, keep_through))
        except ImportError:
            _missing("metrics.tensorboard", "tensorboard")
    if wandb is not None:
        from pretrain.wandb_tracker import WandbTracker

        try:
            trackers.append(WandbTracker(run_dir, wandb.project, wandb.name, wandb.mode,
                                         wandb.config))
        except ImportError:
            _missing("metrics.wandb", "wandb")
    return trackers


def _print(line: str) -> None:
    print(line, flush=True)


class MetricsLog:
    """Fans each step's record out to the trackers (the progress lines are one:
    ``pretrain.progress``); ``note`` prints a line about the run (above a progress bar:
    ``Progress.write``)."""

    def __init__(self, trackers: list[Tracker], note: Callable[[str], None] = _print) -> None:
        self.trackers, self.note = trackers, note

    def write(self, record: Mapping[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(record)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
