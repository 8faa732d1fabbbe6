"""moe_model: a mixture-of-experts transformer library with no parallelism inside.

Parallel wrappers (data, expert and pipeline parallelism) are applied to a built
model through what this package exposes: stable parameter names and their kinds
(``moe_model.params``), a pluggable token dispatcher per MoE layer, expert and
layer ranges (``moe_model.partition``), and layout-independent init. Hugging Face
interop lives in ``moe_model.hf`` (needs the ``hf`` extra).
"""

from moe_model._triton_support import (
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_model.config import MoEConfig
from moe_model.dispatch import LocalDispatcher, ReportsDrops, TokenDispatcher
from moe_model.document_attention import DocumentMask, attended_pairs, documents_from_eos
from moe_model.experts import (
    ExpertWeightGradient,
    GroupedExperts,
    grouped_mm,
    resolve_backend,
)
from moe_model.flops import active_params, flops_per_token, total_params
from moe_model.generate import generate, next_token
from moe_model.init import init_weights
from moe_model.kv_cache import KVCache
from moe_model.loss import IGNORE_INDEX, lm_loss_sum
from moe_model.model import Block, MoETransformer
from moe_model.moe import CountReducer, MoELayer, attach_aux_loss
from moe_model.params import (
    EXPERT_DIM,
    dense_parameters,
    expert_parameters,
    logical_shapes,
    param_kind,
)
from moe_model.partition import expert_range, layer_range, partition_
from moe_model.router import RoutingResult, TopKRouter, load_balancing_loss, router_z_loss
from moe_model.sink import GradientSink
from moe_model.wiring import ModelWiring, wire_model

__all__ = [
    "EXPERT_DIM",
    "IGNORE_INDEX",
    "Block",
    "CountReducer",
    "DocumentMask",
    "ExpertWeightGradient",
    "GradientSink",
    "GroupedExperts",
    "KVCache",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "MoETransformer",
    "ModelWiring",
    "ReportsDrops",
    "RoutingResult",
    "TokenDispatcher",
    "TopKRouter",
    "active_params",
    "attach_aux_loss",
    "attended_pairs",
    "dense_parameters",
    "documents_from_eos",
    "expert_parameters",
    "expert_range",
    "flops_per_token",
    "generate",
    "grouped_mm",
    "init_weights",
    "layer_range",
    "lm_loss_sum",
    "load_balancing_loss",
    "logical_shapes",
    "next_token",
    "param_kind",
    "partition_",
    "reference_kernels_enabled",
    "resolve_backend",
    "router_z_loss",
    "total_params",
    "triton_available",
    "use_reference_kernels",
    "wire_model",
]
