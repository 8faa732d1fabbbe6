"""Starting a run from existing weights: ``model.init_from`` and ``checkpoint.init_from``.

- ``model.init_from=DIR``: a Hugging Face ``Qwen3MoeForCausalLM`` folder (``config.json``
  and safetensors, as ``save_pretrained`` or ``pretrain export-hf`` writes it).
- ``checkpoint.init_from=CKPT``: a checkpoint step directory of ours, saved on any layout
  (continued pretraining, annealing on new data).

Only the weights carry over: the optimizer state, the LR schedule and the data stream
start fresh, at step 1 (``checkpoint.resume`` is what continues a run). A run that holds
checkpoints of its own resumes from them as always (``checkpoint.resume=auto``), so a
preempted run that started from existing weights continues where it stopped.

Two stages:

1. ``adopt_source_model(cfg)``, before the process group, so that every refusal comes
   before anything is written: the source's model (its ``config.json``, or the
   checkpoint's saved config) becomes the run's model shape (``MODEL_FUNCTION_FIELDS``).
   A key set to something else in a config file or on the command line is refused,
   naming it; a preset's value gives way. Every tensor the model reads is checked for
   presence and shape, and the vocabulary against the data's.
2. ``load_initial_weights(cfg, trainer)`` once the trainer is built, on a fresh start:
   each rank fills only its FP32 main-weight shards (``main/<param>``: the layers and
   experts it holds, flat runs of them where the optimizer shards over DP), so it reads
   only those parts of the source; then the compute weights are rebuilt from them. The
   routers' selection bias (a buffer) comes from a checkpoint that has it, else starts
   at zero.
"""

from __future__ import annotations

from pathlib import Path

import torch
from moe_ckpt import fill_from, load, open_checkpoint
from moe_model import MoEConfig, MoETransformer
from moe_model.hf import Qwen3MoeFolder
from moe_model.params import logical_shapes

from pretrain.checkpoint import BUFFER_PREFIX, MAIN_PREFIX, MODEL_FUNCTION_FIELDS, training_state
from pretrain.config import ConfigError, PretrainConfig
from pretrain.data import STDLIB, training_data_info
from pretrain.data.training import BYTE_VOCAB
from pretrain.errors import PretrainError
from pretrain.export import model_config
from pretrain.trainer import Trainer


class InitFromError(PretrainError, ValueError):
    """The weights a run should start from cannot be used; the message names the tensor or key."""


def _source(cfg: PretrainConfig) -> tuple[str, str] | None:
    """(option, path) of the weights the run starts from, or ``None``."""
    if cfg.model.init_from and cfg.checkpoint.init_from:
        raise ConfigError(f"model.init_from={cfg.model.init_from!r} and checkpoint.init_from="
                          f"{cfg.checkpoint.init_from!r} are both set; a run starts from one")
    if cfg.model.init_from:
        return "model.init_from", cfg.model.init_from
    if cfg.checkpoint.init_from:
        if cfg.checkpoint.resume not in ("auto", "none"):
            raise ConfigError(
                f"checkpoint.init_from={cfg.checkpoint.init_from!r} and checkpoint.resume="
                f"{cfg.checkpoint.resume!r} are both set: resume continues a run (its optimizer "
                "and data position), init_from starts a new one from its weights; choose one")
        return "checkpoint.init_from", cfg.checkpoint.init_from
    return None


def adopt_source_model(cfg: PretrainConfig) -> str | None:
    """Take the model shape from the weights ``cfg`` starts from and check them (before
    any process group or file); the line to print, or ``None`` when the run starts from
    random weights."""
    chosen = _source(cfg)
    if chosen is None:
        return None
    option, path = chosen
    if option == "model.init_from":
        try:
            folder = Qwen3MoeFolder(path)
            source = folder.model_config()
            folder.check(source)
        except ValueError as e:
            raise InitFromError(f"{option}: {e}") from None
    else:
        source = model_config(Path(path))
        _check_checkpoint(path, source, cfg.model)
    _adopt(cfg, source, option, path)
    _check_vocab(cfg, option, path)
    return (f"{option}={path}: the model's shape from it (d_model {source.d_model}, "
            f"{source.n_layers} layers, {source.n_experts} experts, top-{source.top_k}, "
            f"vocab_size {source.vocab_size})")


