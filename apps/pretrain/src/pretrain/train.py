"""A training run from a config: process group, layout, run directory, checkpoints, loop.

    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data checked, model part built, DDP, optimizer
        checkpoints: resume (checkpoint.resume), then the logging rank writes
        run_dir/config.toml and opens the trackers
        trainer.fit(...) under a SIGTERM/SIGINT flag, saving checkpoints on schedule, at the
        end and on stop; the logging rank prints a line per step (pretrain.progress)
        close: the checkpointer waits for its last save, the EP transport is released;
        the logging rank prints the summary (pretrain.summary)
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from moe_model import total_params

from pretrain.checkpoint import RunCheckpoints
from pretrain.config import ConfigError, PretrainConfig, config_toml, validate_layout
from pretrain.config_tree import to_tree
from pretrain.data import resolve_vocab_size
from pretrain.mesh import build_mesh
from pretrain.metrics import METRICS_FILE, MetricsLog, Tracker, WandbOptions, open_trackers
from pretrain.progress import Progress
from pretrain.resume_changes import resume_changes
from pretrain.runtime import distributed
from pretrain.signals import StopRequest
from pretrain.summary import RunFiles, run_summary
from pretrain.trainer import Trainer

CONFIG_FILE = "config.toml"


def _run_dir(cfg: PretrainConfig) -> Path:
    """``run_dir``, or a new timestamped folder chosen by rank 0 and broadcast."""
    choice = [cfg.run_dir or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    path = Path(cfg.run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir={cfg.run_dir!r} is a file, not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def train(cfg: PretrainConfig) -> list[dict[str, Any]]:
    """Train per ``cfg`` as one rank of the launcher's world; returns this process's records."""
    started = time.perf_counter()
    vocab_note = resolve_vocab_size(cfg)  # model.vocab_size from the data, before the model
    with distributed(cfg.train.device) as rt:
        if vocab_note and rt.rank == 0:
            print(vocab_note, flush=True)
        layout = validate_layout(cfg, rt.world_size)
        mesh = build_mesh(layout, rt.device.type)
        run_dir = _run_dir(cfg)
        trainer = Trainer(cfg, mesh, rt.device)
        logging = mesh.is_logging_rank
        last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
        progress: Progress | None = None
        try:
            # the stop flag outlives the checkpointer: a SIGTERM while the last checkpoint
            # is written waits for it (the process would die with it half written)
            with StopRequest(announce=rt.local_rank == 0) as stop, RunCheckpoints(
                    run_dir, cfg, layout, trainer, announce=lambda line: _note(progress, line)) \
                    as checkpoints:
                resumed = checkpoints.resume()
                done = 0 if resumed is None else resumed.step
                if logging:
                    (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
                    print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                          f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
                    if resumed is not None:
                        saved = resumed.metadata["layout"]
                        print(f"resumed after step {done} (checkpoint.resume="
                              f"{cfg.checkpoint.resume}; saved on world {saved['world_size']} = "
                              f"pp {saved['pp']} x dp {saved['dp']}, ep {saved['ep']})", flush=True)
                        for line in resume_changes(resumed.metadata["config"], cfg, done + 1):
                            print(line, flush=True)
                if done >= last:  # (a run sliced by train.stop_after, started again)
                    if logging:
                        option = "train.steps" if last == cfg.train.steps else "train.stop_after"
                        print(f"nothing to train: the checkpoint is at step {done}, "
                              f"{option}={last}", flush=True)
                    return []
                if logging:
                    progress = Progress(cfg.train.steps, last, start_step=done + 1)
                log = MetricsLog(_trackers(cfg, run_dir, done, progress), progress.write) \
                    if progress is not None else MetricsLog([])
                try:
                    history = trainer.fit(log, stop, checkpoints, start_step=done + 1)
                finally:
                    log.close()
            if logging and history:  # (after the checkpointer's close: the last save committed)
                tensorboard, wandb_dir = run_dir / "tensorboard", run_dir / "wandb"
                files = RunFiles(run_dir, run_dir / METRICS_FILE, run_dir / CONFIG_FILE,
                                 None if checkpoints.last_saved is None
                                 else checkpoints.path(checkpoints.last_saved),
                                 tensorboard if tensorboard.is_dir() else None,
                                 wandb_dir if wandb_dir.is_dir() else None)
                print(run_summary(history, files, cfg.train.steps, trainer.tokens_per_step,
                                  time.perf_counter() - started), flush=True)
            return history
        finally:
            trainer.close()


def _trackers(cfg: PretrainConfig, run_dir: Path, done: int, progress: Progress) -> list[Tracker]:
    """The logging rank's trackers: metrics.jsonl, TensorBoard and W&B as configured, then
    the progress lines."""
    m = cfg.metrics
    wandb = WandbOptions(m.wandb_project, m.wandb_name, m.wandb_mode, to_tree(cfg)) \
        if m.wandb else None
    return [*open_trackers(run_dir, m.tensorboard, keep_through=done, wandb=wandb), progress]


def _note(progress: Progress | None, line: str) -> None:
    """A line above the progress bar (or printed plainly before or without one)."""
    if progress is not None:
        progress.write(line)
    else:
        print(line, flush=True)
