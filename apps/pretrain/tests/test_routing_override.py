"""Forced routing for benchmarks: what "balanced" and "zipf" promise."""

import pytest
import torch
from moe_model import MoEConfig, MoETransformer
from pretrain.routing_override import force_routing, forced_ids


@pytest.mark.parametrize(("n_experts", "top_k"), [(64, 8), (8, 2), (10, 3), (6, 6)])
def test_balanced_gives_every_expert_the_same_rows_and_distinct_experts_per_token(n_experts, top_k):
    ids = forced_ids("balanced", 4 * n_experts, n_experts, top_k, seed=0)
    assert ids.shape == (4 * n_experts, top_k)
    assert torch.bincount(ids.reshape(-1), minlength=n_experts).tolist() == [4 * top_k] * n_experts
    assert all(len(set(row)) == top_k for row in ids.tolist())


@pytest.mark.parametrize("ep", [2, 4, 8])
def test_balanced_sends_each_token_to_as_many_ranks_as_random_routing_would(ep):
    """64 experts, top-8, rank r holds experts [r*64/ep, (r+1)*64/ep): every token reaches
    min(8, ep) ranks, as uniformly random top-8 choices almost always do."""
    ids = forced_ids("balanced", 1024, 64, 8, seed=0)
    ranks_per_token = [len(set(row)) for row in (ids // (64 // ep)).tolist()]
    assert set(ranks_per_token) == {min(8, ep)}


def test_zipf_is_skewed_towards_expert_zero_and_repeatable():
    ids = forced_ids("zipf", 4096, 16, 2, seed=3)
    counts = torch.bincount(ids.reshape(-1), minlength=16)
    assert counts.argmax() == 0 and counts[0] > 3 * counts[-1]
    assert all(len(set(row)) == 2 for row in ids.tolist())
    assert torch.equal(ids, forced_ids("zipf", 4096, 16, 2, seed=3))


def test_the_hook_routes_the_model_per_the_forced_ids():
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=8, top_k=2, expert_hidden=16)
    model = MoETransformer(cfg)
    handles = force_routing(model, "balanced")
    seen = []
    for _, layer in model.moe_layers():  # runs after the forcing hook: sees its result
        layer.router.register_forward_hook(lambda m, i, out: seen.append(out.expert_ids))
    model(torch.randint(0, 64, (2, 16)))
    want = forced_ids("balanced", 32, 8, 2, seed=0)
    assert len(seen) == 2 and all(torch.equal(s, want) for s in seen)
    with pytest.raises(ValueError, match="unknown routing mode"):
        force_routing(model, "uniform")
    for h in handles:
        h.remove()
