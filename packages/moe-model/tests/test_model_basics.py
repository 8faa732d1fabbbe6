"""First checks of the model: shapes, grouped GEMM against a loop, layout-independent init."""

import pytest
import torch
from moe_model import (
    GroupedExperts,
    LocalDispatcher,
    MoEConfig,
    MoETransformer,
    grouped_mm,
    init_weights,
)

SMALL = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
             n_experts=8, top_k=2, expert_hidden=16)


def test_forward_shapes_and_finite():
    cfg = MoEConfig(**SMALL)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11))
    logits = model(tokens)
    assert logits.shape == (2, 11, cfg.vocab_size)
    assert torch.isfinite(logits).all()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_kv_heads"):
        MoEConfig(**{**SMALL, "n_kv_heads": 3})
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(**{**SMALL, "top_k": 9})


def test_bad_model_inputs_name_the_rule():
    from moe_model import partition_

    cfg = MoEConfig(**SMALL)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=0)
    for bad in (97, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} is outside \[0, vocab_size=97\)"):
            model(torch.tensor([[1, bad]]))
    with pytest.raises(ValueError, match=r"tokens: an empty batch \(0, 5\)"):
        model(torch.zeros(0, 5, dtype=torch.long))
    stage = partition_(model, range(1, 2))  # no embedding: hidden states in
    with pytest.raises(ValueError, match=r"takes hidden states \[B, S, d_model=32\] .* got torch.int64"):
        stage(torch.tensor([[1, 2]]))
    assert stage(torch.randn(1, 3, 32)).shape == (1, 3, 32)


def test_grouped_mm_matches_loop_with_empty_and_odd_groups():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(13, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 12, generator=g, requires_grad=True)
    offsets = torch.tensor([3, 3, 10, 13], dtype=torch.int32)  # expert 1 empty, odd sizes
    grad = torch.randn(13, 12, generator=g)
    out = grouped_mm(x, w, offsets, "grouped_mm")
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    ref = grouped_mm(x, w, offsets, "loop")
    rx, rw = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)
    assert gw[1].abs().sum() == 0


def test_local_dispatch_combine_equals_dense_mixture():
    torch.manual_seed(0)
    T, D, E, k = 9, 8, 4, 2
    experts = GroupedExperts(E, D, 6)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(T, D)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    weights = torch.rand(T, k)
    disp = LocalDispatcher(E)
    rows, offsets, handle = disp.dispatch(x, ids)
    assert offsets.dtype == torch.int32 and offsets[-1].item() == T * k
    y = disp.combine(experts(rows, offsets), weights, handle)
    ref = torch.zeros(T, D)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            h = torch.nn.functional.silu(x[t] @ experts.w1[e].T) * (x[t] @ experts.w3[e].T)
            ref[t] += weights[t, j] * (h @ experts.w2[e].T)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_init_does_not_depend_on_partition():
    cfg = MoEConfig(**SMALL)
    full = MoETransformer(cfg)
    init_weights(full, cfg, seed=7)
    part = MoETransformer(cfg)
    for i in ("0", "1"):
        del part.blocks[i]
    part.embed = None
    for _, layer in part.moe_layers():
        layer.experts.narrow_(4, 4)
    init_weights(part, cfg, seed=7)
    full_params = dict(full.named_parameters())
    shared = 0
    for name, p in part.named_parameters():
        ref = full_params[name]
        if ".experts." in name:
            ref = ref[4:8]
        assert torch.equal(p, ref), name
        shared += 1
    assert shared > 10
    other = MoETransformer(cfg)
    init_weights(other, cfg, seed=8)
    assert not torch.equal(other.blocks["0"].attn.wq.weight, full.blocks["0"].attn.wq.weight)
