"""Optimizer configuration: algorithms' hyperparameters and per-parameter rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

Algorithm = Literal["adamw", "muon"]


@dataclass
class AdamWConfig:
    lr: float = 3e-4  # peak learning rate (the schedule multiplies it)
    betas: tuple[float, float] = (0.9, 0.95)  # first/second moment decay
    eps: float = 1e-8  # denominator epsilon
    weight_decay: float = 0.1  # decoupled weight decay


@dataclass
class MuonConfig:
    lr: float = 0.02  # peak learning rate (the schedule multiplies it)
    momentum: float = 0.95  # momentum decay
    nesterov: bool = True  # Nesterov-style update direction
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: str = "bfloat16"  # matmul dtype of the Newton-Schulz iteration
    weight_decay: float = 0.1  # decoupled weight decay
    scale: Literal["spectral", "match_adamw_rms"] = "spectral"  # update scale per matrix


@dataclass
class ParamRule:
    """Overrides for the parameters ``match(name, param)`` selects.

    Every matching rule applies, in order; a field left ``None`` keeps what
    earlier rules (or the defaults: AdamW, scale 1, the algorithm's decay) set.
    So "no decay on norms and embeddings" and "experts at half LR" compose.
    """

    match: Callable[[str, nn.Parameter], bool]
    algorithm: Algorithm | None = None
    lr_scale: float | None = None  # multiplies the algorithm's lr
    weight_decay: float | None = None  # replaces the algorithm's weight decay


@dataclass
class OptimConfig:
    adamw: AdamWConfig = field(default_factory=AdamWConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    max_grad_norm: float | None = 1.0  # global-norm clipping; None: measure only
    min_shard_numel: int = 4096  # smaller tensors stay replicated (must match the DDP side)
    gather_bucket_mb: float = 256.0  # cap of one coalesced all-gather buffer (MiB)

    def validate(self) -> None:
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"OptimConfig.max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.min_shard_numel < 1:
            raise ValueError(f"OptimConfig.min_shard_numel must be >= 1, got {self.min_shard_numel}")
        if self.gather_bucket_mb <= 0:
            raise ValueError(f"OptimConfig.gather_bucket_mb must be positive, got {self.gather_bucket_mb}")
        if not isinstance(getattr(torch, self.muon.ns_dtype, None), torch.dtype):
            raise ValueError(f"MuonConfig.ns_dtype is not a torch dtype name: {self.muon.ns_dtype!r}")
        if self.muon.scale not in ("spectral", "match_adamw_rms"):
            raise ValueError(f"MuonConfig.scale must be spectral or match_adamw_rms, got {self.muon.scale!r}")
        if self.muon.ns_steps < 1:
            raise ValueError(f"MuonConfig.ns_steps must be >= 1, got {self.muon.ns_steps}")


@dataclass(frozen=True)
class ResolvedRule:
    """What one parameter gets after applying every matching ``ParamRule``."""

    algorithm: Algorithm
    lr_scale: float
    weight_decay: float


def resolve_rule(name: str, param: nn.Parameter, rules: list[ParamRule], config: OptimConfig) -> ResolvedRule:
    algorithm: Algorithm = "adamw"
    lr_scale, weight_decay = 1.0, None
    for rule in rules:
        if rule.match(name, param):
            algorithm = rule.algorithm or algorithm
            lr_scale = rule.lr_scale if rule.lr_scale is not None else lr_scale
            weight_decay = rule.weight_decay if rule.weight_decay is not None else weight_decay
    if algorithm not in ("adamw", "muon"):
        raise ValueError(f"parameter {name!r}: unknown algorithm {algorithm!r}")
    if algorithm == "muon" and param.ndim < 2:
        raise ValueError(f"parameter {name!r} has shape {tuple(param.shape)}: Muon needs a matrix")
    base = config.adamw if algorithm == "adamw" else config.muon
    return ResolvedRule(algorithm, lr_scale, base.weight_decay if weight_decay is None else weight_decay)
