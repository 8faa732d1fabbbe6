"""The lines a run ends with: what it reached, where its files are, what to run next."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.progress import format_duration

VALIDATION_KEY = "val_loss"  # a record's validation loss, when the run measures one


@dataclass(frozen=True)
class RunFiles:
    run_dir: Path
    metrics: Path
    config: Path
    checkpoint: Path | None  # the newest checkpoint this process committed
    tensorboard: Path | None = None  # the TensorBoard log folder, when written
    wandb: Path | None = None  # the W&B runs' folder, when written


def _last_with(records: Sequence[Mapping[str, Any]], key: str) -> Mapping[str, Any] | None:
    return next((r for r in reversed(records) if r.get(key) is not None), None)


def run_summary(records: Sequence[Mapping[str, Any]], files: RunFiles, total_steps: int,
                tokens_per_step: int, wall_s: float) -> str:
    """The summary of this process's ``records`` (at least one) of a run of ``total_steps``
    (``train.steps``); ``wall_s``: the process's time from the start of ``train`` (setup
    included)."""
    last = records[-1]
    step = last["step"]
    lines = [f"done: step {step}, {len(records)} steps in this process, wall time "
             f"{format_duration(wall_s)}"]
    loss = _last_with(records, "loss")
    results = [f"loss {loss['loss']:.4f} (step {loss['step']})" if loss else "loss not finite"]
    validation = _last_with(records, VALIDATION_KEY)
    if validation is not None:
        results.append(f"validation loss {validation[VALIDATION_KEY]:.4f} "
                       f"(step {validation['step']})")
    results.append(f"tokens {step * tokens_per_step:,}")
    measured = records[1:] or records  # the first step warms up
    mfu = [r["mfu"] for r in measured if r.get("mfu") is not None]
    if mfu:
        results.append(f"mfu {100 * sum(mfu) / len(mfu):.1f}% (mean)")
    lines.append("  " + "  ".join(results))
    lines.append(f"  metrics     {files.metrics}")
    lines.append(f"  config      {files.config}")
    if files.checkpoint is not None:
        lines.append(f"  checkpoint  {files.checkpoint}")
    if files.tensorboard is not None:
        lines.append(f"  tensorboard {files.tensorboard}")
    if files.wandb is not None:
        lines.append(f"  wandb       {files.wandb}")
    lines.append("next:")
    run_dir = shlex.quote(str(files.run_dir))
    lines.append(f"  pretrain plot {run_dir}")
    if files.tensorboard is not None:
        lines.append(f"  tensorboard --logdir {shlex.quote(str(files.tensorboard))}")
    if files.checkpoint is not None:
        lines.append(f"  pretrain export-hf {shlex.quote(str(files.checkpoint))} "
                     f"{shlex.quote(str(files.run_dir / 'hf'))}")
        again = f"  pretrain --config {shlex.quote(str(files.config))}"
        lines.append(f"{again}   # resume to step {total_steps}" if step < total_steps else
                     f"{again} train.steps=N   # train on from the checkpoint")
    return "\n".join(lines)
