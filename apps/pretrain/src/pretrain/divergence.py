"""Non-finite steps: counting them, which states a checkpoint may hold, and not diverging twice.

A step whose gradient norm is not finite is skipped on the device (weights, optimizer
state and router bias stay as they were). ``SkipGuard`` follows the skips of one run:

- ``observe``: counts skips in a row and raises ``TrainingAborted`` after
  ``train.max_consecutive_skips`` of them.
- A skipped step is never checkpointed (the loop asks ``checkpointable``): a restart
  then returns to a state from before the trouble, not to one that the next abort
  would save over, and the count a checkpoint records is the one it resumes with.
- ``clean_step``: the newest checkpoint with no skipped step since the checkpoint
  before it. Retention keeps it whatever ``checkpoint.keep_last`` says, so
  intermittent skips that never reach the limit cannot push the last good
  checkpoint out.

A run aborted for divergence leaves ``run_dir/diverged.json`` (the step, the
checkpoint a restart returns to and the learning rates). Running the same command
again would replay the same steps from that checkpoint into the same divergence, so
``check_restart`` refuses it, naming the step it would return to, unless a learning
rate changed or ``train.allow_resume_after_divergence=true``. The file goes away
once a checkpoint of the step that diverged, or a later one, is committed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pretrain.config import PretrainConfig
from pretrain.errors import PretrainError

MARKER = "diverged.json"
METADATA_KEY = "divergence"


class TrainingAborted(PretrainError, RuntimeError):
    """The run cannot continue (too many consecutive non-finite steps); ``step`` is the last."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class SkipGuard:
    """Consecutive skipped steps and the newest clean checkpoint of one run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0
        self.skipped_since_save = False
        self.clean_step: int | None = None

    def observe(self, record: dict[str, Any]) -> None:
        """Count ``record``'s step; raise ``TrainingAborted`` at the limit."""
        if not record["skipped"]:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.skipped_since_save = True
        if self.consecutive >= self.limit:
            raise TrainingAborted(
                f"{self.consecutive} consecutive steps (to step {record['step']}) had a non-finite "
                f"gradient norm (loss {record['loss']}, grad_norm {record['grad_norm']}); aborting "
                "(train.max_consecutive_skips); lower optim.lr or check the data", record["step"])

    @staticmethod
    def checkpointable(record: dict[str, Any]) -> bool:
        return not record["skipped"]

    def saved(self, step: int) -> dict[str, Any]:
        """A checkpoint of ``step`` is being taken: its metadata entry (the clean step after it)."""
        if not self.skipped_since_save:
            self.clean_step = step
        self.skipped_since_save = False
        return {"consecutive_skips": self.consecutive, "clean_step": self.clean_step}

    def resumed(self, step: int, saved: dict[str, Any] | None) -> None:
        """Continue the counts of the checkpoint of ``step`` (``saved``: its metadata entry;
        ``None`` in checkpoints older than it, which were taken as clean)."""
        saved = saved or {"consecutive_skips": 0, "clean_step": step}
        self.consecutive = int(saved["consecutive_skips"])
        self.clean_step = saved["clean_step"]
        self.skipped_since_save = False


def _learning_rates(cfg: PretrainConfig) -> dict[str, float]:
    return {"optim.lr": cfg.optim.lr, "optim.muon_lr": cfg.optim.muon_lr}


def record_divergence(run_dir: Path, cfg: PretrainConfig, step: int, return_step: int | None) -> None:
    """Leave the marker of an aborted run (rank 0)."""
    marker = {"step": step, "return_step": return_step, **_learning_rates(cfg)}
    try:
        (run_dir / MARKER).write_text(json.dumps(marker) + "\n")
    except OSError as e:  # (a full disk): the abort's own message matters more
        print(f"warning: {run_dir / MARKER} could not be written ({e.strerror}): a rerun will "
              "not know this run diverged", file=sys.stderr, flush=True)


def check_restart(run_dir: Path, cfg: PretrainConfig, return_step: int | None) -> str | None:
    """Refuse (raise ``TrainingAborted``) to rerun a diverged run unchanged; else a note to print
    when it continues after a divergence, ``None`` when there was none."""
    path = run_dir / MARKER
    if not path.is_file():
        return None
    try:
        marker = json.loads(path.read_text())
        diverged = int(marker["step"])
        rates = {key: float(marker[key]) for key in _learning_rates(cfg)}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PretrainError(f"{path}: unreadable divergence record ({e}); remove it to "
                            "continue the run") from None
    where = f"the checkpoint of step {return_step}" if return_step is not None else "step 0"
    changed = [f"{key}={value:g} (was {rates[key]:g})"
               for key, value in _learning_rates(cfg).items() if value != rates[key]]
    if changed:
        return f"continuing after the divergence at step {diverged} from {where}: {', '.join(changed)}"
    if cfg.train.allow_resume_after_divergence:
        return (f"continuing after the divergence at step {diverged} from {where} on the same "
                "settings (train.allow_resume_after_divergence=true)")
    raise TrainingAborted(
        f"{run_dir} aborted at step {diverged} with non-finite steps; running it again would "
        f"return to {where} and repeat them: change optim.lr, or set "
        "train.allow_resume_after_divergence=true to retry as it is", diverged)


def clear_after(run_dir: Path, step: int) -> None:
    """A checkpoint at or beyond the diverged step was committed: the marker has done its job
    (rank 0)."""
    path = run_dir / MARKER
    try:
        diverged = int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if step >= diverged:  # (the diverged step itself, finite this time)
        path.unlink(missing_ok=True)
