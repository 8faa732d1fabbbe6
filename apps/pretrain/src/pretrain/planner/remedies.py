"""What to change when a run does not fit: the config overrides whose plan fits.

``pretrain plan`` reports a layout that does not fit together with the changes that
would make it fit, searched over the three settings that trade speed for memory without
changing the model or the data a step sees:

- ``parallel.merge_expert_grad_microbatches`` down to 1 (fewer microbatches' expert
  weight-gradient operands held);
- ``model.recompute`` from ``none`` to ``selective`` to ``block`` (activations
  recomputed in the backward);
- ``train.micro_batch`` down through the divisors of its value (more, smaller
  microbatches; ``train.global_batch`` stays, so every divisor keeps it divisible).

Every combination is planned (at most a few dozen plans of pure arithmetic). Of the ones
that fit, those that depart further in every setting than another that fits are left
out; the rest are ranked by how few settings they change, then by how little they
depart from the run (each setting's steps away from its current value): the first is
the least change that fits. Options the config refuses (e.g. recompute with a zero-bubble
pipeline) are left out, as the app would refuse them.

Where none of them fits, :func:`fewest_gpus` looks for the smallest world size, doubling
up to ``MAX_GPU_FACTOR`` times the run's, on which the run fits as it is or with the least
change above: more data-parallel ranks shard the FP32 main weights and the optimizer
states (the distributed optimizer). The layout keys (pipeline stages, expert parallelism)
stay as they are, so a world counts only where the config stays valid there (the global
batch divisible by the data-parallel ranks).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pretrain.config import PretrainConfig
from pretrain.planner.memory import GIB, MemoryPlan, PlanRequest, plan_memory

RECOMPUTE_ORDER = ("none", "selective", "block")  # least memory last
MAX_GPU_FACTOR = 8  # fewest_gpus tries 2x, 4x and 8x the run's world size


@dataclass(frozen=True)
class Remedy:
    """Overrides (``KEY=VALUE``, as the command line takes them) and the plan they give."""

    overrides: tuple[str, ...]
    plan: MemoryPlan

    def to_json(self) -> dict:
        return {"overrides": list(self.overrides),
                "device_gib": self.plan.worst.device_total / GIB,
                "peak_allocated_gib": self.plan.worst.peak_allocated / GIB}


def _options(cfg: PretrainConfig) -> list[list[tuple[str, str, object]]]:
    """Per setting, its values from the current one on, least departure first."""
    merge = cfg.parallel.merge_expert_grad_microbatches
    # ``auto`` is planned as the most that fits already
    merges = (list(range(merge, 0, -1)) if merge != "auto" and cfg.parallel.fuse_grad_accumulation
              else [merge])
    recompute = RECOMPUTE_ORDER[RECOMPUTE_ORDER.index(cfg.model.recompute):]
    mb = cfg.train.micro_batch
    micro_batches = [mb] + [d for d in range(mb - 1, 0, -1) if mb % d == 0]
    return [[("parallel", "merge_expert_grad_microbatches", v) for v in merges],
            [("model", "recompute", v) for v in recompute],
            [("train", "micro_batch", v) for v in micro_batches]]


def fitting_changes(cfg: PretrainConfig, world: int, most: int = 3,
                    **planner: object) -> list[Remedy]:
    """Up to ``most`` sets of overrides whose plan of ``cfg`` on ``world`` ranks fits
    (``planner`` as ``PlanRequest.from_config`` takes it), the least change first (module
    notes); empty where nothing in the search fits. ``cfg`` itself is not planned."""
    options = _options(cfg)
    found: list[tuple[tuple[int, ...], Remedy]] = []
    for steps in itertools.product(*(range(len(o)) for o in options)):
        if not any(steps):
            continue
        trial, overrides = cfg, []
        for option, step in zip(options, steps, strict=True):
            if step:
                table, key, value = option[step]
                trial = trial.with_changes(table, **{key: value})
                overrides.append(f"{table}.{key}={value}")
        try:
            trial.validate()
            plan = plan_memory(PlanRequest.from_config(trial, world, **planner))
        except ValueError:  # a combination the app refuses (its ConfigError is a ValueError)
            continue
        if plan.fits:
            found.append((steps, Remedy(tuple(overrides), plan)))
    # a combination that departs at least as far in every setting as one that fits adds
    # nothing (each step away saves memory): only the least departures are offered
    least = [(steps, r) for steps, r in found
             if not any(other != steps and all(o <= s for o, s in zip(other, steps, strict=True))
                        for other, _ in found)]
    least.sort(key=lambda f: (sum(map(bool, f[0])), sum(f[0])))
    return [remedy for _, remedy in least[:most]]


@dataclass(frozen=True)
class MoreGpus:
    """The fewest GPUs on which a run fits, and the least change it then needs (none: fits as is)."""

    gpus: int
    remedy: Remedy

    def to_json(self) -> dict:
        return {"gpus": self.gpus, **self.remedy.to_json()}

    def describe(self) -> str:
        change = f" with {' '.join(self.remedy.overrides)}" if self.remedy.overrides else ""
        return (f"on {self.gpus} GPUs (--gpus {self.gpus}) it fits{change} "
                f"({self.remedy.plan.worst.device_total / GIB:.1f} GiB)")


def fewest_gpus(cfg: PretrainConfig, world: int, **planner: object) -> MoreGpus | None:
    """The smallest of 2, 4 ... ``MAX_GPU_FACTOR`` times ``world`` on which ``cfg`` fits,
    as it is or with :func:`fitting_changes`' least change (``planner`` as there); ``None``
    where none does or the config refuses every such world."""
    factor = 2
    while factor <= MAX_GPU_FACTOR:
        gpus, factor = factor * world, factor * 2
        try:
            plan = plan_memory(PlanRequest.from_config(cfg, gpus, **planner))
        except ValueError:  # a world the layout refuses (e.g. the batch does not divide)
            continue
        if plan.fits:
            return MoreGpus(gpus, Remedy((), plan))
        changes = fitting_changes(cfg, gpus, most=1, **planner)
        if changes:
            return MoreGpus(gpus, changes[0])
    return None


def format_remedies(plan: MemoryPlan, remedies: list[Remedy], more_gpus: MoreGpus | None) -> str:
    """Lines for ``pretrain plan`` under a plan that does not fit (``more_gpus``: looked for
    only where no remedy fits)."""
    if remedies:
        lines = ["fits with (the least change first; GiB on the device, worst rank):"]
        lines += [f"  {' '.join(r.overrides)}  ({r.plan.worst.device_total / GIB:.1f} GiB)"
                  for r in remedies]
        return "\n".join(lines)
    worst = plan.worst
    head = ("no change of parallel.merge_expert_grad_microbatches, model.recompute or "
            "train.micro_batch fits: the persistent state alone is "
            f"{worst.persistent / GIB:.1f} GiB on pp rank {worst.pp_rank}; ")
    if more_gpus is not None:
        return head + more_gpus.describe()
    return head + (f"nor does it on 2-{MAX_GPU_FACTOR}x the GPUs in this layout; pipeline "
                   "stages (parallel.pp) split the layers, expert parallelism (parallel.ep) the experts")
