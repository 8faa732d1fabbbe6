"""``pretrain export-hf CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face model folder.

One CPU process, any layout the checkpoint was saved from: moe_ckpt reads each
logical FP32 main weight (``main/<param>``) whole, moe_model's Qwen3-MoE mapping
renames it (stacked experts become one tensor per expert), and the folder gets
BF16 (or FP32) safetensors shards, their index and ``config.json``, which
``transformers`` loads as ``Qwen3MoeForCausalLM``. The model config comes from
the checkpoint's own metadata, so nothing else is needed.

Beside the weights: the data's tokenizer, which the checkpoint records
(``pretrain.tokenizer_files``; ``tokenizer`` replaces it), as ``tokenizer.json`` and
``tokenizer_config.json``, and ``generation_config.json`` (its end-of-text id), so
``AutoTokenizer``, ``AutoModelForCausalLM`` and ``pipeline("text-generation")`` work
from the folder alone. ``max_position_embeddings`` is the trained sequence length
(``train.seq_len``): RoPE runs at any position, but the model has only learnt
positions below it. A checkpoint without a tokenizer (synthetic data) and no
``tokenizer`` exports the weights alone, and says so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from moe_ckpt import export_hf, open_checkpoint
from moe_model import MoEConfig
from moe_model.hf import convert_to_hf, hf_config

from pretrain.checkpoint import MAIN_PREFIX
from pretrain.config import TrainConfig
from pretrain.config_tree import ConfigError, apply_tree
from pretrain.errors import PretrainError
from pretrain.tokenizer_files import (
    generation_config,
    hf_tokenizer_files,
    load_tokenizer,
    tokenizer_from_file,
)

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class ExportError(PretrainError, ValueError):
    """The checkpoint cannot be exported; the message names the file or setting."""


def model_config(checkpoint: Path) -> MoEConfig:
    """The model config a pretrain checkpoint was saved with."""
    tree = open_checkpoint(checkpoint).metadata.get("config", {}).get("model")
    if tree is None:
        raise ExportError(f"{checkpoint} holds no pretrain config in its metadata")
    cfg = MoEConfig()
    try:
        apply_tree(cfg, tree)
        cfg.validate()
    except (ConfigError, ValueError) as e:
        raise ExportError(f"{checkpoint}: the saved model config is unusable: {e}") from None
    return cfg


def trained_seq_len(checkpoint: Path) -> int:
    """``train.seq_len`` of the run that saved ``checkpoint``."""
    tree = open_checkpoint(checkpoint).metadata.get("config", {}).get("train", {})
    seq_len = tree.get("seq_len", TrainConfig.seq_len)
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ExportError(f"{checkpoint}: the saved train.seq_len {seq_len!r} is not a positive integer")
    return seq_len


def side_files(checkpoint: Path, seq_len: int, tokenizer: Path | None = None) -> dict[str, str]:
    """The tokenizer files and ``generation_config.json`` of the export (see the module doc);
    no tokenizer files when neither the checkpoint nor ``tokenizer`` has one."""
    record = open_checkpoint(checkpoint).metadata.get("tokenizer") or {}
    text, eos = record.get("json"), record.get("eos_id")
    where = f"{checkpoint}'s tokenizer"
    if tokenizer is not None:
        text, folder_eos = tokenizer_from_file(tokenizer)
        eos = folder_eos if folder_eos is not None else eos
        where = f"--tokenizer {tokenizer}"
    files = {"generation_config.json": generation_config(eos)}
    if text is not None:
        load_tokenizer(text, where)  # a bad file is refused before anything is written
        files.update(hf_tokenizer_files(text, eos, seq_len))
    return files


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype: str = "bfloat16",
                      tokenizer: Path | None = None) -> Path:
    """Write the Hugging Face folder ``out_dir`` (must not exist) from ``checkpoint``."""
    cfg = model_config(checkpoint)
    seq_len = trained_seq_len(checkpoint)
    try:
        config = hf_config(cfg, EXPORT_DTYPES[dtype], max_position_embeddings=seq_len)
    except ValueError as e:
        raise ExportError(str(e)) from None
    try:
        return export_hf(
            checkpoint, out_dir,
            convert=lambda name, tensor: convert_to_hf(name.removeprefix(MAIN_PREFIX), tensor, cfg),
            select=lambda name: name.startswith(MAIN_PREFIX),
            config=config, dtype=EXPORT_DTYPES[dtype],
            files=side_files(checkpoint, seq_len, tokenizer),
        )
    except FileExistsError:
        raise
    except OSError as e:  # (export_hf removes what it wrote)
        raise ExportError(f"{e.filename or out_dir}: {e.strerror or e} (exporting {checkpoint} "
                          f"to {out_dir})") from None
