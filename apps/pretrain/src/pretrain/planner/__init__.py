"""The memory planner behind ``pretrain plan``.

- ``activations``: each block's tensors, as our code keeps them, per microbatch;
- ``stage``: one microbatch through a pipeline stage (held bytes, peaks);
- ``pipeline``: microbatches in flight under the configured schedule;
- ``persistent``: weights, FP32 gradient buckets, sharded optimizer state, caches;
- ``memory``: the plan of a config and layout, per pipeline rank;
- ``report`` / ``sweep``: the table, and layouts for a 12B-1.2T model family;
- ``measure``: ``LiveBytes``, the measurement the activation model is checked with;
- ``profile`` / ``comm`` / ``step_time`` / ``time_report``: the step-time model (a
  calibration ``Profile``, alpha-beta collectives, ``predict_step``) and its table;
  ``sweep.sweep_time`` ranks the layouts that fit by predicted tokens/s.
"""

from pretrain.planner.memory import (
    H200_GIB,
    MemoryPlan,
    PlanRequest,
    RankPlan,
    fitting_merge,
    plan_memory,
)
from pretrain.planner.persistent import ModelShapes
from pretrain.planner.profile import LINK_TABLE, Link, Profile, load_profile
from pretrain.planner.report import format_plan, summary_row
from pretrain.planner.step_time import StepTime, predict_step
from pretrain.planner.sweep import (
    FAMILY,
    GPU_COUNTS,
    FamilyMember,
    SweepResult,
    TimeSweepResult,
    sweep,
    sweep_time,
)
from pretrain.planner.time_report import format_step_time, time_row

__all__ = [
    "FAMILY",
    "GPU_COUNTS",
    "H200_GIB",
    "LINK_TABLE",
    "Link",
    "Profile",
    "StepTime",
    "TimeSweepResult",
    "FamilyMember",
    "MemoryPlan",
    "ModelShapes",
    "PlanRequest",
    "fitting_merge",
    "RankPlan",
    "SweepResult",
    "format_plan",
    "format_step_time",
    "load_profile",
    "plan_memory",
    "predict_step",
    "summary_row",
    "sweep",
    "sweep_time",
    "time_row",
]
