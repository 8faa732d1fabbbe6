"""Layout-independent initialisation and the partition helpers."""

import pytest
import torch
from moe_model import (
    MoEConfig,
    MoETransformer,
    expert_range,
    init_weights,
    layer_range,
    partition_,
)

CFG = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, n_dense_layers=1,
           bias_update_rate=0.01)


def test_ranges():
    assert expert_range(8, 1, 2) == range(4, 8)
    assert [layer_range(10, s, 4) for s in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ValueError, match="n_experts"):
        expert_range(6, 0, 4)
    with pytest.raises(ValueError, match="stage"):
        layer_range(4, 4, 4)


@pytest.mark.parametrize("tie", [False, True])
def test_partition_holds_the_full_models_values(tie):
    """Full model vs. a model built on meta holding experts 4..7 of 8 and layers 2..3 of 4."""
    cfg = MoEConfig(**CFG, tie_embeddings=tie)
    full = MoETransformer(cfg)
    init_weights(full, cfg, seed=7)
    with torch.device("meta"):
        part = partition_(MoETransformer(cfg), layers=range(2, 4), experts=expert_range(8, 1, 2))
    part.to_empty(device="cpu")
    init_weights(part, cfg, seed=7)
    assert part.embed is None and part.head is not None and sorted(part.blocks) == ["2", "3"]
    full_state = full.state_dict()
    checked = 0
    for name, t in part.state_dict().items():
        ref = full_state[name]
        if name.endswith((".experts.w1", ".experts.w2", ".experts.w3")):
            ref = ref[4:8]
        assert torch.equal(t, ref), name
        checked += 1
    assert checked >= 20
    if tie:  # the head alone on the last stage still gets the embedding's values
        assert torch.equal(part.head.weight, full.embed.weight)
        with torch.device("meta"):
            whole = MoETransformer(cfg)
        whole.to_empty(device="cpu")
        init_weights(whole, cfg, seed=7)
        assert whole.head.weight is whole.embed.weight
    for _, layer in part.moe_layers():
        assert layer.experts.expert_range == range(4, 8)
        assert (layer.router.expert_bias == 0).all()


def test_partitioned_stages_compose_to_the_full_model():
    cfg = MoEConfig(**{**CFG, "bias_update_rate": 0.0})
    full = MoETransformer(cfg)
    init_weights(full, cfg, seed=1)
    stages = []
    for s in range(2):
        stage = partition_(MoETransformer(cfg), layers=layer_range(4, s, 2))
        init_weights(stage, cfg, seed=1)
        stages.append(stage)
    tokens = torch.randint(0, 97, (2, 7))
    torch.testing.assert_close(stages[1](stages[0](tokens)), full(tokens), rtol=0, atol=0)


def test_different_seeds_differ():
    cfg = MoEConfig(**CFG)
    a, b = MoETransformer(cfg), MoETransformer(cfg)
    init_weights(a, cfg, seed=0)
    init_weights(b, cfg, seed=1)
    assert not torch.equal(a.blocks["1"].mlp.experts.w1, b.blocks["1"].mlp.experts.w1)


def test_partition_rejects_bad_ranges():
    model = MoETransformer(MoEConfig(**CFG))
    with pytest.raises(ValueError, match="layers"):
        partition_(model, layers=range(3, 5))
    with pytest.raises(ValueError, match="experts"):
        partition_(model, experts=range(6, 10))
