"""Parameter metadata and FLOP accounting."""

import torch
from moe_model import (
    EXPERT_DIM,
    MoEConfig,
    MoETransformer,
    active_params,
    dense_parameters,
    expert_parameters,
    flops_per_token,
    logical_shapes,
    param_kind,
    partition_,
    total_params,
)

CFG = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, n_dense_layers=1)


def test_param_kinds_partition_the_parameters():
    model = MoETransformer(MoEConfig(**CFG))
    experts = {name for name, _, _ in expert_parameters(model)}
    dense = {name for name, _ in dense_parameters(model)}
    assert experts == {f"blocks.{i}.mlp.experts.{w}" for i in (1, 2) for w in ("w1", "w2", "w3")}
    assert not experts & dense and experts | dense == {n for n, _ in model.named_parameters()}
    assert all(param_kind(n) == "expert" for n in experts)
    assert param_kind("blocks.1.mlp.shared.w1.weight") == "dense"
    assert param_kind("blocks.1.mlp.router.weight") == "dense"
    assert EXPERT_DIM == 0


def test_expert_ranges_and_logical_shapes_describe_a_shard():
    cfg = MoEConfig(**CFG)
    shapes = logical_shapes(cfg)
    part = partition_(MoETransformer(cfg), layers=range(1, 3), experts=range(2, 6))
    for name, p, held in expert_parameters(part):
        assert held == range(2, 6)
        assert p.shape[EXPERT_DIM] == 4 and p.shape[1:] == shapes[name][1:]
        assert shapes[name][EXPERT_DIM] == 8
    assert shapes["blocks.0.mlp.w1.weight"] == (cfg.dense_hidden_width, 32)


def test_total_params_counts_the_model():
    for tie in (False, True):
        cfg = MoEConfig(**CFG, tie_embeddings=tie)
        model = MoETransformer(cfg)
        assert total_params(cfg) == sum(p.numel() for p in model.parameters())


def test_active_params_and_flops_by_hand():
    cfg = MoEConfig(**CFG)
    D, V, L = 32, 97, 3
    attn = D * 4 * 8 + 2 * D * 2 * 8 + 4 * 8 * D + 2 * 8  # q, k, v, o, qk-norm
    moe = D * 8 + 2 * 3 * D * 16 + 3 * D * 16  # router, top-2 experts, shared expert
    dense = 3 * D * cfg.dense_hidden_width
    expected = L * (attn + 2 * D) + 2 * moe + dense + D + V * D  # norms, final norm, head
    assert active_params(cfg) == expected
    assert flops_per_token(cfg, 128) == 6 * expected + 6 * L * 128 * 4 * 8
    # the input embedding is not counted, the head always is
    assert active_params(MoEConfig(**CFG, tie_embeddings=True)) == expected


def test_meta_model_has_no_storage():
    with torch.device("meta"):
        model = MoETransformer(MoEConfig(**CFG))
    assert all(p.is_meta for p in model.parameters())
