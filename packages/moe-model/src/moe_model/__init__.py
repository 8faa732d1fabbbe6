"""moe_model: a mixture-of-experts transformer library with no parallelism inside.

Parallel wrappers (data, expert and pipeline parallelism) are applied to a built
model through what this package exposes: stable parameter names and their kinds
(``moe_model.params``), a pluggable token dispatcher per MoE layer, expert and
layer ranges (``moe_model.partition``), and layout-independent init. Hugging Face
interop lives in ``moe_model.hf`` (needs the ``hf`` extra).
"""

from moe_model._triton_support import (
    KERNEL_BACKENDS,
    Backend,
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_model.config import MoEConfig
from moe_model.dispatch import (
    EncodesRows,
    ExpertsFn,
    LocalDispatcher,
    PipelinesExperts,
    ReportsDrops,
    TokenDispatcher,
    combine_backward,
    combine_backward_reference,
    dropless_dispatch,
    dropless_layout,
    dropless_layout_reference,
    gather_rows,
    gather_rows_reference,
    weighted_gather_sum,
    weighted_gather_sum_reference,
)
from moe_model.document_attention import DocumentMask, attended_pairs, documents_from_eos
from moe_model.embedding import embedding_grad_accumulate_, embedding_grad_accumulate_reference_
from moe_model.experts import (
    ExpertWeightGradient,
    GroupedExperts,
    grouped_mm,
    grouped_mm_reference,
    resolve_backend,
)
from moe_model.flops import active_params, flops_per_token, total_params
from moe_model.generate import generate, next_token
from moe_model.init import init_weights
from moe_model.kv_cache import KVCache
from moe_model.layers import (
    add_rms_norm,
    add_rms_norm_reference,
    apply_rope,
    apply_rope_reference,
    qk_norm_rope,
    qk_norm_rope_reference,
    rms_norm,
    rms_norm_reference,
    swiglu,
    swiglu_reference,
)
from moe_model.loss import IGNORE_INDEX, lm_loss_sum, lm_loss_sum_reference
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
from moe_model.router import (
    RoutingResult,
    TopKRouter,
    load_balancing_loss,
    route_top_k,
    route_top_k_reference,
    router_logits,
    router_logits_reference,
    router_z_loss,
)
from moe_model.row_encoding import GRADIENT_ROW_ENCODER, INPUT_ROW_ENCODER, RowEncoder
from moe_model.sink import GradientSink
from moe_model.wiring import ModelWiring, wire_model

__all__ = [
    "Backend",
    "Block",
    "CountReducer",
    "DocumentMask",
    "EXPERT_DIM",
    "ExpertWeightGradient",
    "ExpertsFn",
    "GRADIENT_ROW_ENCODER",
    "INPUT_ROW_ENCODER",
    "RowEncoder",
    "GradientSink",
    "GroupedExperts",
    "IGNORE_INDEX",
    "KERNEL_BACKENDS",
    "KVCache",
    "LocalDispatcher",
    "MoEConfig",
    "MoELayer",
    "MoETransformer",
    "ModelWiring",
    "PipelinesExperts",
    "EncodesRows",
    "ReportsDrops",
    "RoutingResult",
    "TokenDispatcher",
    "TopKRouter",
    "active_params",
    "add_rms_norm",
    "add_rms_norm_reference",
    "apply_rope",
    "apply_rope_reference",
    "attach_aux_loss",
    "attended_pairs",
    "combine_backward",
    "combine_backward_reference",
    "gather_rows",
    "gather_rows_reference",
    "dense_parameters",
    "documents_from_eos",
    "dropless_dispatch",
    "dropless_layout",
    "dropless_layout_reference",
    "embedding_grad_accumulate_",
    "embedding_grad_accumulate_reference_",
    "expert_parameters",
    "expert_range",
    "flops_per_token",
    "generate",
    "grouped_mm",
    "grouped_mm_reference",
    "init_weights",
    "layer_range",
    "lm_loss_sum",
    "lm_loss_sum_reference",
    "load_balancing_loss",
    "logical_shapes",
    "next_token",
    "param_kind",
    "partition_",
    "qk_norm_rope",
    "qk_norm_rope_reference",
    "reference_kernels_enabled",
    "resolve_backend",
    "rms_norm",
    "rms_norm_reference",
    "route_top_k",
    "route_top_k_reference",
    "router_logits",
    "router_logits_reference",
    "router_z_loss",
    "swiglu",
    "swiglu_reference",
    "total_params",
    "triton_available",
    "use_reference_kernels",
    "weighted_gather_sum",
    "weighted_gather_sum_reference",
    "wire_model",
]
