"""Schedules: validity, known bubble fractions, memory bound, deadlock detection, message order."""

from __future__ import annotations

import pytest
from moe_pp import SCHEDULES, Action, Schedule, ScheduleError, make_schedule, simulate
from moe_pp.p2p import message_order

SHAPES = [(2, 1, 1), (2, 1, 4), (2, 2, 4), (3, 1, 5), (4, 1, 8), (4, 2, 8), (4, 3, 4), (8, 1, 16)]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,virtual,n_mb", SHAPES)
def test_schedules_build_and_complete(name, pp, virtual, n_mb):
    schedule = make_schedule(name, pp, virtual, n_mb)  # validates and simulates
    timeline = simulate(schedule)
    per_rank = 3 * virtual * n_mb  # F + B + W (or F + full B) ticks
    assert all(timeline.busy(r) == per_rank for r in range(pp))


@pytest.mark.parametrize("pp,virtual,n_mb", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 3, 8), (8, 1, 16)])
def test_bubble_fractions_match_theory(pp, virtual, n_mb):
    def bubble(name):
        return simulate(make_schedule(name, pp, virtual, n_mb)).bubble_fraction()

    # Per rank the pipeline fill and drain cost (pp - 1) chunk passes of F + B + W.
    classic = (pp - 1) / (virtual * n_mb + pp - 1)
    assert bubble("1f1b") == pytest.approx(classic)
    if virtual == 1:
        assert bubble("gpipe") == pytest.approx(classic)
        # ZB-H1: the drain is filled with deferred W, leaving (pp - 1)(F + B - W).
        assert bubble("zero_bubble") == pytest.approx((pp - 1) / (3 * n_mb + pp - 1))
    assert bubble("zero_bubble") < bubble("1f1b")


@pytest.mark.parametrize("pp,virtual,n_mb", [(4, 1, 8), (4, 2, 8), (8, 1, 16)])
def test_memory_bound(pp, virtual, n_mb):
    """1F1B holds fewer microbatches than GPipe; zero bubble no more than 1F1B's peak."""
    held = {
        name: [simulate(make_schedule(name, pp, virtual, n_mb)).peak_in_flight(r) for r in range(pp)]
        for name in SCHEDULES
    }
    assert held["gpipe"] == [virtual * n_mb] * pp
    assert max(held["1f1b"]) < virtual * n_mb
    assert max(held["zero_bubble"]) == max(held["1f1b"])


def test_bad_arguments_are_refused():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        make_schedule("pipedream", 2, 1, 4)
    with pytest.raises(ScheduleError, match="at least 2 ranks"):
        make_schedule("1f1b", 1, 1, 4)
    with pytest.raises(ScheduleError, match="multiple of pp"):
        make_schedule("1f1b", 4, 2, 6)


def _custom(orders) -> Schedule:
    return Schedule("custom", 2, 1, 2, False, tuple(tuple(Action(*a) for a in o) for o in orders))


def test_deadlock_is_detected():
    # Rank 1 wants microbatch 1 first; rank 0 sends it only after microbatch 0's backward.
    schedule = _custom([
        [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)],
        [("F", 1, 1), ("F", 1, 0), ("B", 1, 0), ("B", 1, 1)],
    ])
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(schedule)


@pytest.mark.parametrize("name", SCHEDULES)
def test_message_order_follows_each_senders_program(name):
    schedule = make_schedule(name, 4, 2, 8)
    messages = message_order(simulate(schedule))
    assert [m.tag for m in messages] == list(range(len(messages)))
    assert len({m.key for m in messages}) == len(messages)
    # 7 activation and 7 gradient hops per microbatch.
    assert len(messages) == 2 * (schedule.n_stages - 1) * schedule.n_microbatches
    for rank, order in enumerate(schedule.orders):
        produced = [
            ("activation" if a.kind == "F" else "gradient", a.stage, a.microbatch)
            for a in order
            if (a.kind == "F" and a.stage < schedule.n_stages - 1) or (a.kind == "B" and a.stage > 0)
        ]
        assert [m.key for m in messages if m.src_rank == rank] == produced
