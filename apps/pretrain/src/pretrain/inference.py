"""A whole model for sampling, from one of our checkpoints or a Hugging Face folder.

- A checkpoint (``RUN_DIR/checkpoints/step_N``, any layout it was saved from): the
  model config from its metadata, the FP32 main weights (``main/<param>``) and the
  persistent buffers (the routers' selection bias) read whole; the tokenizer from
  its metadata (``pretrain.tokenizer_files``).
- A folder with ``config.json`` (``Qwen3MoeForCausalLM``): ``moe_model.hf``'s
  loader; the tokenizer from the folder's ``tokenizer.json``.

``--tokenizer`` replaces either's tokenizer. The model runs dropless (as
``transformers`` does) with no activation recompute, in FP32 on the CPU and BF16
on a GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from moe_model import MoEConfig, MoETransformer
from moe_model.init import logical_name

from pretrain.checkpoint import BUFFER_PREFIX, MAIN_PREFIX
from pretrain.errors import PretrainError
from pretrain.tokenizer_files import TokenizerError, folder_tokenizer, tokenizer_from_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class SourceError(PretrainError, ValueError):
    """The model source cannot be loaded; the message names the path or tensor."""


@dataclass
class LoadedModel:
    model: MoETransformer
    tokenizer_json: str | None  # None: the source has none (pass --tokenizer)
    eos_id: int | None


def inference_config(cfg: MoEConfig) -> MoEConfig:
    """``cfg`` as sampling runs it: dropless, no recompute."""
    return dataclasses.replace(cfg, capacity_factor=None, recompute="none")


def load_checkpoint_model(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from moe_ckpt import open_checkpoint, read_tensors

    from pretrain.export import model_config

    cfg = inference_config(model_config(checkpoint))
    with torch.device("meta"):
        model = MoETransformer(cfg)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    stored = {name: (MAIN_PREFIX + logical_name(name, cfg) if name in params else BUFFER_PREFIX + name)
              for name in model.state_dict()}
    state = dict(read_tensors(checkpoint, sorted(set(stored.values()))))
    model.to_empty(device=device)
    model.tie_weights()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(state[stored[name]])
    model.to(dtype)
    record = open_checkpoint(checkpoint).metadata.get("tokenizer") or {}
    return LoadedModel(model.eval(), record.get("json"), record.get("eos_id"))


def load_hf_model(folder: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from moe_model.hf import from_pretrained

    try:
        model = from_pretrained(folder, dtype=dtype, device=device)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SourceError(f"{folder}: cannot load it as a Qwen3-MoE model: {e}") from None
    found = folder_tokenizer(folder)
    text, eos = found if found is not None else (None, None)
    return LoadedModel(model.eval(), text, eos)


def load_model(source: Path, device: torch.device, dtype: torch.dtype,
               tokenizer: Path | None = None) -> tuple[LoadedModel, Tokenizer]:
    """The model and tokenizer of ``source`` (a checkpoint or a Hugging Face folder)."""
    from pretrain.tokenizer_files import load_tokenizer

    if not source.is_dir():
        raise SourceError(f"{source} is not a directory (a checkpoint step_N or a Hugging Face folder)")
    if (source / "config.json").is_file():
        loaded = load_hf_model(source, device, dtype)
    else:
        loaded = load_checkpoint_model(source, device, dtype)
    where = str(source)
    if tokenizer is not None:
        loaded.tokenizer_json, eos = tokenizer_from_file(tokenizer)
        loaded.eos_id = eos if eos is not None else loaded.eos_id
        where = f"--tokenizer {tokenizer}"
    if loaded.tokenizer_json is None:
        raise TokenizerError(f"{source} holds no tokenizer; name one with --tokenizer "
                             "(a tokenizers JSON file or a folder with tokenizer.json)")
    return loaded, load_tokenizer(loaded.tokenizer_json, where)


def default_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SourceError("--device cuda: no CUDA device is available")
    return torch.device(name)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32
