"""A training run from a config: process group, layout, run directory, checkpoints, loop.

    model shape from model.init_from / checkpoint.init_from, checked (pretrain.init_from)
    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data checked, model part built, DDP, optimizer
        run_dir created and locked (pretrain.run_dir): nothing is written before this
        checkpoints: a diverged run is not repeated (pretrain.divergence), resume
        (checkpoint.resume), else the weights model.init_from or checkpoint.init_from
        name (pretrain.init_from); then the logging rank writes run_dir/config.toml and
        opens the trackers
        trainer.fit(...) under a SIGTERM/SIGINT flag, saving checkpoints on schedule, at the
        end and on stop; the logging rank prints a line per step (pretrain.progress)
        close: the checkpointer waits for its last save, the lock is released, the EP
        transport is released; the logging rank prints the summary (pretrain.summary)
    a plan larger than the GPU is warned about before the model is built, and a GPU out of
    memory anywhere ends the run with the plan's account and the least change that fits
    (pretrain.out_of_memory)
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_model import total_params
from moe_model.hf import check_representable

from pretrain import divergence
from pretrain.checkpoint import RunCheckpoints
from pretrain.config import ConfigError, PretrainConfig, config_toml, validate_layout
from pretrain.config_tree import to_tree
from pretrain.data import document_eos_id, resolve_vocab_size
from pretrain.init_from import adopt_source_model, load_initial_weights
from pretrain.mesh import build_mesh
from pretrain.metrics import METRICS_FILE, MetricsLog, Tracker, WandbOptions, open_trackers
from pretrain.out_of_memory import memory_warning, out_of_memory_explained
from pretrain.progress import Progress
from pretrain.resume_changes import resume_changes
from pretrain.run_dir import choose_run_dir, held_run_dir
from pretrain.runtime import decided_on_rank_0, distributed
from pretrain.signals import StopRequest
from pretrain.summary import RunFiles, run_summary
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


def warn_if_not_exportable(cfg: PretrainConfig) -> None:
    """One line on stderr when ``export-hf`` will refuse the model (told now, not after
    the run)."""
    try:
        check_representable(cfg.model)
    except ValueError as e:
        print(f"warning: export-hf will not be able to write this model: {e}", file=sys.stderr,
              flush=True)


def fp8_eager_note(cfg: PretrainConfig, device: torch.device) -> str | None:
    """One line when FP8 layers run eagerly on a GPU in a run that could replay its steps
    from CUDA graphs: the FP8 layers launch many small kernels (quantisation, scaled GEMMs),
    whose launch cost the replay hides (docs/performance.md, FP8 experts)."""
    x = cfg.mxfp8
    if device.type != "cuda" or cfg.train.cuda_graphs or not x.targets or x.recipe == "mxfp8":
        return None
    try:
        cfg.with_changes("train", cuda_graphs=True).validate()
    except ConfigError:
        return None
    return (f"note: mxfp8.recipe={x.recipe} launches many small kernels; replaying the step from "
            "CUDA graphs (train.cuda_graphs=true) hides their launch cost")


def train(cfg: PretrainConfig) -> list[dict[str, Any]]:
    """Train per ``cfg`` as one rank of the launcher's world; returns this process's records."""
    started = time.perf_counter()
    source_note = adopt_source_model(cfg)  # the model's shape from model/checkpoint.init_from
    vocab_note = resolve_vocab_size(cfg)  # model.vocab_size from the data, before the model
    document_eos_id(cfg.data)  # data.document_mask on data without documents: before any output
    # the stop flag outlives the checkpointer and the teardown: a SIGTERM while the last
    # checkpoint is written waits for it (the process would die with it half written), one
    # while the process group is taken down leaves a finished run finished; one rank per
    # host announces it
    with StopRequest(announce=os.environ.get("LOCAL_RANK", "0") == "0") as stop, \
            distributed(cfg.train.device, cfg.train.collective_timeout_s) as rt, \
            out_of_memory_explained(cfg, rt.world_size, rt.device):
        for note in (source_note, vocab_note):
            if note and rt.rank == 0:
                print(note, flush=True)
        layout = validate_layout(cfg, rt.world_size)
        mesh = build_mesh(layout, rt.device.type)
        warning = memory_warning(cfg, rt.world_size, rt.device) if mesh.is_logging_rank else None
        if warning:
            print(warning, flush=True)  # before the model is built
        run_dir = choose_run_dir(cfg)
        trainer = Trainer(cfg, mesh, rt.device)  # (opens the data)
        logging = mesh.is_logging_rank
        last = min(cfg.train.steps, cfg.train.stop_after or cfg.train.steps)
        progress: Progress | None = None
        try:
            with held_run_dir(run_dir), \
                    RunCheckpoints(run_dir, cfg, layout, trainer,
                                   announce=lambda line: _note(progress, line)) as checkpoints, \
                    _divergence_recorded(run_dir, cfg, checkpoints):
                resumed = checkpoints.resume()
                done = 0 if resumed is None else resumed.step
                weights_note = load_initial_weights(cfg, trainer) if resumed is None else None
                if logging:
                    (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
                    print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                          f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
                    if cfg.parallel.merge_expert_grad_microbatches == "auto":
                        print("parallel.merge_expert_grad_microbatches=auto: "
                              f"{trainer.cfg.parallel.merge_expert_grad_microbatches} (the most the "
                              "memory plan fits on this GPU)", flush=True)
                    if weights_note:
                        print(weights_note, flush=True)
                    warn_if_not_exportable(cfg)
                    fp8_note = fp8_eager_note(cfg, rt.device)
                    if fp8_note:
                        print(fp8_note, flush=True)
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
