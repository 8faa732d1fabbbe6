"""Learning-rate schedules: pure functions of the step, returning a factor of the peak LR.

Steps count from 1 (the first optimizer step). The optimizer multiplies each
parameter group's peak LR by the factor, so one schedule serves AdamW and Muon
groups with different peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


def _check(name: str, warmup_steps: int, total_steps: int | None = None, min_ratio: float = 0.0) -> None:
    if warmup_steps < 0:
        raise ValueError(f"{name}.warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and total_steps <= warmup_steps:
        raise ValueError(f"{name}.total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"{name}.min_ratio must be in [0, 1], got {min_ratio}")


def _warmup(step: int, warmup_steps: int) -> float:
    return min(1.0, step / warmup_steps) if warmup_steps > 0 else 1.0


@dataclass(frozen=True)
class LinearWarmup:
    """Linear ramp to the peak over ``warmup_steps``, then constant."""

    warmup_steps: int

    def __post_init__(self) -> None:
        _check("LinearWarmup", self.warmup_steps)

    def __call__(self, step: int) -> float:
        return _warmup(step, self.warmup_steps)


@dataclass(frozen=True)
class Cosine:
    """Linear warmup, then cosine decay to ``min_ratio`` at ``total_steps``."""

    warmup_steps: int
    total_steps: int
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check("Cosine", self.warmup_steps, self.total_steps, self.min_ratio)

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class WarmupStableDecay:
    """Linear warmup, constant peak, then a decay over the last ``decay_steps`` to ``min_ratio``.

    The stable phase can be cut anywhere and a decay branched off a checkpoint,
    which is why WSD suits runs whose length is not fixed in advance.
    """

    warmup_steps: int
    total_steps: int
    decay_steps: int
    min_ratio: float = 0.0
    shape: Literal["linear", "cosine", "sqrt"] = "linear"

    def __post_init__(self) -> None:
        _check("WarmupStableDecay", self.warmup_steps, self.total_steps, self.min_ratio)
        if not 0 < self.decay_steps <= self.total_steps - self.warmup_steps:
            raise ValueError(
                f"WarmupStableDecay.decay_steps must be in (0, total_steps - warmup_steps], "
                f"got {self.decay_steps}"
            )
        if self.shape not in ("linear", "cosine", "sqrt"):
            raise ValueError(f"WarmupStableDecay.shape must be linear, cosine or sqrt, got {self.shape!r}")

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return _warmup(step, self.warmup_steps)
        decay_start = self.total_steps - self.decay_steps
        if step <= decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / self.decay_steps)
        if self.shape == "linear":
            remaining = 1.0 - progress
        elif self.shape == "cosine":
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            remaining = 1.0 - math.sqrt(progress)
        return self.min_ratio + (1.0 - self.min_ratio) * remaining
