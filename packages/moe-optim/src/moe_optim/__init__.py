"""moe_optim: AdamW and Muon over sharded FP32 main weights, LR schedules, clipping.

``DistributedOptimizer`` reads reduced FP32 gradients from a ``GradSource``
(moe_ddp's ``MultiGroupDDP`` is one), keeps FP32 main weights and optimizer
states only for the shard of each tensor this rank owns inside the tensor's
replica group, clips by a global norm that counts every logical parameter once
across groups, updates, and rebuilds the compute weights in place with
coalesced all-gathers.
"""

from moe_optim.clipping import clip_coefficient, global_grad_norm
from moe_optim.config import AdamWConfig, MuonConfig, OptimConfig, ParamRule
from moe_optim.newton_schulz import newton_schulz, orthogonalize_many, update_scale
from moe_optim.optimizer import DistributedOptimizer, PlacementOf, StepStats
from moe_optim.protocols import GradSource, OwnedRange, Placement
from moe_optim.schedules import Cosine, LinearWarmup, WarmupStableDecay
from moe_optim.sharding import is_sharded

__all__ = [
    "AdamWConfig",
    "Cosine",
    "DistributedOptimizer",
    "GradSource",
    "LinearWarmup",
    "MuonConfig",
    "OptimConfig",
    "OwnedRange",
    "ParamRule",
    "Placement",
    "PlacementOf",
    "StepStats",
    "WarmupStableDecay",
    "clip_coefficient",
    "global_grad_norm",
    "is_sharded",
    "newton_schulz",
    "orthogonalize_many",
    "update_scale",
]
