"""The memory planner behind ``pretrain plan``.

- ``activations``: each block's tensors, as our code keeps them, per microbatch;
- ``stage``: one microbatch through a pipeline stage (held bytes, peaks);
- ``pipeline``: microbatches in flight under the configured schedule;
- ``persistent``: weights, FP32 gradient buckets, sharded optimizer state, caches;
- ``memory``: the plan of a config and layout, per pipeline rank;
- ``report`` / ``sweep``: the table, and layouts for a 12B-1.2T model family;
- ``measure``: ``LiveBytes``, the measurement the activation model is checked with.
"""

from pretrain.planner.memory import H200_GIB, MemoryPlan, PlanRequest, RankPlan, plan_memory
from pretrain.planner.persistent import ModelShapes
from pretrain.planner.report import format_plan, summary_row
from pretrain.planner.sweep import FAMILY, GPU_COUNTS, FamilyMember, SweepResult, sweep

__all__ = [
    "FAMILY",
    "GPU_COUNTS",
    "H200_GIB",
    "FamilyMember",
    "MemoryPlan",
    "ModelShapes",
    "PlanRequest",
    "RankPlan",
    "SweepResult",
    "format_plan",
    "plan_memory",
    "summary_row",
    "sweep",
]
