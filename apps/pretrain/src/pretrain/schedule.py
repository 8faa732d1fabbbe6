"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay or constant.

``step`` counts optimizer steps from 1, so the first update already uses a
non-zero rate (``lr / warmup_steps``). The value depends only on the step and the
config, which is all a resumed run needs to continue the curve.
"""

from __future__ import annotations

import math

from pretrain.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to the floor over the last decay_fraction of the run.
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
    if step <= decay_start:
        return cfg.lr
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    return cfg.lr - (cfg.lr - floor) * progress
