"""Weights & Biases tracker: each step's scalars, as ``metrics.jsonl`` holds them.

``wandb`` is an optional extra (``uv sync --extra wandb``, ``pip install wandb``),
imported only when ``metrics.wandb=true``. ``metrics.wandb_mode=offline`` writes the
run under ``run_dir/wandb`` without a network (``wandb sync`` uploads it later);
``auto`` leaves the choice to wandb's own settings (``WANDB_MODE``, ``wandb login``).

A run keeps one W&B run across resumes: its id is kept in ``run_dir/wandb_run_id``
and a resumed process continues it. W&B does not rewrite history, so steps a resumed
run redoes after a crash (``metrics.jsonl`` drops them) keep their first values there.
wandb's console capture is off: the progress lines stay the run's own.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pretrain.errors import PretrainError
from pretrain.metrics import scalar_fields

RUN_ID_FILE = "wandb_run_id"


class TrackerError(PretrainError, RuntimeError):
    """A tracker asked for cannot start."""


class WandbTracker:
    """``project``/``name``: the W&B project and run name (``None``: wandb's defaults);
    ``mode``: ``online``, ``offline`` or ``auto``; ``config``: the run's config tree."""

    def __init__(self, run_dir: Path, project: str | None, name: str | None, mode: str,
                 config: Mapping[str, Any]) -> None:
        import wandb  # needs the wandb extra

        id_file = run_dir / RUN_ID_FILE
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # (wandb's own ids: 8 lowercase letters and digits)
            id_file.write_text(run_id + "\n")
        try:
            self._run = wandb.init(
                project=project, name=name, id=run_id, resume="allow", dir=str(run_dir),
                config=dict(config), mode=None if mode == "auto" else mode,
                settings=wandb.Settings(console="off", quiet=True))
        except Exception as e:  # (wandb's errors: no login, no network, a bad project name)
            raise TrackerError(f"metrics.wandb: wandb could not start a run: {e} "
                               "(metrics.wandb_mode=offline needs no network)") from e

    def log(self, record: Mapping[str, Any]) -> None:
        self._run.log(scalar_fields(record), step=record["step"])

    def close(self) -> None:
        self._run.finish()
