"""Training checkpoints: what a run saves, when, and resuming on any layout.

A checkpoint (``run_dir/checkpoints/step_N``, moe_ckpt's format) holds every
tensor at its place in the *logical* (unsharded) tensor, so a run saved on one
layout resumes on another (DP2 -> EP2, DP2 -> PP2, 2 -> 1 process):

- ``main/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>``, ``momentum/<param>``
  and ``step``: the distributed optimizer's FP32 main weights and states, flat runs
  of the logical tensors (expert parameters are dim-0 slices under EP). The
  compute weights are not saved: they are rebuilt from the main weights.
- ``buffer/<name>``: the model's persistent buffers (the routers' selection bias),
  replicated over data parallelism, written by one rank.
- metadata: the resolved config, the layout it was saved from, the step and the
  data position (samples consumed; the data order is a function of the step, so
  nothing else is needed), and per rank the RNG states.

Saves are asynchronous (moe_ckpt snapshots to host memory and writes in a
background thread) every ``checkpoint.every`` steps, at the last step, and when
the run stops early (SIGTERM, ``train.stop_after``). ``checkpoint.resume``:
``auto`` loads the latest complete checkpoint under ``run_dir/checkpoints`` (a
fresh start when there is none), ``none`` starts fresh, a path loads that
checkpoint directory (``.../checkpoints/step_N``).
"""

from __future__ import annotations

import base64
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_ckpt import Checkpointer, CheckpointerConfig, Manifest, Shard, load

from pretrain.config import ConfigError, Layout, PretrainConfig
from pretrain.config_tree import to_tree
from pretrain.trainer import Trainer

CHECKPOINT_DIR = "checkpoints"
BUFFER_PREFIX = "buffer/"
MAIN_PREFIX = "main/"


def training_state(trainer: Trainer) -> dict[str, Any]:
    """This rank's share of everything a checkpoint holds (live tensors: loads fill them)."""
    state: dict[str, Any] = dict(trainer.optimizer.sharded_state())
    params = {name for name, _ in trainer.model.named_parameters(remove_duplicate=False)}
    for name, tensor in trainer.model.state_dict(keep_vars=True).items():
        if name not in params:  # a persistent buffer, held whole (replicated over DP)
            state[BUFFER_PREFIX + name] = Shard(tensor, tuple(tensor.shape))
    return state


def _rng_state(device: torch.device) -> dict[str, str]:
    def encode(state: torch.Tensor) -> str:
        return base64.b64encode(state.numpy().tobytes()).decode()

    out = {"cpu": encode(torch.get_rng_state())}
    if device.type == "cuda":
        out["cuda"] = encode(torch.cuda.get_rng_state(device))
    return out


def _set_rng_state(saved: dict[str, str], device: torch.device) -> None:
    def decode(text: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(saved["cpu"]))
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(decode(saved["cuda"]), device)


def _data_position(cfg: PretrainConfig, step: int) -> dict[str, Any]:
    t = cfg.train
    return {"samples_seen": step * t.global_batch, "global_batch": t.global_batch,
            "seq_len": t.seq_len, "path": cfg.data.path,
            "seed": cfg.seed if cfg.data.seed is None else cfg.data.seed}


class RunCheckpoints:
    """The run's checkpointer: save on schedule, resume at start, close at the end.

    Construction is collective (moe_ckpt's checkpointer makes its own gloo group).
    """

    def __init__(self, run_dir: Path, cfg: PretrainConfig, layout: Layout, trainer: Trainer) -> None:
        self.cfg, self.layout, self.trainer = cfg, layout, trainer
        c = cfg.checkpoint
        self.root = run_dir / CHECKPOINT_DIR
        self.checkpointer = Checkpointer(
            self.root, CheckpointerConfig(keep_last=c.keep_last or None, async_save=c.async_save))
        self.state = training_state(trainer)
        self.last_saved: int | None = None

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save (raising its error) and release the checkpointer."""
        self.checkpointer.close()

    # -- saving --------------------------------------------------------------------

    def due(self, step: int, stopping: bool) -> bool:
        every, last = self.cfg.checkpoint.every, self.cfg.train.steps
        return stopping or (every > 0 and (step % every == 0 or step == last))

    def save(self, step: int) -> None:
        """Checkpoint the state after ``step`` (collective; returns after the host snapshot)."""
        if self.last_saved == step:
            return
        metadata = {"config": to_tree(self.cfg), "layout": dataclasses.asdict(self.layout),
                    "step": step, "data": _data_position(self.cfg, step)}
        self.checkpointer.save(step, self.state, metadata,
                               rank_metadata={"rng": _rng_state(self.trainer.device)})
        self.last_saved = step

    # -- resuming ------------------------------------------------------------------

    def resume(self) -> Manifest | None:
        """Load the checkpoint ``checkpoint.resume`` names; ``None`` for a fresh start."""
        choice = self.cfg.checkpoint.resume
        existing = self.checkpointer.steps() if dist.get_rank() == 0 else None
        box = [existing]
        dist.broadcast_object_list(box, src=0)
        existing = box[0]
        if choice == "auto":
            if not existing:
                return None
            manifest = self.checkpointer.load(self.state, step=existing[-1])
        else:
            if existing:
                raise ConfigError(
                    f"checkpoint.resume={choice}, but {self.root} already holds checkpoints "
                    f"(steps {existing}); use checkpoint.resume=auto to continue that run, "
                    "or a new run_dir"
                )
            if choice == "none":
                return None
            manifest = load(choice, self.state)
        self._check_data(manifest)
        self.trainer.optimizer.load_sharded_state(
            {k: v for k, v in self.state.items() if not k.startswith(BUFFER_PREFIX)})
        if manifest.world_size == self.layout.world_size:
            _set_rng_state(manifest.rank_metadata[dist.get_rank()]["rng"], self.trainer.device)
        return manifest

    def _check_data(self, manifest: Manifest) -> None:
        """The data position is a step count: the stream it counts must be the same."""
        saved = manifest.metadata["data"]
        now = _data_position(self.cfg, 0)
        keys = {"global_batch": "train.global_batch", "seq_len": "train.seq_len",
                "path": "data.path", "seed": "data.seed (or seed)"}
        for key, option in keys.items():
            if saved[key] != now[key]:
                raise ConfigError(
                    f"checkpoint.resume: the checkpoint of step {manifest.step} was trained with "
                    f"{option}={saved[key]!r}, this run has {now[key]!r}; the data position "
                    "would not carry over"
                )
