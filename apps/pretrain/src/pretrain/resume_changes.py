"""What a resumed run changes against the checkpoint's config, said before it trains.

Extending a finished run (``train.steps=600`` on a checkpoint of a 300-step run), a new
``optim.lr`` or another schedule moves the learning-rate curve from the next step on;
saying so, with the learning rate the next step gets under the old and the new config,
keeps a resume from changing the run silently. The keys a resume cannot change (the
model's function, the data stream) are refused before this by
``pretrain.checkpoint.RunCheckpoints``; everything else that differs is listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pretrain.config import OptimConfig, PretrainConfig
from pretrain.config_tree import ConfigError, apply_tree, to_tree
from pretrain.schedule import build_schedule

# how a run resumes and where it writes, not what it trains
IGNORED = ("run_dir", "checkpoint.resume")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config tree as ``{dotted key: value}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def _learning_rates(optim: OptimConfig, total_steps: int, step: int) -> dict[str, float]:
    factor = build_schedule(optim, total_steps)(step)
    rates = {"lr": optim.lr * factor}
    if optim.name == "muon":
        rates["muon lr"] = optim.muon_lr * factor
    return rates


def _saved_optim(saved: Mapping[str, Any]) -> OptimConfig | None:
    """The checkpoint's optimizer config; ``None`` when this version cannot read it back."""
    optim = OptimConfig()
    try:
        apply_tree(optim, dict(saved.get("optim", {})))
    except ConfigError:
        return None
    return optim


def resume_changes(saved: Mapping[str, Any], cfg: PretrainConfig, step: int) -> list[str]:
    """Lines naming each key whose value differs from the checkpoint's config ``saved`` (a
    ``to_tree`` tree), and the learning rate of ``step`` (the first the resumed run trains)
    old -> new when it differs; empty when nothing changed."""
    before, after = flatten(saved), flatten(to_tree(cfg))
    changed = [key for key in sorted(set(before) | set(after))
               if key not in IGNORED and before.get(key) != after.get(key)]
    lines = [f"  {key}: {_show(before.get(key))} -> {_show(after.get(key))}" for key in changed]
    old_optim = _saved_optim(saved)
    old_steps = saved.get("train", {}).get("steps")
    if old_optim is not None and isinstance(old_steps, int):
        old = _learning_rates(old_optim, old_steps, step)
        new = _learning_rates(cfg.optim, cfg.train.steps, step)
        for name, rate in new.items():
            if name in old and f"{old[name]:.3e}" != f"{rate:.3e}":
                lines.append(f"  {name} at step {step}: {old[name]:.3e} -> {rate:.3e}")
    if not lines:
        return []
    return ["changed since the checkpoint (its config -> this run's):", *lines]
