"""Muon's orthogonalisation: against the published iteration, batching, owners."""

import math
import sys

import pytest
import torch
from moe_optim import MuonConfig, newton_schulz, orthogonalize_many, update_scale
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


# Relative Frobenius deviation of the BF16 iteration (the production default) from the
# float64 published one, measured on the matrices below and 4 more seeds: 0.029-0.037
# (FP32: 1e-6). One step fewer or more gives ~0.35, c = 2.0 instead of 2.0315 gives ~0.11.
BF16_TOL = 0.06
BF16_FLOOR = 0.01  # below this, the iteration did not run in BF16


def default_iteration_deviations() -> list[float]:
    """``orthogonalize_many`` with MuonConfig's defaults, against the float64 reference."""
    cfg = MuonConfig()
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(4, 32, 64, generator=gen), torch.randn(96, 48, generator=gen),
            torch.randn(40, 40, generator=gen)]
    got = orthogonalize_many(mats, cfg.ns_steps, getattr(torch, cfg.ns_dtype), "spectral")
    out = []
    for m, o in zip(mats, got, strict=True):
        want = torch.stack([reference(x) for x in m.reshape(-1, *m.shape[-2:])]).reshape(m.shape)
        want = want * math.sqrt(max(1.0, m.shape[-2] / m.shape[-1]))
        out.append(float((o.double() - want).norm() / want.norm()))
    return out


def test_default_bf16_iteration_matches_the_reference_within_bf16_rounding():
    cfg = MuonConfig()
    assert (cfg.ns_dtype, cfg.ns_steps) == ("bfloat16", 5)  # the production default the bound is for
    devs = default_iteration_deviations()
    assert all(BF16_FLOOR < d < BF16_TOL for d in devs), devs


@pytest.mark.parametrize("wrong", ["one_step_fewer", "one_step_more", "coefficient_c_2.0"])
def test_the_bf16_bound_rejects_a_wrong_iteration(monkeypatch, wrong):
    """Negative controls: the bound above is tight enough to tell these from BF16 rounding."""
    module = sys.modules["moe_optim.newton_schulz"]
    if wrong == "coefficient_c_2.0":
        monkeypatch.setattr(module, "_COEFFICIENTS", (3.4445, -4.7750, 2.0))
    else:
        delta = -1 if wrong == "one_step_fewer" else 1
        iterate = module.newton_schulz
        monkeypatch.setattr(module, "newton_schulz", lambda m, steps, dtype: iterate(m, steps + delta, dtype))
    devs = default_iteration_deviations()
    assert all(d > 1.5 * BF16_TOL for d in devs), devs
