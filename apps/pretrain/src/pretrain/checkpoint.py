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
- metadata: the resolved config, the layout it was saved from, the data's
  tokenizer (``pretrain.tokenizer_files``: what export and sampling read), the step and the
  data position (samples consumed; the data order is a function of the step and of
  the stream's number of sequences, so nothing else is needed), the skip count and
  the newest clean checkpoint (``pretrain.divergence``), and per rank the RNG states.
  Resuming checks this metadata first (its step is the manifest's, the keys it reads
  are there, the RNG state decodes): a fault is one line naming the checkpoint.

Resuming refuses what would silently change the run: a model whose weights would
compute something else (``MODEL_FUNCTION_FIELDS``), a checkpoint tensor this run's
state has no place for, and another data stream (path, seed, batch, sequence length,
number of sequences).

Saves are asynchronous (moe_ckpt snapshots to host memory and writes in a
background thread) every ``checkpoint.every`` steps, at the last step
(``checkpoint.final``), and when the run stops early (SIGTERM or SIGINT,
``train.stop_after``). ``checkpoint.resume``:
``auto`` loads the latest complete checkpoint under ``run_dir/checkpoints`` (a
fresh start when there is none), ``none`` starts fresh, a path loads that
checkpoint directory (``.../checkpoints/step_N``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_ckpt import Checkpointer, CheckpointerConfig, Manifest, PostCommitError, Shard, load
from moe_ckpt.directory import step_dir_name

from pretrain import divergence
from pretrain.config import ConfigError, Layout, PretrainConfig
from pretrain.config_tree import to_tree
from pretrain.data import STDLIB, SYNTHETIC, MixtureSequences
from pretrain.errors import PretrainError
from pretrain.tokenizer_files import data_tokenizer
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


# What the weights of a checkpoint compute: a resumed run must not reinterpret them (the
# other model fields, balancing coefficients and execution choices, may change)
MODEL_FUNCTION_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "top_k",
    "expert_hidden", "n_shared_experts", "shared_expert_hidden", "n_dense_layers", "dense_hidden",
    "router_score", "norm_topk_weights", "qk_norm", "rope_theta", "norm_eps", "tie_embeddings",
)


def _data_position(cfg: PretrainConfig, step: int, n_sequences: int,
                   sources: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the data stream stands after ``step``; ``n_sequences`` (the stream's windows)
    keys its order, so a stream that grew or shrank under the same path is not the same;
    ``sources``: a mixture's path, weight and sequences per source (its order's keys)."""
    t = cfg.train
    return {"samples_seen": step * t.global_batch, "global_batch": t.global_batch,
            "seq_len": t.seq_len, "path": cfg.data.path, "n_sequences": n_sequences,
            "seed": cfg.seed if cfg.data.seed is None else cfg.data.seed, "sources": sources}


def _same_path(a: str, b: str) -> bool:
    """``data.path`` values naming the same data (``data/x`` and ``./data/x``; the built-in
    sources by name only)."""
    if a == b or STDLIB in (a, b) or SYNTHETIC in (a, b):
        return a == b
    return Path(a).resolve() == Path(b).resolve()


def _same_sources(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """The same mixture: paths (however written), weights and sizes, in order."""
    return len(a) == len(b) and all(
        _same_path(x["path"], y["path"]) and x["weight"] == y["weight"]
        and x["n_sequences"] == y["n_sequences"] for x, y in zip(a, b, strict=True))


def _describe_sources(sources: list[dict[str, Any]]) -> str:
    return "[" + ", ".join(f"{s['path']} x{s['weight']:g} ({s['n_sequences']} sequences)"
                           for s in sources) + "]"


class CheckpointMetadataError(PretrainError):
    """A checkpoint's own metadata (the trainer's part of its manifest) is not usable."""


def _check_metadata(manifest: Manifest, where: Path, rank: int | None) -> None:
    """The trainer's metadata holds what resuming reads, and its step is the manifest's
    (``rank``: whose RNG state is restored; ``None`` when the world size changed)."""
    def bad(what: str) -> CheckpointMetadataError:
        return CheckpointMetadataError(f"{where}: the checkpoint's metadata {what}; it cannot be "
                                       "resumed from (choose another with checkpoint.resume=PATH)")

    meta = manifest.metadata
    if meta.get("step") != manifest.step:
        raise bad(f"says step {meta.get('step')!r}, its manifest step {manifest.step!r}")
    required = {"config": ("model",), "data": ("global_batch", "seq_len", "path", "seed")}
    for section, keys in required.items():
        value = meta.get(section)
        for key in keys:
            if not isinstance(value, dict) or key not in value:
                raise bad(f"lacks {section}.{key}")
    if not isinstance(meta["config"]["model"], dict):
        raise bad("holds no model config (config.model)")
    if rank is None:
        return
    try:
        rng = manifest.rank_metadata[rank]["rng"]
        for name, text in rng.items():
            decoded = base64.b64decode(text, validate=True)
            if name == "cpu" and len(decoded) != torch.get_rng_state().numel():
                raise ValueError(f"{len(decoded)} bytes, a CPU generator state has "
                                 f"{torch.get_rng_state().numel()}")
    except (IndexError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise bad(f"holds no usable RNG state for rank {rank} (rank_metadata[{rank}].rng: "
                  f"{type(e).__name__}: {e})") from None


class RunCheckpoints:
    """The run's checkpointer: save on schedule, resume at start, close at the end.

    Construction is collective (moe_ckpt's checkpointer makes its own gloo group).
    ``announce``: called with one line (the checkpoint's path and the seconds from the
    save's start to its commit) on the rank that commits it (rank 0), from the writer
    thread when the save is asynchronous.
    """

    def __init__(self, run_dir: Path, cfg: PretrainConfig, layout: Layout, trainer: Trainer,
                 announce: Callable[[str], None] | None = None) -> None:
        self.cfg, self.layout, self.trainer, self.run_dir = cfg, layout, trainer, run_dir
        c = cfg.checkpoint
        self.root = run_dir / CHECKPOINT_DIR
        self.announce = announce
        self._saving: tuple[int, float] | None = None  # the step being saved, its start time
        self.checkpointer = Checkpointer(
            self.root, CheckpointerConfig(keep_last=c.keep_last or None, async_save=c.async_save),
            on_phase=self._on_phase)
        self.state = training_state(trainer)
        self.n_sequences = trainer.data.source.n_sequences
        source = trainer.data.source
        self.sources = source.records() if isinstance(source, MixtureSequences) else []
        self.last_saved: int | None = None
        # recorded from rank 0, whose metadata the checkpoint keeps
        self.tokenizer = data_tokenizer(cfg.data) if dist.get_rank() == 0 else None

    def _on_phase(self, phase: str) -> None:
        if phase == "committed" and self.announce is not None and self._saving is not None:
            step, started = self._saving
            self.announce(f"saved checkpoint {self.path(step)} "
                          f"({time.perf_counter() - started:.1f} s)")

    def path(self, step: int) -> Path:
        """The directory the checkpoint of ``step`` is committed as."""
        return self.root / step_dir_name(step)

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save (raising its error) and release the checkpointer."""
        try:
            self._wait()
        finally:
            with self._post_commit_warned():
                self.checkpointer.close()

    @contextlib.contextmanager
    def _post_commit_warned(self) -> Iterator[None]:
        """A failure after a commit (the ``latest`` pointer or retention) leaves that
        checkpoint complete and resumable: say so and train on (the next save redoes both)
        rather than end a run that lost nothing."""
        try:
            yield
        except PostCommitError as e:
            if dist.get_rank() == 0:
                print(f"warning: {e}; training continues", file=sys.stderr, flush=True)

    # -- saving --------------------------------------------------------------------

    def due(self, step: int, stopping: bool) -> bool:
        c, last = self.cfg.checkpoint, self.cfg.train.steps
        return stopping or (c.final and step == last) or (c.every > 0 and step % c.every == 0)

    def save(self, step: int) -> None:
        """Checkpoint the state after ``step`` (collective; returns after the host snapshot)."""
        if self.last_saved == step:
            return
        skips = self.trainer.skips
        metadata = {"config": to_tree(self.cfg), "layout": dataclasses.asdict(self.layout),
                    "tokenizer": self.tokenizer, "step": step,
                    "data": _data_position(self.cfg, step, self.n_sequences, self.sources),
                    divergence.METADATA_KEY: skips.saved(step)}
        self._wait()  # the previous (asynchronous) save
        self._saving = (step, time.perf_counter())
        with self._post_commit_warned():
            self.checkpointer.save(step, self.state, metadata,
                                   rank_metadata={"rng": _rng_state(self.trainer.device)},
                                   keep=[] if skips.clean_step is None else [skips.clean_step])
        self.last_saved = step

    def _wait(self) -> None:
        """Wait for the pending save; once it is committed, a divergence before it is past."""
        with self._post_commit_warned():
            self.checkpointer.wait()
        if self.last_saved is not None and dist.get_rank() == 0:
            divergence.clear_after(self.run_dir, self.last_saved)

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
            where = self.root / step_dir_name(existing[-1])
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
            where = Path(choice)
            manifest = load(choice, self.state)
        _check_metadata(manifest, where, dist.get_rank() if manifest.world_size ==
                        self.layout.world_size else None)
        self._check_model(manifest)
        self._check_data(manifest)
        self.trainer.optimizer.load_sharded_state(
            {k: v for k, v in self.state.items() if not k.startswith(BUFFER_PREFIX)})
        if manifest.world_size == self.layout.world_size:
            _set_rng_state(manifest.rank_metadata[dist.get_rank()]["rng"], self.trainer.device)
        self.trainer.skips.resumed(manifest.step, manifest.metadata.get(divergence.METADATA_KEY))
        return manifest

    def report_recovery(self) -> None:
        """Say what opening the checkpoint root found left by a run that did not end cleanly
        (rank 0; the checkpointer set it aside or took it over)."""
        for old, aside in self.checkpointer.set_aside:
            print(f"warning: {old} has no manifest.json (an unfinished or damaged checkpoint): "
                  f"moved to {aside.name}, not resumed from", file=sys.stderr, flush=True)

    def _check_model(self, manifest: Manifest) -> None:
        """The checkpoint's weights must mean what this run's model reads them as, and each
        of its tensors must have a place in some rank's state (none silently left behind;
        collective)."""
        saved = manifest.metadata["config"]["model"]
        now = to_tree(self.cfg.model)
        for key in MODEL_FUNCTION_FIELDS:  # (the tree leaves out fields set to None)
            if saved.get(key) != now.get(key):
                raise ConfigError(
                    f"checkpoint.resume: the checkpoint of step {manifest.step} holds a model with "
                    f"model.{key}={saved.get(key)!r}, this run has {now.get(key)!r}; its weights "
                    "would not compute the same model"
                )
        held = [None] * dist.get_world_size()  # each rank holds its stage's and shard's part
        dist.all_gather_object(held, sorted(self.state))
        unread = sorted(set(manifest.tensors).difference(*held))
        if unread:
            raise ConfigError(
                f"checkpoint.resume: this run's model and optimizer have no place for "
                f"{len(unread)} tensor(s) of the checkpoint of step {manifest.step} "
                f"({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}); resuming would drop "
                "them (a model or optimizer setting changed?)"
            )

    def _check_data(self, manifest: Manifest) -> None:
        """The data position is a step count: the stream it counts must be the same."""
        saved = manifest.metadata["data"]
        now = _data_position(self.cfg, 0, self.n_sequences, self.sources)
        keys = {"global_batch": "train.global_batch", "seq_len": "train.seq_len",
                "path": "data.path", "seed": "data.seed (or seed)"}
        for key, option in keys.items():
            same = _same_path(saved[key], now[key]) if key == "path" else saved[key] == now[key]
            if not same:
                raise ConfigError(
                    f"checkpoint.resume: the checkpoint of step {manifest.step} was trained with "
                    f"{option}={saved[key]!r}, this run has {now[key]!r}; the data position "
                    "would not carry over"
                )
        mixed = saved.get("sources", [])  # (absent from checkpoints older than mixtures)
        if not _same_sources(mixed, now["sources"]):
            raise ConfigError(
                f"checkpoint.resume: the checkpoint of step {manifest.step} was trained on "
                f"data.sources={_describe_sources(mixed)}, this run has "
                f"{_describe_sources(now['sources'])}; the mixture's order would not carry over")
        # checkpoints written before the stream's size was recorded lack it
        if saved.get("n_sequences", now["n_sequences"]) != now["n_sequences"]:
            raise ConfigError(
                f"checkpoint.resume: the checkpoint of step {manifest.step} was trained on "
                f"{saved['n_sequences']} sequences of train.seq_len + 1 tokens from data.path="
                f"{self.cfg.data.path!r}, which now holds {now['n_sequences']}: the data changed, "
                "and the data order (a permutation of the sequences) would not carry over"
            )
