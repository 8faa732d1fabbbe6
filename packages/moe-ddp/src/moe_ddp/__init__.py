"""moe_ddp: multi-group data parallelism with FP32 gradient buckets.

``MultiGroupDDP`` gives every parameter its own replica group (dense: the DP
group; routed experts: their EP-DP group), accumulates gradients in flat FP32
buckets across microbatches, and reduces them once per optimizer step, by
all-reduce or by reduce-scatter into per-tensor owner shards. Iterating it
yields ``(name, param, main_grad, group)``: the gradient source a distributed
optimizer consumes.
"""

from moe_ddp._triton_support import (
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_ddp.ddp import DDPConfig, MultiGroupDDP, ReplicaGroupOf, sent_bytes
from moe_ddp.layout import ALIGN_NUMEL, BucketSpec, ParamEntry, is_sharded, plan_buckets

__all__ = [
    "ALIGN_NUMEL",
    "BucketSpec",
    "DDPConfig",
    "MultiGroupDDP",
    "ParamEntry",
    "ReplicaGroupOf",
    "is_sharded",
    "plan_buckets",
    "reference_kernels_enabled",
    "sent_bytes",
    "triton_available",
    "use_reference_kernels",
]
