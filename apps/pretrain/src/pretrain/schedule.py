"""The learning-rate schedule of a run: ``optim.schedule`` as a moe_optim schedule.

A schedule maps the optimizer step (from 1) to a factor of the peak learning
rate; the distributed optimizer multiplies every parameter group's peak (AdamW's
``optim.lr``, Muon's ``optim.muon_lr``) by it. The factor depends only on the
step and the config, which is all a resumed run needs to continue the curve.
"""

from __future__ import annotations

from collections.abc import Callable

from moe_optim import Cosine, LinearWarmup, WarmupStableDecay

from pretrain.config import OptimConfig

Schedule = Callable[[int], float]


def build_schedule(cfg: OptimConfig, total_steps: int) -> Schedule:
    """Linear warmup over ``warmup_steps``, then cosine, warmup-stable-decay or constant."""
    if cfg.schedule == "constant":
        return LinearWarmup(cfg.warmup_steps)
    if cfg.schedule == "cosine":
        return Cosine(cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    # wsd: hold the peak, then decay linearly over the last decay_fraction of the run.
    decay_steps = min(max(1, round(cfg.decay_fraction * total_steps)), total_steps - cfg.warmup_steps)
    return WarmupStableDecay(cfg.warmup_steps, total_steps, decay_steps, cfg.min_lr_ratio)
