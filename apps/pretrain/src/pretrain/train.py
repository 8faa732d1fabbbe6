"""A training run from a config: process group, layout, run directory, checkpoints, loop.

    model shape from model.init_from / checkpoint.init_from, checked (pretrain.init_from)
    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data checked, model part built, DDP, optimizer
        checkpoints: resume (checkpoint.resume), else the weights model.init_from or
        checkpoint.init_from name; then the logging rank writes run_dir/config.toml,
        warns of a model export-hf could not write, and opens the trackers
        trainer.fit(...) under a SIGTERM flag, saving checkpoints on schedule and on stop
        close: the checkpointer waits for its last save, the EP transport is released
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from moe_model import total_params

from pretrain.checkpoint import RunCheckpoints
from pretrain.config import ConfigError, PretrainConfig, config_toml, validate_layout
from pretrain.data import resolve_vocab_size
from pretrain.export import representability_warning
from pretrain.init_from import adopt_source_model, load_initial_weights
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog, open_trackers
from pretrain.runtime import distributed
from pretrain.signals import StopRequest
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
    source_note = adopt_source_model(cfg)  # the model's shape from model/checkpoint.init_from
    vocab_note = resolve_vocab_size(cfg)  # model.vocab_size from the data, before the model
    with distributed(cfg.train.device) as rt:
        for note in (source_note, vocab_note):
            if note and rt.rank == 0:
                print(note, flush=True)
        layout = validate_layout(cfg, rt.world_size)
        mesh = build_mesh(layout, rt.device.type)
        run_dir = _run_dir(cfg)
        trainer = Trainer(cfg, mesh, rt.device)
        try:
            # the stop flag outlives the checkpointer: a SIGTERM while the last checkpoint
            # is written waits for it (the process would die with it half written)
            with StopRequest() as stop, RunCheckpoints(run_dir, cfg, layout, trainer) as checkpoints:
                resumed = checkpoints.resume()
                done = 0 if resumed is None else resumed.step
                weights_note = load_initial_weights(cfg, trainer) if resumed is None else None
                logging = mesh.is_logging_rank
                if logging:
                    (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
                    print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                          f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
                    if weights_note:
                        print(weights_note, flush=True)
                    warning = representability_warning(cfg.model)  # said now, not at export
                    if warning:
                        print(warning, file=sys.stderr, flush=True)
                    if resumed is not None:
                        saved = resumed.metadata["layout"]
                        print(f"resumed after step {done} (checkpoint.resume="
                              f"{cfg.checkpoint.resume}; saved on world {saved['world_size']} = "
                              f"pp {saved['pp']} x dp {saved['dp']}, ep {saved['ep']})", flush=True)
                last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
                if done >= last:  # (a run sliced by train.stop_after, started again)
                    if logging:
                        option = "train.steps" if last == cfg.train.steps else "train.stop_after"
                        print(f"nothing to train: the checkpoint is at step {done}, "
                              f"{option}={last}", flush=True)
                    return []
                trackers = open_trackers(run_dir, cfg.metrics.tensorboard, keep_through=done) \
                    if logging else []
                log = MetricsLog(trackers, cfg.train.steps, echo=logging)
                try:
                    return trainer.fit(log, stop, checkpoints, start_step=done + 1)
                finally:
                    log.close()
        finally:
            trainer.close()
