"""moe_pp: pipeline parallelism for models shaped ``embed -> blocks -> norm -> head``.

Split a built model (any device, meta included) into stages whose parameter
names are the model's own, pick a schedule (GPipe, 1F1B, interleaved 1F1B, zero
bubble), and run one optimizer step's microbatches with ``Pipeline.step``,
composing with a data-parallel gradient synchroniser through ``GradSync``.
"""

from moe_pp.backward import WeightGradWork, backward_input, backward_weight
from moe_pp.costs import forward_flops_per_token, param_count
from moe_pp.protocols import GradSync, PipelineModel
from moe_pp.runtime import LossFn, Pipeline, PipelineConfig, build_pipeline
from moe_pp.schedules import (
    SCHEDULES,
    Action,
    Costs,
    Schedule,
    ScheduleError,
    ScheduleName,
    TimedAction,
    Timeline,
    make_schedule,
    simulate,
)
from moe_pp.split import POLICIES, SplitError, SplitPolicy, StageSplit, balanced_counts, split_model
from moe_pp.stages import RankStages, Stage, build_rank_stages, partial_model

__all__ = [
    "POLICIES",
    "SCHEDULES",
    "Action",
    "Costs",
    "GradSync",
    "LossFn",
    "Pipeline",
    "PipelineConfig",
    "PipelineModel",
    "RankStages",
    "Schedule",
    "ScheduleError",
    "ScheduleName",
    "SplitError",
    "SplitPolicy",
    "Stage",
    "StageSplit",
    "TimedAction",
    "Timeline",
    "WeightGradWork",
    "backward_input",
    "backward_weight",
    "balanced_counts",
    "build_pipeline",
    "build_rank_stages",
    "forward_flops_per_token",
    "make_schedule",
    "param_count",
    "partial_model",
    "simulate",
    "split_model",
]
