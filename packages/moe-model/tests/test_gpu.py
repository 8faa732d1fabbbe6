"""GPU checks: no host synchronisation in a warmed-up MoE step; kernels at real widths."""

import pytest
import torch

from moe_model import MoEConfig, MoELayer, MoETransformer, grouped_mm, init_weights, lm_loss_sum
from moe_model.experts import grouped_mm_loop
from moe_testing import assert_no_host_sync

pytestmark = pytest.mark.gpu

LAYER = dict(vocab_size=512, d_model=512, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128,
             n_experts=16, top_k=4, expert_hidden=256, z_loss_coef=1e-3)


@pytest.mark.parametrize("backend", ["triton", "grouped_mm"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_layer_step_has_no_host_sync(backend, capacity_factor):
    cfg = MoEConfig(**LAYER, grouped_mm_backend=backend, capacity_factor=capacity_factor,
                    lb_loss_granularity="global_batch", bias_update_rate=1e-3)
    layer = MoELayer(cfg).cuda()
    init_weights(layer, cfg, seed=0)
    layer.to(torch.bfloat16).train()
    x = torch.randn(2, 512, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        y = layer(x)
        y.float().square().sum().backward()
        stats = layer.pop_step_stats()
        layer.update_bias(stats["tokens_per_expert"])

    assert_no_host_sync(step)


def test_model_train_step_has_no_host_sync():
    cfg = MoEConfig(**LAYER, n_shared_experts=1, n_dense_layers=1, grouped_mm_backend="triton")
    model = MoETransformer(cfg).cuda()
    init_weights(model, cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 257), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        (lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
        for _, layer in model.moe_layers():
            layer.pop_step_stats()

    assert_no_host_sync(step)


@pytest.mark.parametrize("k_contiguous", [True, False])
def test_triton_matches_reference_at_real_widths(k_contiguous):
    g = torch.Generator(device="cuda").manual_seed(0)
    E, K, N = 16, 1024, 512
    sizes = torch.tensor([0, 517, 1, 0, 2048, 33, 700, 0, 129, 1000, 5, 0, 256, 300, 64, 3])
    offsets = sizes.cumsum(0).to(torch.int32).cuda()
    R = int(sizes.sum()) + 37  # padding rows past offsets[-1]
    x = (torch.randn(R, K, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    if k_contiguous:
        store = (torch.randn(E, N, K, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
        w = store.transpose(1, 2)
    else:
        store = (torch.randn(E, K, N, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
        w = store
    valid = int(sizes.sum())
    dy = torch.randn(R, N, device="cuda", generator=g).bfloat16()
    out = grouped_mm(x, w, offsets, "triton")
    dx, dw = torch.autograd.grad(out[:valid], (x, store), dy[:valid])
    ref = grouped_mm_loop(x.float(), w.float(), offsets)
    rdx, rdw = torch.autograd.grad(ref[:valid], (x, store), dy[:valid].float())
    torch.testing.assert_close(out[:valid].float(), ref[:valid], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx[:valid].float(), rdx[:valid].float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=2e-2, atol=5e-2)
    assert dw.float()[(sizes == 0).cuda()].abs().max() == 0


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_recompute_on_gpu_matches_no_recompute(policy):
    grads = []
    tokens = torch.randint(0, LAYER["vocab_size"], (2, 129), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    for recompute in ("none", policy):
        cfg = MoEConfig(**LAYER, grouped_mm_backend="triton", recompute=recompute)
        model = MoETransformer(cfg).cuda()
        init_weights(model, cfg, seed=0)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        (lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=2e-2, atol=1e-5, msg=name)
