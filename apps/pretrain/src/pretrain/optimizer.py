"""The single-replica optimizer: ``torch.optim.AdamW`` with the app's parameter policy.

This is the optimizer of runs without the distributed optimizer (moe_optim),
kept deliberately plain. The parameter policy is the part that carries over:
weight decay on matrices only (norm gains and other vectors are not decayed),
and the routed experts' learning rate scaled by ``optim.expert_lr_mult``. Each
param group carries an ``lr_mult`` so one scheduled LR sets every group.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config import OptimConfig


def routed_expert_params(model: nn.Module) -> set[int]:
    """``id`` of every routed-expert parameter (replicated over EP-DP, not DP)."""
    ids: set[int] = set()
    for _, layer in model.moe_layers():
        ids.update(id(p) for p in layer.experts.parameters())
    return ids


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    experts = routed_expert_params(model)
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault((p.ndim >= 2, id(p) in experts), []).append(p)
    return [
        {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0,
         "lr_mult": cfg.expert_lr_mult if expert else 1.0}
        for (decay, expert), params in sorted(groups.items())
    ]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    if cfg.name != "adamw":
        raise ValueError(f"optim.name={cfg.name!r} needs the distributed optimizer (moe_optim)")
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"]
