"""Stage construction: balanced and explicit splits, refusals, names, meta device."""

from __future__ import annotations

import itertools

import pytest
import torch
from moe_model import MoEConfig, MoETransformer, init_weights
from moe_pp import (
    SplitError,
    balanced_counts,
    build_rank_stages,
    forward_flops_per_token,
    split_model,
)
from torch import nn

CFG = dict(vocab_size=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=4, top_k=2, expert_hidden=16)


def _meta_model(**overrides) -> MoETransformer:
    with torch.device("meta"):
        return MoETransformer(MoEConfig(**{**CFG, **overrides}))


def _brute_force_max(costs, n_stages, first, last):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        loads = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(n_stages)]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def test_balanced_counts_is_optimal():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n = 3 + trial % 6
        stages = 1 + trial % n
        costs = torch.rand(n, generator=g).tolist()
        first, last = torch.rand(2, generator=g).tolist()
        counts = balanced_counts(costs, stages, first, last)
        assert len(counts) == stages and min(counts) >= 1 and sum(counts) == n
        bounds = [sum(counts[:s]) for s in range(stages + 1)]
        loads = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(stages)]
        loads[0] += first
        loads[-1] += last
        assert max(loads) == pytest.approx(_brute_force_max(costs, stages, first, last))


def test_flops_estimate_of_a_block_matches_the_formula():
    cfg = MoEConfig(**CFG)
    model = _meta_model()
    S, D, H, K, Dh = 16, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
    moe = D * cfg.n_experts + cfg.top_k * 3 * D * cfg.expert_hidden
    expected = 2 * (attn + moe) + 2 * S * H * Dh
    assert forward_flops_per_token(model.blocks["0"], S) == expected
    assert forward_flops_per_token(model.embed, S) == 0
    assert forward_flops_per_token(model.head, S) == 2 * D * cfg.vocab_size


def test_policies_weigh_embedding_and_head_differently():
    # A large vocabulary: the head dominates compute, embed and head both dominate memory.
    model = _meta_model(vocab_size=4096, n_layers=8)
    by_params = split_model(model, pp=4, blocks="params")
    by_flops = split_model(model, pp=4, blocks="flops", seq_len=16)
    params_counts = [len(s) for s in by_params.stage_blocks]
    flops_counts = [len(s) for s in by_flops.stage_blocks]
    assert params_counts[0] == params_counts[-1] < max(params_counts)
    assert flops_counts[-1] < flops_counts[0]
    assert sum(flops_counts) == sum(params_counts) == 8


def test_explicit_splits_and_virtual_assignment():
    model = _meta_model()
    split = split_model(model, pp=2, virtual=2, blocks=[1, 2, 2, 1])
    assert split.stage_blocks == (("0",), ("1", "2"), ("3", "4"), ("5",))
    assert split.stages_of(0) == [0, 2] and split.stages_of(1) == [1, 3]
    by_name = split_model(model, pp=2, blocks=[["0", "1", "2"], ["3", "4", "5"]])
    assert by_name.stage_blocks == (("0", "1", "2"), ("3", "4", "5"))


@pytest.mark.parametrize(
    "pp,virtual,blocks,message",
    [
        (2, 1, [6, 0], "stage 1 has 0 blocks"),
        (2, 1, [3, 2], "add up to 5, the model has 6"),
        (2, 1, [2, 2, 2], "lists 3 stages, the pipeline has 2"),
        (2, 1, [["0", "1", "2"], []], "stage 1 has zero blocks"),
        (2, 1, [["0", "1", "2"], ["2", "3", "4", "5"]], r"blocks \['2'\] are assigned to more than one"),
        (2, 1, [["0", "1"], ["2", "3", "4"]], r"blocks \['5'\] are not assigned"),
        (2, 1, [["0", "1", "2"], ["3", "4", "9"]], r"names blocks the model does not have: \['9'\]"),
        (2, 1, [["0", "2", "1"], ["3", "4", "5"]], "contiguous runs of blocks in model order"),
        (4, 2, "params", "cannot split 6 blocks into 8 stages"),
        (2, 1, "memory", "unknown split policy"),
        (2, 1, "flops", "needs seq_len"),
    ],
)
def test_impossible_splits_are_refused(pp, virtual, blocks, message):
    with pytest.raises(SplitError, match=message):
        split_model(_meta_model(), pp=pp, virtual=virtual, blocks=blocks)


def test_non_pipeline_models_are_refused():
    with pytest.raises(SplitError, match="missing: embed, blocks"):
        split_model(nn.Linear(2, 2), pp=2)
    model = _meta_model()
    model.scale = nn.Parameter(torch.ones(1, device="meta"))
    with pytest.raises(SplitError, match=r"parameters outside embed/blocks/norm/head \(scale\)"):
        split_model(model, pp=2)
    model = _meta_model()
    split = split_model(model, pp=2)
    del model.blocks["5"]
    with pytest.raises(SplitError, match="the split covers blocks"):
        build_rank_stages(model, split, 0)


def _tied_by_config() -> MoETransformer:
    """Tied in its config, the two parameters separate (as ``to_empty`` leaves them)."""
    model = _meta_model(tie_embeddings=True)
    model.head.weight = nn.Parameter(torch.empty_like(model.embed.weight))
    return model


def _tied_by_parameter() -> MoETransformer:
    model = _meta_model()
    model.head.weight = model.embed.weight
    return model


@pytest.mark.parametrize("make, why", [
    (lambda: _meta_model(tie_embeddings=True), r"head.weight is the embedding's"),
    (_tied_by_config, "config.tie_embeddings is set"),
    (_tied_by_parameter, r"head.weight is the embedding's"),
], ids=["tied", "config_only", "parameter_only"])
def test_tied_embeddings_are_refused(make, why):
    """The first stage would hold the parameter as embed.weight and the last as head.weight,
    each with only its part of the gradient."""
    model = make()
    with pytest.raises(SplitError, match=f"tied embeddings cannot be pipelined \\({why}"):
        split_model(model, pp=2)
    with pytest.raises(SplitError, match="tied embeddings"):
        build_rank_stages(model, split_model(_meta_model(), pp=2), 1)


def test_stages_keep_model_names_and_materialise_from_meta():
    cfg = MoEConfig(**CFG)
    full = MoETransformer(cfg)
    init_weights(full, cfg, seed=5)
    full_params = dict(full.named_parameters())
    meta = _meta_model()
    split = split_model(meta, pp=2, virtual=2, blocks="flops", seq_len=8)
    seen: list[str] = []
    for rank in range(2):
        rank_stages = build_rank_stages(meta, split, rank)
        rank_stages.module.to_empty(device="cpu")
        init_weights(rank_stages.module, cfg, seed=5)
        union = dict(rank_stages.module.named_parameters())
        stage_names = [n for s in rank_stages.stages for n, _ in s.module.named_parameters()]
        assert sorted(stage_names) == sorted(union), "stages and their union hold the same tensors"
        for stage in rank_stages.stages:
            assert (stage.module.embed is not None) == (stage.index == 0)
            assert (stage.module.head is not None) == (stage.index == split.n_stages - 1)
            for name, p in stage.module.named_parameters():
                assert p is union[name], f"{name}: stage and rank module must share parameters"
                assert torch.equal(p, full_params[name]), name
        seen += union
    assert sorted(seen) == sorted(full_params)
    assert len(meta.blocks) == cfg.n_layers, "splitting must not change the model"
