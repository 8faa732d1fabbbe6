"""A training run from a config: process group, layout, run directory, checkpoints, loop.

    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data checked, model part built, DDP, optimizer
        run_dir created and locked (pretrain.run_dir): nothing is written before this
        checkpoints: a diverged run is not repeated (pretrain.divergence), resume
        (checkpoint.resume), then the logging rank writes run_dir/config.toml and opens
        the trackers
        trainer.fit(...) under a SIGTERM flag, saving checkpoints on schedule and on stop
        close: the checkpointer waits for its last save, the lock is released, the EP
        transport is released
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
from moe_model import total_params

from pretrain import divergence
from pretrain.checkpoint import RunCheckpoints
from pretrain.config import PretrainConfig, config_toml, validate_layout
from pretrain.data import resolve_vocab_size
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog, open_trackers
from pretrain.run_dir import choose_run_dir, held_run_dir
from pretrain.runtime import decided_on_rank_0, distributed
from pretrain.signals import StopRequest
from pretrain.trainer import Trainer

CONFIG_FILE = "config.toml"


@contextmanager
def _divergence_recorded(run_dir: Path, cfg: PretrainConfig, checkpoints: RunCheckpoints) -> Iterator[None]:
    """Report what a run that did not end cleanly left, refuse to repeat a divergence
    (``pretrain.divergence``) and record one that aborts the run."""
    if dist.get_rank() == 0:
        checkpoints.report_recovery()
    if cfg.checkpoint.resume == "auto":
        note = decided_on_rank_0(lambda: divergence.check_restart(
            run_dir, cfg, checkpoints.checkpointer.latest_step()))
        if note:
            print(note, flush=True)
    try:
        yield
    except divergence.TrainingAborted as e:
        checkpoints.close()  # (the last save commits first)
        if dist.get_rank() == 0:
            divergence.record_divergence(run_dir, cfg, e.step, checkpoints.checkpointer.latest_step())
        raise


def train(cfg: PretrainConfig) -> list[dict[str, Any]]:
    """Train per ``cfg`` as one rank of the launcher's world; returns this process's records."""
    vocab_note = resolve_vocab_size(cfg)  # model.vocab_size from the data, before the model
    # the stop flag outlives the checkpointer and the teardown: a SIGTERM while the last
    # checkpoint is written waits for it (the process would die with it half written), one
    # while the process group is taken down leaves a finished run finished
    with StopRequest() as stop, distributed(cfg.train.device, cfg.train.collective_timeout_s) as rt:
        if vocab_note and rt.rank == 0:
            print(vocab_note, flush=True)
        layout = validate_layout(cfg, rt.world_size)
        mesh = build_mesh(layout, rt.device.type)
        run_dir = choose_run_dir(cfg)
        trainer = Trainer(cfg, mesh, rt.device)  # (opens the data)
        try:
            with held_run_dir(run_dir), \
                    RunCheckpoints(run_dir, cfg, layout, trainer) as checkpoints, \
                    _divergence_recorded(run_dir, cfg, checkpoints):
                resumed = checkpoints.resume()
                done = 0 if resumed is None else resumed.step
                logging = mesh.is_logging_rank
                if logging:
                    (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
                    print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                          f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
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
