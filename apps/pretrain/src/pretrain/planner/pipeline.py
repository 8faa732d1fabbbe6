"""Microbatches in flight: the activation high-water mark of a pipeline rank.

A rank runs its schedule's actions one at a time (moe_pp's per-rank action lists).
A forward of (stage, microbatch) peaks at that stage's forward high-water mark on
top of everything the other in-flight microbatches hold, then keeps its held
bytes; a backward peaks likewise and releases them (a split backward releases at
its weight pass). Walking the exact action list of the configured schedule gives
the rank's peak and its largest number of microbatches in flight, whatever the
stages' sizes (the first stage has the token ids, the last the logits).

moe_pp issues its point-to-point operations lazily in one global message order
and drops a sent tensor only when a later send finds it delivered, so a rank can
hold receive buffers posted ahead and sent gradients not yet released. Measured
on two gloo ranks: one to three activation-sized messages; the plan reserves
``pp`` of them.

Zero bubble splits each backward (``B`` the input gradient, ``W`` the weight
gradients): ``B`` peaks at the stage's input-pass high-water mark and leaves the
microbatch holding what it keeps for ``W`` (everything saved, plus the dy operands
of the weight GEMMs, less the loss's saved logits), ``W`` peaks on top of that and
releases it (``stage.StageMemory``'s split figures). Checked on two gloo ranks with
wide experts, where the dy operands are a quarter of the last stage's activations.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from moe_pp import Schedule, make_schedule

from pretrain.planner.stage import StageMemory


@dataclass(frozen=True)
class RankActivations:
    peak: int  # high-water mark of activation bytes on the rank
    in_flight: int  # most (stage, microbatch) pairs held at once


def paired_microbatches(n_microbatches: int) -> int:
    """How many of a step's microbatches run in interleaved pairs
    (``parallel.ep_overlap_microbatches``; the trainer's ``microbatch_groups``): all but the
    last, less one left over from an odd count."""
    return (n_microbatches - 1) // 2 * 2


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, virtual: int, n_microbatches: int) -> Schedule:
    """Building a schedule simulates it (deadlock check): worth keeping for sweeps."""
    return make_schedule(name, pp, virtual, n_microbatches)


def rank_activations(stages: Mapping[int, StageMemory], pp: int, virtual: int, schedule: str,
                     n_microbatches: int, rank: int, message_bytes: int = 0,
                     pairs: bool = False) -> RankActivations:
    """Walk rank ``rank``'s actions of moe_pp schedule ``schedule`` (``gpipe``, ``1f1b``
    (interleaved with ``virtual > 1``), ``zero_bubble``); ``stages`` maps the rank's
    stage indices to their memory; ``message_bytes``: one activation (or its gradient)
    between stages. ``pairs`` (no pipeline): microbatches interleaved two at a time at the
    EP transport (``parallel.ep_overlap_microbatches``), which pairs all but the step's last:
    from three microbatches on, one peaks while the other holds what it keeps."""
    if pp == 1:  # no pipeline (the trainer ignores virtual stages there)
        if len(stages) != 1:
            raise ValueError(f"pp=1 runs one stage, got {len(stages)}")
        (only,) = stages.values()
        if pairs and paired_microbatches(n_microbatches):
            return RankActivations(only.held + only.peak, 2)
        return RankActivations(only.peak, 1)  # microbatches run one after another
    plan = _schedule(schedule, pp, virtual, n_microbatches)
    held = pp * message_bytes  # messages posted ahead or not yet released
    peak = in_flight = most = 0
    for action in plan.orders[rank]:
        stage = stages[action.stage]
        if action.kind == "F":
            peak = max(peak, held + stage.fwd_peak)
            held += stage.held
            in_flight += 1
            most = max(most, in_flight)
        elif action.kind == "B" and not plan.split_backward:
            peak = max(peak, held - stage.held + stage.bwd_peak)
            held -= stage.held
            in_flight -= 1
        elif action.kind == "B":  # the input pass: the microbatch keeps more until its W
            peak = max(peak, held - stage.held + stage.split_input_peak)
            held += stage.split_held - stage.held
        else:  # W
            peak = max(peak, held - stage.split_held + stage.split_weight_peak)
            held -= stage.split_held
            in_flight -= 1
    return RankActivations(peak, most)
