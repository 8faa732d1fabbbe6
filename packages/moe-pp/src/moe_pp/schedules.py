"""Pipeline schedules as per-rank action lists, and their simulated timelines.

A schedule is nothing but, for every PP rank, the order in which it runs
``F`` (forward), ``B`` (backward) and ``W`` (weight gradient) of each
(stage, microbatch). The runtime executes any such list; the timeline tool prints
it. Schedules that split the backward (zero bubble) run ``B`` as the
input-gradient pass only and ``W`` as the weight-gradient pass; the others run
the full backward in ``B`` and have no ``W``.

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: each rank runs ``warmup`` forwards, then alternates one forward and
  one backward, then drains the backwards (PipeDream-flush / Megatron). With
  ``virtual > 1`` it is interleaved 1F1B: forwards go in groups of ``pp``
  microbatches, chunk by chunk (Megatron's ordering; needs ``n_microbatches``
  divisible by ``pp``).
- ``zero_bubble`` (ZB-H1 style): the 1F1B order of ``F`` and ``B`` (input gradient
  only), with each ``W`` placed by a simulation: a rank runs a deferred ``W``
  whenever its next ``F``/``B`` is not ready yet (filling what would be a bubble),
  and at once when more than ``rank`` of them are waiting. Under 1F1B rank ``r``
  holds at most ``pp - r`` microbatches, so deferring up to ``r`` keeps every rank
  at rank 0's 1F1B peak: same peak activation memory, and the bubble drops from
  ``(pp-1)(F+B+W)`` to ``(pp-1)(F+B-W)`` per rank.

Timelines use integer costs (default ``F = B = W = 1``; a full backward costs
``B + W``). They serve three uses: checking that a schedule cannot deadlock,
ordering the point-to-point messages identically on every rank, and reporting
the bubble fraction.
"""

from __future__ import annotations

import typing
from collections import deque
from dataclasses import dataclass
from typing import Literal

ScheduleName = Literal["gpipe", "1f1b", "zero_bubble"]
SCHEDULES: tuple[ScheduleName, ...] = typing.get_args(ScheduleName)


class ScheduleError(ValueError):
    """A schedule that cannot be built or would deadlock."""


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" forward, "B" backward (input grad only if split), "W" weight grad
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


