"""The run's optimizer: moe_optim's ``DistributedOptimizer`` with the app's parameter policy.

The policy, as ``ParamRule``s (every matching rule applies, in order):

- no weight decay on vectors (norm gains, biases) and on the token embedding;
- routed experts' learning rate scaled by ``optim.expert_lr_mult``;
- with ``optim.name=muon``, Muon for the hidden matrices (attention, MLPs, router,
  stacked experts as a batch of matrices); the embedding and the LM head stay on
  AdamW, as Muon's authors recommend.

FP32 main weights and optimizer states are sharded over each parameter's replica
group (the same group its gradient is reduced over: DP for dense parameters,
EP-DP for routed experts). ``norm_group`` is the world, so the gradient norm
counts every logical parameter once across pipeline stages and expert shards.
Expert parameters carry their place in the logical tensor (a dim-0 slice under
EP), which is what checkpoints store them by. An FP32 parameter is its own main weight
(moe_optim); ``expert_weight_in_fp32`` says which routed-expert weights the model keeps
in FP32 for that reason under a narrower compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from moe_ddp import is_sharded
from moe_model import param_kind
from moe_optim import (
    AdamWConfig,
    DistributedOptimizer,
    GradSource,
    MuonConfig,
    OptimConfig,
    ParamRule,
    Placement,
)
from torch import nn

from pretrain.config import OptimConfig as AppOptimConfig

MIN_SHARD_NUMEL = 4096  # smaller tensors stay replicated; DDP and the optimizer must agree
_ADAMW_MATRICES = ("embed.weight", "head.weight")  # stay on AdamW under optim.name=muon


def expert_weight_in_fp32(name: str, numel: int, low_precision_targets: tuple[str, ...],
                          ep_dp: int) -> bool:
    """Whether the routed-expert weight ``name`` (``numel`` elements on this rank) stays FP32
    in a run whose compute dtype is narrower.

    A low-precision experts layer (``mxfp8.targets``, any recipe) runs no GEMM on its
    compute weights: its forward and input-gradient GEMMs read the weight caches, derived
    from the weights rounded to BF16 (the same values either way), and its weight
    gradients come from activations. Where the optimizer keeps the whole FP32 main weight
    on this rank (not sharded over the ``ep_dp`` replicas), the FP32 parameter is that main
    weight: 4 bytes per parameter instead of a 2-byte compute weight beside it. Sharded
    over ``G`` replicas the BF16 weight costs 2 + 4/G, no more for ``G`` >= 2, and its
    rebuild gathers half the bytes: those stay BF16."""
    if param_kind(name) != "expert" or is_sharded(numel, ep_dp, MIN_SHARD_NUMEL):
        return False
    from moe_mxfp8 import name_matches

    module = name.rpartition(".")[0]
    return any(name_matches(module, t) for t in low_precision_targets)


def param_rules(cfg: AppOptimConfig) -> list[ParamRule]:
    rules = [
        ParamRule(lambda n, p: p.ndim < 2 or n == "embed.weight", weight_decay=0.0),
        ParamRule(lambda n, p: param_kind(n) == "expert", lr_scale=cfg.expert_lr_mult),
    ]
    if cfg.name == "muon":
        rules.append(ParamRule(lambda n, p: p.ndim >= 2 and n not in _ADAMW_MATRICES,
                               algorithm="muon"))
    return rules


def optim_config(cfg: AppOptimConfig) -> OptimConfig:
    return OptimConfig(
        adamw=AdamWConfig(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                          weight_decay=cfg.weight_decay),
        muon=MuonConfig(lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay),
        max_grad_norm=cfg.grad_clip if cfg.grad_clip > 0 else None,
        min_shard_numel=MIN_SHARD_NUMEL,
    )


def placements(n_experts: int, expert_start: int) -> Callable[[str, nn.Parameter], Placement]:
    """Each parameter's logical shape: routed experts are a dim-0 slice from ``expert_start``
    of ``n_experts``; everything else is held whole."""

    def placement_of(name: str, param: nn.Parameter) -> Placement:
        if param_kind(name) == "expert":
            return Placement((n_experts, *param.shape[1:]), expert_start)
        return Placement(tuple(param.shape))

    return placement_of


def build_optimizer(grads: GradSource, cfg: AppOptimConfig, n_experts: int, expert_start: int,
                    device: torch.device) -> DistributedOptimizer:
    """The distributed optimizer over ``grads`` (the DDP wrapper); collective-free to build."""
    return DistributedOptimizer(
        grads, optim_config(cfg), norm_group=dist.group.WORLD, rules=param_rules(cfg),
        placement_of=placements(n_experts, expert_start), device=device,
    )
