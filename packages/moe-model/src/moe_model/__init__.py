"""moe_model: a mixture-of-experts transformer library with no parallelism inside.

Parallel wrappers (data, expert and pipeline parallelism) are applied to a built
model through what this package exposes: stable parameter names, a pluggable
token dispatcher per MoE layer, expert ranges, and layout-independent init.
"""

from moe_model.config import MoEConfig
from moe_model.dispatch import LocalDispatcher, TokenDispatcher
from moe_model.experts import GroupedExperts, grouped_mm
from moe_model.flops import active_params, flops_per_token, total_params
from moe_model.init import init_weights
from moe_model.loss import IGNORE_INDEX, lm_loss_sum
from moe_model.model import Block, MoETransformer, set_aux_loss_scale
from moe_model.moe import MoELayer, attach_aux_loss
from moe_model.router import RoutingResult, TopKRouter

__all__ = [
    "IGNORE_INDEX",
    "Block",
    "GroupedExperts",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "MoETransformer",
    "RoutingResult",
    "TokenDispatcher",
    "TopKRouter",
    "active_params",
    "attach_aux_loss",
    "flops_per_token",
    "grouped_mm",
    "init_weights",
    "lm_loss_sum",
    "set_aux_loss_scale",
    "total_params",
]