@dataclass(frozen=True)
class Costs:
    """Duration of each action in ticks (integers) for simulation."""

    F: int = 1
    B: int = 1  # input-gradient pass; a full backward costs B + W
    W: int = 1

    def __post_init__(self) -> None:
        for name in ("F", "B", "W"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ScheduleError(f"Costs.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Schedule:
    name: str  # one of SCHEDULES
    pp: int  # pipeline ranks
    virtual: int  # stages per rank
    n_microbatches: int
    split_backward: bool  # B computes input grads only; W computes weight grads
    orders: tuple[tuple[Action, ...], ...]  # per rank, in execution order

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.pp


@dataclass(frozen=True)
class TimedAction:
    action: Action
    rank: int
    start: int  # first tick
    end: int  # one past the last tick


@dataclass(frozen=True)
class Timeline:
    schedule: Schedule
    costs: Costs
    ranks: tuple[tuple[TimedAction, ...], ...]  # per rank, in execution order

    @property
    def makespan(self) -> int:
        return max(t.end for rank in self.ranks for t in rank)

    def busy(self, rank: int) -> int:
        return sum(t.end - t.start for t in self.ranks[rank])

    def bubble_fraction(self, rank: int | None = None) -> float:
        """Idle share of the makespan, of one rank or of all ranks together."""
        ranks = range(len(self.ranks)) if rank is None else [rank]
        idle = sum(self.makespan - self.busy(r) for r in ranks)
        return idle / (len(ranks) * self.makespan)

    def peak_in_flight(self, rank: int) -> int:
        """Most (stage, microbatch) pairs whose activations a rank holds at once.

        Held from the start of ``F`` until the end of the action that completes the
        backward (``W`` when split, else ``B``).
        """
        last = "W" if self.schedule.split_backward else "B"
        events = []
        for t in self.ranks[rank]:
            if t.action.kind == "F":
                events.append((t.start, 1))
            elif t.action.kind == last:
                events.append((t.end, -1))
        peak = held = 0
        for _, delta in sorted(events):
            held += delta
            peak = max(peak, held)
        return peak


def make_schedule(name: str, pp: int, virtual: int, n_microbatches: int) -> Schedule:
    """Build, validate and deadlock-check schedule ``name``."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")
    if pp < 2:
        raise ScheduleError(f"a pipeline needs at least 2 ranks, got pp={pp}")
    if virtual < 1:
        raise ScheduleError(f"virtual stages per rank must be >= 1, got {virtual}")
    if n_microbatches < 1:
        raise ScheduleError(f"n_microbatches must be >= 1, got {n_microbatches}")
    if virtual > 1 and n_microbatches % pp:
        raise ScheduleError(
            f"with virtual stages, n_microbatches ({n_microbatches}) must be a multiple of "
            f"pp ({pp}): forwards run in groups of pp microbatches per chunk"
        )
    fb_orders = []
    for rank in range(pp):
        forwards = _chunk_grouped(pp, virtual, n_microbatches, rank, "F", reverse_chunks=False)
        backwards = _chunk_grouped(pp, virtual, n_microbatches, rank, "B", reverse_chunks=True)
        fb_orders.append(_merge(forwards, backwards, _warmup(name, pp, virtual, n_microbatches, rank)))
    split = name == "zero_bubble"
    if split:
        caps = list(range(pp))  # rank r defers up to r weight passes
        placed = _simulate(fb_orders, pp, virtual, Costs(), split=True, w_caps=caps)
        orders = tuple(tuple(t.action for t in rank) for rank in placed)
    else:
        orders = tuple(tuple(o) for o in fb_orders)
    schedule = Schedule(name, pp, virtual, n_microbatches, split, orders)
    _validate(schedule)
    simulate(schedule)  # raises ScheduleError on a deadlock
    return schedule


def simulate(schedule: Schedule, costs: Costs | None = None) -> Timeline:
    """Run ``schedule`` on an idealised machine (zero-latency links) tick by tick."""
    costs = costs or Costs()
    ranks = _simulate(
        [list(o) for o in schedule.orders], schedule.pp, schedule.virtual, costs,
        split=schedule.split_backward, w_caps=None,
    )
    return Timeline(schedule, costs, tuple(tuple(r) for r in ranks))


def _chunk_grouped(
    pp: int, virtual: int, n_mb: int, rank: int, kind: str, reverse_chunks: bool
) -> list[Action]:
    """Microbatches in groups of ``pp``, each group through every chunk of the rank."""
    chunks = range(virtual - 1, -1, -1) if reverse_chunks else range(virtual)
    return [
        Action(kind, chunk * pp + rank, mb)
        for group in range(0, n_mb, pp)
        for chunk in chunks
        for mb in range(group, min(group + pp, n_mb))
    ]


def _warmup(name: str, pp: int, virtual: int, n_mb: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    total = virtual * n_mb
    if name == "gpipe":
        return total
    if virtual == 1:
        return min(total, pp - 1 - rank)
    # Interleaved: the first backward needs the microbatch to cross all pp*virtual
    # stages and come back, hence (virtual-1)*pp plus twice the distance to the end.
    return min(total, (virtual - 1) * pp + 2 * (pp - 1 - rank))


def _merge(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[len(forwards) - warmup :]


def _validate(schedule: Schedule) -> None:
    """Every action exactly once, on its stage's rank, F before B before W."""
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    expected = {
        Action(k, s, mb)
        for k in kinds
        for s in range(schedule.n_stages)
        for mb in range(schedule.n_microbatches)
    }
    seen: set[Action] = set()
    for rank, order in enumerate(schedule.orders):
        position = {}
        for i, action in enumerate(order):
            if action not in expected:
                raise ScheduleError(f"rank {rank} runs an unexpected action {action}")
            if action in seen:
                raise ScheduleError(f"action {action} appears twice")
            if schedule.rank_of(action.stage) != rank:
                raise ScheduleError(f"{action} is on rank {rank}, its stage lives on "
                                    f"rank {schedule.rank_of(action.stage)}")
            seen.add(action)
            position[action] = i
        for action, i in position.items():
            before = {"B": "F", "W": "B"}.get(action.kind)
            if before and position.get(Action(before, action.stage, action.microbatch), i) > i:
                raise ScheduleError(f"rank {rank} runs {action} before its {before}")
    if seen != expected:
        missing = sorted(expected - seen)[:4]
        raise ScheduleError(f"schedule misses {len(expected - seen)} actions, e.g. {missing}")


def _simulate(
    orders: list[list[Action]],
    pp: int,
    virtual: int,
    costs: Costs,
    split: bool,
    w_caps: list[int] | None,
) -> list[list[TimedAction]]:
    """Tick-by-tick execution of per-rank orders.

    With ``w_caps`` the orders hold only F and B, and each B's W is placed here: a
    rank runs its oldest deferred W when its next F/B is not ready, or when more
    than ``w_caps[rank]`` are deferred.
    """
    n_stages = pp * virtual
    cost = {"F": costs.F, "B": costs.B if split else costs.B + costs.W, "W": costs.W}
    end: dict[Action, int] = {}
    timed: list[list[TimedAction]] = [[] for _ in range(pp)]
    next_index = [0] * pp
    busy_until = [0] * pp
    deferred: list[deque[Action]] = [deque() for _ in range(pp)]

    def ready(action: Action, tick: int) -> bool:
        s, mb = action.stage, action.microbatch
        if action.kind == "F":
            deps = [] if s == 0 else [Action("F", s - 1, mb)]
        elif action.kind == "B":
            deps = [Action("F", s, mb)] + ([] if s == n_stages - 1 else [Action("B", s + 1, mb)])
        else:
            deps = [Action("B", s, mb)]
        return all(end.get(d, tick + 1) <= tick for d in deps)

    tick = 0
    while any(next_index[r] < len(orders[r]) or deferred[r] for r in range(pp)):
        started = False
        for r in range(pp):
            if busy_until[r] > tick:
                continue
            upcoming = orders[r][next_index[r]] if next_index[r] < len(orders[r]) else None
            can_run = upcoming is not None and ready(upcoming, tick)
            choice = None
            if w_caps is not None and deferred[r] and (len(deferred[r]) > w_caps[r] or not can_run):
                choice = deferred[r].popleft()
            elif can_run:
                choice = upcoming
                next_index[r] += 1
            if choice is None:
                continue
            finish = tick + cost[choice.kind]
            end[choice] = busy_until[r] = finish
            timed[r].append(TimedAction(choice, r, tick, finish))
            if w_caps is not None and choice.kind == "B":
                deferred[r].append(Action("W", choice.stage, choice.microbatch))
            started = True
        if not started and all(b <= tick for b in busy_until):
            stuck = {
                r: str(orders[r][next_index[r]])
                for r in range(pp)
                if next_index[r] < len(orders[r])
            }
            raise ScheduleError(f"schedule deadlocks at tick {tick}; ranks wait on {stuck}")
        tick += 1
    return timed
