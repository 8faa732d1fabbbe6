"""A training run from a config: process group, layout, run directory, checkpoints, loop.

    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data checked, model part built, DDP, optimizer
        checkpoints: resume (checkpoint.resume), then the logging rank writes
        run_dir/config.toml and opens the trackers
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
from moe_model.hf import check_representable

from pretrain.checkpoint import RunCheckpoints
from pretrain.config import ConfigError, PretrainConfig, config_toml, validate_layout
from pretrain.data import document_eos_id, resolve_vocab_size
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


def warn_if_not_exportable(cfg: PretrainConfig) -> None:
    """One line on stderr when ``export-hf`` will refuse the model (told now, not after
    the run)."""
    try:
        check_representable(cfg.model)
    except ValueError as e:
        print(f"warning: export-hf will not be able to write this model: {e}", file=sys.stderr,
              flush=True)


def train(cfg: PretrainConfig) -> list[dict[str, Any]]:
    """Train per ``cfg`` as one rank of the launcher's world; returns this process's records."""
    vocab_note = resolve_vocab_size(cfg)  # model.vocab_size from the data, before the model
    document_eos_id(cfg.data)  # data.document_mask on data without documents: before any output
    with distributed(cfg.train.device) as rt:
        if vocab_note and rt.rank == 0:
            print(vocab_note, flush=True)
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
                logging = mesh.is_logging_rank
                if logging:
                    (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
                    print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                          f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
                    warn_if_not_exportable(cfg)
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
