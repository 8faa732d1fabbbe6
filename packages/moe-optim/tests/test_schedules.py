"""LR schedules: exact factors at the phase boundaries."""

import math

import pytest
from moe_optim import Cosine, LinearWarmup, WarmupStableDecay


def test_linear_warmup():
    s = LinearWarmup(4)
    assert [s(k) for k in (1, 2, 4, 100)] == [0.25, 0.5, 1.0, 1.0]
    assert LinearWarmup(0)(1) == 1.0


def test_cosine():
    s = Cosine(warmup_steps=2, total_steps=12, min_ratio=0.1)
    assert s(1) == 0.5 and s(2) == 1.0
    assert math.isclose(s(7), 0.1 + 0.9 * 0.5)  # halfway through the decay
    assert math.isclose(s(12), 0.1) and math.isclose(s(50), 0.1)


@pytest.mark.parametrize("shape,mid", [("linear", 0.5), ("cosine", 0.5), ("sqrt", 1 - math.sqrt(0.5))])
def test_warmup_stable_decay(shape, mid):
    s = WarmupStableDecay(warmup_steps=2, total_steps=20, decay_steps=10, min_ratio=0.0, shape=shape)
    assert s(1) == 0.5
    assert s(2) == s(10) == 1.0  # stable until the decay starts at step 10
    assert math.isclose(s(15), mid)
    assert s(20) == 0.0


def test_invalid_schedules_name_the_field():
    with pytest.raises(ValueError, match="Cosine.total_steps"):
        Cosine(warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match="WarmupStableDecay.decay_steps"):
        WarmupStableDecay(warmup_steps=2, total_steps=10, decay_steps=9)
    with pytest.raises(ValueError, match="LinearWarmup.warmup_steps"):
        LinearWarmup(-1)
