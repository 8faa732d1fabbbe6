"""moe_ddp: multi-group data parallelism with FP32 gradient buckets.

``MultiGroupDDP`` gives every parameter its own replica group (dense: the DP
group; routed experts: their EP-DP group), accumulates gradients in flat FP32
buckets across microbatches, and reduces them once per optimizer step, by
all-reduce or by reduce-scatter into per-tensor owner shards. Iterating it
yields ``(name, param, main_grad, group)``: the gradient source a distributed
optimizer consumes.
"""

from moe_ddp._triton_support import (
    BACKENDS,
    Backend,
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_ddp.accumulate import accumulate_, accumulate_reference_
from moe_ddp.ddp import DDPConfig, MultiGroupDDP, ReplicaGroupOf, sent_bytes
from moe_ddp.layout import ALIGN_NUMEL, BucketSpec, ParamEntry, is_sharded, plan_buckets

__all__ = [
    "ALIGN_NUMEL",
    "BACKENDS",
    "Backend",
    "BucketSpec",
    "DDPConfig",
    "MultiGroupDDP",
    "ParamEntry",
    "ReplicaGroupOf",
    "accumulate_",
    "accumulate_reference_",
    "is_sharded",
    "plan_buckets",
    "reference_kernels_enabled",
    "sent_bytes",
    "triton_available",
    "use_reference_kernels",
]
