"""``pretrain export-hf CHECKPOINT OUT_DIR``: a checkpoint as a Hugging Face model folder.

One CPU process, any layout the checkpoint was saved from: moe_ckpt reads each
logical FP32 main weight (``main/<param>``) whole, moe_model's Qwen3-MoE mapping
renames it (stacked experts become one tensor per expert), and the folder gets
BF16 (or FP32) safetensors shards, their index and ``config.json``, which
``transformers`` loads as ``Qwen3MoeForCausalLM``. The model config comes from
the checkpoint's own metadata, so nothing else is needed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from moe_ckpt import export_hf, open_checkpoint
from moe_model import MoEConfig
from moe_model.hf import convert_to_hf, hf_config

from pretrain.checkpoint import MAIN_PREFIX
from pretrain.config_tree import ConfigError, apply_tree
from pretrain.errors import PretrainError

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


def export_checkpoint(checkpoint: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Write the Hugging Face folder ``out_dir`` (must not exist) from ``checkpoint``."""
    cfg = model_config(checkpoint)
    try:
        config = hf_config(cfg, EXPORT_DTYPES[dtype])
    except ValueError as e:
        raise ExportError(str(e)) from None
    try:
        return export_hf(
            checkpoint, out_dir,
            convert=lambda name, tensor: convert_to_hf(name.removeprefix(MAIN_PREFIX), tensor, cfg),
            select=lambda name: name.startswith(MAIN_PREFIX),
            config=config, dtype=EXPORT_DTYPES[dtype],
        )
    except FileExistsError:
        raise
    except OSError as e:  # (export_hf removes what it wrote)
        raise ExportError(f"{e.filename or out_dir}: {e.strerror or e} (exporting {checkpoint} "
                          f"to {out_dir})") from None
