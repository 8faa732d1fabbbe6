"""The composed run configuration, its built-in presets, TOML files and overrides.

Each package owns its config dataclass (``moe_model.MoEConfig`` ...); this module
composes them with the app's own (train, optim, data) into ``PretrainConfig``.
A run's config comes from a preset name or a TOML file, then ``KEY=VALUE``
overrides with dotted keys (``model.n_experts=16``, ``train.steps=10``). Unknown
keys and values of the wrong type fail with a one-line message naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_model import MoEConfig


class ConfigError(ValueError):
    """A configuration the run cannot use; the message names the offending key."""


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps
    seq_len: int = 128  # tokens per sequence
    global_batch: int = 16  # sequences per optimizer step (all ranks, all microbatches)
    micro_batch: int = 16  # sequences per rank per microbatch
    device: str = "auto"  # auto (cuda if present) | cpu | cuda
    compute_dtype: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final LR of the cosine decay, as a fraction of lr
    warmup_steps: int = 20  # linear warmup steps
    weight_decay: float = 0.1  # decoupled weight decay (AdamW)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global gradient norm (0 disables clipping)


@dataclass
class DataConfig:
    path: str | None = None  # token file or directory; None: the embedded standard-library corpus


@dataclass
class PretrainConfig:
    model: MoEConfig = field(default_factory=MoEConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run_dir: str | None = None  # output folder; None: a new folder under runs/
    seed: int = 0  # seeds initialisation and data order

    def validate(self) -> None:
        self.model.validate()
        t = self.train
        for name in ("steps", "seq_len", "global_batch", "micro_batch"):
            if getattr(t, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(t, name)}")
        if t.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device must be auto, cpu or cuda; got {t.device!r}")
        if t.compute_dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(
                f"train.compute_dtype must be auto, float32 or bfloat16; got {t.compute_dtype!r}"
            )
        if t.global_batch % t.micro_batch:
            raise ConfigError(
                f"train.global_batch={t.global_batch} is not divisible by "
                f"train.micro_batch={t.micro_batch}"
            )


PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: trains in a couple of minutes on two CPU cores.
    "default": {},
    # Seconds on a CPU; used by the tests.
    "tiny": {
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
                  "n_experts": 4, "top_k": 2, "expert_hidden": 64},
        "train": {"steps": 4, "seq_len": 32, "global_batch": 4, "micro_batch": 2},
        "optim": {"warmup_steps": 2},
    },
}


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML value or an override string to the field's declared type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(key, value, options[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key} expects true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            return int(str(value).replace("_", ""))
        except ValueError:
            raise ConfigError(f"{key} expects an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key} expects a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} expects a string, got {value!r}")
        return value
    raise ConfigError(f"{key} has a type ({tp}) that cannot be set from the command line")


def _unknown(key: str, candidates: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, candidates, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _all_keys(obj: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += _all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def set_key(cfg: PretrainConfig, key: str, value: Any) -> None:
    """Set a dotted key on the composed config, converting ``value`` to the field type."""
    parts = key.split(".")
    obj: Any = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise _unknown(key, _all_keys(cfg))
        if i == len(parts) - 1:
            current = getattr(obj, part)
            if dataclasses.is_dataclass(current):
                raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(current)[0].name}")
            object.__setattr__(obj, part, _coerce(key, value, _field_types(type(obj))[part]))
        else:
            obj = getattr(obj, part)


def _apply_tree(cfg: PretrainConfig, tree: dict[str, Any], prefix: str = "") -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _apply_tree(cfg, v, f"{prefix}{k}.")
        else:
            set_key(cfg, prefix + k, v)


def load_config(source: str | None = None, overrides: list[str] | None = None) -> PretrainConfig:
    """Build the run config from a preset name or TOML path, then ``KEY=VALUE`` overrides."""
    cfg = PretrainConfig()
    source = source or "default"
    if source in PRESETS:
        _apply_tree(cfg, PRESETS[source])
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"--config {source!r} is neither a built-in preset ({', '.join(PRESETS)}) "
                "nor a TOML file"
            )
        try:
            tree = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        _apply_tree(cfg, tree)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like KEY=VALUE")
        key, value = item.split("=", 1)
        set_key(cfg, key.strip(), value.strip())
    try:
        cfg.validate()
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return cfg


def to_dict(cfg: PretrainConfig) -> dict[str, Any]:
    """The resolved config as a TOML-ready tree (None values are left out)."""

    def strip(tree: dict[str, Any]) -> dict[str, Any]:
        return {k: strip(v) if isinstance(v, dict) else v for k, v in tree.items() if v is not None}

    return strip(dataclasses.asdict(cfg))
