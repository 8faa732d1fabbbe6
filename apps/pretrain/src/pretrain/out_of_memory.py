"""A GPU that runs out of memory during a run, foreseen and reported the way the memory plan
explains it.

torch's ``OutOfMemoryError`` says how many bytes one allocation wanted; a user wants to
know whether the run can fit at all and what to change. The run's plan
(:mod:`pretrain.planner`, the numbers ``pretrain plan`` prints) answers both: the
message gives the plan's need against this GPU's memory and the least change that fits
(:mod:`pretrain.planner.remedies`), or says that the plan expected it to fit, so
something outside the plan holds memory. A run whose plan exceeds the GPU's whole memory
is warned about when it starts, before the minutes a large model takes to build.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pretrain.config import PretrainConfig
from pretrain.errors import PretrainError
from pretrain.planner import MemoryPlan, PlanRequest, plan_memory
from pretrain.planner.memory import GIB
from pretrain.planner.remedies import fewest_gpus, fitting_changes


class OutOfMemory(PretrainError):
    """The GPU ran out of memory; the message carries the plan's account of the run."""


def out_of_memory(cfg: PretrainConfig, world: int, gpu_gib: float, error: BaseException) -> OutOfMemory:
    """The one-line error for ``error`` (torch's, first line kept) in a run of ``cfg`` on
    ``world`` ranks whose GPUs hold ``gpu_gib`` each; planned with the planner's default
    headroom, as ``pretrain plan --gpu-gib`` would."""
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    try:
        plan = plan_memory(PlanRequest.from_config(cfg, world, gpu_gib=gpu_gib))
    except ValueError:  # a run the planner cannot model: torch's account alone
        return OutOfMemory(f"the GPU ran out of memory ({detail})")
    need = f"{_plan_needs(plan)} of this GPU's {gpu_gib:.1f}"
    advice = ("which the plan expected to fit: something outside the plan holds GPU memory "
              "(another process, or a fragmented allocator)" if plan.fits
              else _least_change(cfg, world, gpu_gib, plan))
    return OutOfMemory(f"the GPU ran out of memory ({detail}); {need}, {advice}; "
                       "`pretrain plan` with this config and world size lists the options")


def memory_warning(cfg: PretrainConfig, world: int, device: torch.device) -> str | None:
    """A line for the start of a run on a CUDA ``device`` whose memory plan exceeds the
    GPU's whole memory (no headroom: a run the plan cannot see fitting), with the least
    change that fits; ``None`` where it fits or the device is not a GPU. A warning, not a
    refusal: the plan is an estimate, and the run may still be what the user wants to try."""
    if device.type != "cuda":
        return None
    gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    try:
        plan = plan_memory(PlanRequest.from_config(cfg, world, gpu_gib=gpu_gib, headroom=0.0))
    except ValueError:  # a run the planner cannot model (e.g. its schedule): nothing to say
        return None
    if plan.fits:
        return None
    return (f"warning: {_plan_needs(plan)}, more than this GPU's {gpu_gib:.1f}: expect it to run "
            f"out of memory; {_least_change(cfg, world, gpu_gib, plan)} (`pretrain plan` lists "
            "the options)")


def _plan_needs(plan: MemoryPlan) -> str:
    worst = plan.worst
    return (f"the memory plan of this run needs {worst.device_total / GIB:.1f} GiB per GPU "
            f"(pp rank {worst.pp_rank})")


def _least_change(cfg: PretrainConfig, world: int, gpu_gib: float, plan: MemoryPlan) -> str:
    """The first offer of ``pretrain plan`` for a ``plan`` that does not fit, in words."""
    remedies = fitting_changes(cfg, world, most=1, gpu_gib=gpu_gib)
    if remedies:
        return f"it fits with {' '.join(remedies[0].overrides)}"
    more_gpus = fewest_gpus(cfg, world, gpu_gib=gpu_gib)
    where = more_gpus.describe() if more_gpus is not None else "use more GPUs or pipeline stages"
    return ("no change of expert-gradient merging, recompute or micro batch fits "
            f"({plan.worst.persistent / GIB:.1f} GiB of persistent state): {where}")


@contextmanager
def out_of_memory_explained(cfg: PretrainConfig, world: int, device: torch.device) -> Iterator[None]:
    """Turn torch's ``OutOfMemoryError`` on a CUDA ``device`` into :func:`out_of_memory`'s
    error (torch's stays its cause)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if device.type != "cuda":
            raise
        gib = torch.cuda.get_device_properties(device).total_memory / GIB
        raise out_of_memory(cfg, world, gib, e) from e
