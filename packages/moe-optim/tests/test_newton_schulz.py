"""Muon's orthogonalisation: against the published iteration, batching, owners."""

import math

import pytest
import torch
from moe_optim import newton_schulz, orthogonalize_many, update_scale
from moe_optim.muon_exchange import assign_owners


def reference(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration exactly as published, one matrix, float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_matches_published_iteration(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = newton_schulz(g, 5, torch.float64)
    torch.testing.assert_close(got.double(), reference(g), rtol=1e-6, atol=1e-6)
    # Singular values land near 1: the point of the iteration.
    s = torch.linalg.svdvals(got.double())
    assert float(s.min()) > 0.6 and float(s.max()) < 1.25


def test_batched_experts_and_shapes_equal_one_by_one():
    gen = torch.Generator().manual_seed(2)
    mats = [torch.randn(3, 6, 8, generator=gen), torch.randn(6, 8, generator=gen),
            torch.randn(8, 6, generator=gen)]
    got = orthogonalize_many(mats, 5, torch.float32, "spectral")
    for m, o in zip(mats, got, strict=True):
        assert o.shape == m.shape
        want = torch.stack([reference(x) for x in m.reshape(-1, *m.shape[-2:])]).reshape(m.shape)
        want = want * math.sqrt(max(1.0, m.shape[-2] / m.shape[-1]))
        torch.testing.assert_close(o.double(), want, rtol=1e-5, atol=1e-5)


def test_update_scales():
    assert update_scale(torch.Size([8, 2]), "spectral") == 2.0
    assert update_scale(torch.Size([2, 8]), "spectral") == 1.0
    assert math.isclose(update_scale(torch.Size([4, 3, 16]), "match_adamw_rms"), 0.8)


def test_owner_assignment_balances_and_is_deterministic():
    costs = [10, 1, 7, 3, 3, 2]
    owners = assign_owners(costs, 3)
    assert owners == assign_owners(costs, 3)
    load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(3)]
    assert sorted(load) == [8, 8, 10]  # 10 | 7+1 | 3+3+2