def _adopt(cfg: PretrainConfig, source: MoEConfig, option: str, path: str) -> None:
    for field in MODEL_FUNCTION_FIELDS:
        key = f"model.{field}"
        ours, theirs = getattr(cfg.model, field), getattr(source, field)
        where = cfg.key_sources.get(key, "")
        if ours != theirs and where and not where.startswith("preset "):
            raise ConfigError(f"{key}={ours!r} ({where}) contradicts {option}={path}, whose model "
                              f"has {theirs!r}; leave {key} unset")
        setattr(cfg.model, field, theirs)
        cfg.key_sources[key] = f"{option} {path}"
    cfg.validate()


def _check_checkpoint(path: str, source: MoEConfig, run: MoEConfig) -> None:
    """Every weight of ``source``'s model is in the checkpoint with its shape; its buffers
    (the routers' selection bias) have a place in the run's model."""
    tensors = open_checkpoint(path).tensors
    with torch.device("meta"):
        params = dict(MoETransformer(source).named_parameters())
    for name, p in params.items():
        record = tensors.get(MAIN_PREFIX + name)
        if record is None:
            raise InitFromError(f"checkpoint.init_from={path}: tensor {MAIN_PREFIX + name!r} "
                                "is missing")
        if tuple(record.shape) != tuple(p.shape):
            raise InitFromError(f"checkpoint.init_from={path}: tensor {MAIN_PREFIX + name!r} has "
                                f"shape {tuple(record.shape)}, its saved config's model needs "
                                f"{tuple(p.shape)}")
    placed = logical_shapes(run) if run.bias_update_rate > 0 else {}
    for name in sorted(tensors):
        if name.startswith(BUFFER_PREFIX) and name.removeprefix(BUFFER_PREFIX) not in placed:
            raise InitFromError(
                f"checkpoint.init_from={path}: tensor {name!r} (the routers' selection bias) "
                "has no place in this run's model; set model.bias_update_rate > 0 to keep it")


def _check_vocab(cfg: PretrainConfig, option: str, path: str) -> None:
    """The data's token ids must all have an embedding row."""
    if cfg.data.path == STDLIB and not cfg.data.sources:
        data_vocab, where = BYTE_VOCAB, "the embedded corpus's bytes"
    else:
        info = training_data_info(cfg.data)  # None: synthetic tokens, drawn below vocab_size
        if info is None:
            return
        data_vocab, where = info.vocab_size, str(info.sidecar)
    if cfg.model.vocab_size < data_vocab:
        raise InitFromError(f"{option}={path}: its vocab_size {cfg.model.vocab_size} is smaller "
                            f"than the data's {data_vocab} ({where})")


def load_initial_weights(cfg: PretrainConfig, trainer: Trainer) -> str | None:
    """Fill this rank's weights from the source ``adopt_source_model`` checked (collective:
    the compute weights are rebuilt); the line to print, or ``None`` without a source."""
    chosen = _source(cfg)
    if chosen is None:
        return None
    option, path = chosen
    state = training_state(trainer)
    mains = {k: v for k, v in state.items() if k.startswith(MAIN_PREFIX)}
    if option == "model.init_from":
        folder = Qwen3MoeFolder(path)
        weights = folder.model_config()
        fill_from(mains, lambda name, offset, shape: folder.read(
            name.removeprefix(MAIN_PREFIX), weights, offset, shape))
    else:
        stored = open_checkpoint(path).tensors
        buffers = {k: v for k, v in state.items() if k.startswith(BUFFER_PREFIX) and k in stored}
        load(path, {**mains, **buffers})
    trainer.optimizer.rebuild_weights()
    return (f"weights from {option}={path}; a fresh optimizer, LR schedule and data stream "
            "from step 1")
