"""Router: scores, selection bias, loss terms and the bias update against hand-computed values."""

import math

import pytest
import torch
from moe_model import MoEConfig, TopKRouter, load_balancing_loss, router_z_loss

E, K, D = 4, 2, 3
X = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, -1.0], [2.0, -1.0, 0.0], [0.5, 0.5, 0.5], [-1.0, 0.0, 1.0]])
W = torch.tensor([[0.5, -0.2, 0.1], [0.0, 0.3, -0.4], [-0.6, 0.2, 0.8], [0.3, 0.3, 0.3]])


def router(**kw):
    r = TopKRouter(MoEConfig(d_model=D, n_experts=E, top_k=K, **kw))
    with torch.no_grad():
        r.weight.copy_(W)
    return r


def hand_softmax(row):
    ex = [math.exp(v) for v in row]
    return [v / sum(ex) for v in ex]


def test_softmax_router_matches_hand_computation():
    out = router()(X)
    logits = [[sum(X[t, d].item() * W[e, d].item() for d in range(D)) for e in range(E)] for t in range(5)]
    probs = [hand_softmax(row) for row in logits]
    ids = [sorted(range(E), key=lambda e, p=p: -p[e])[:K] for p in probs]
    assert out.expert_ids.tolist() == ids
    torch.testing.assert_close(out.weights, torch.tensor([[p[e] for e in i] for p, i in zip(probs, ids, strict=True)]))
    counts = [sum(e in i for i in ids) for e in range(E)]
    assert out.tokens_per_expert.tolist() == counts
    # lb = E * sum_e f_e * sum_t p_te with f_e = counts_e / (T k)
    lb = E * sum(counts[e] / (5 * K) * sum(p[e] for p in probs) for e in range(E))
    torch.testing.assert_close(load_balancing_loss(out.probs, out.tokens_per_expert), torch.tensor(lb))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits)
    torch.testing.assert_close(out.z_loss, torch.tensor(z))
    torch.testing.assert_close(router_z_loss(torch.tensor(logits)), torch.tensor(z))


def test_balance_loss_gradient_treats_load_as_constant():
    probs = torch.rand(6, E).softmax(-1).requires_grad_()
    counts = torch.tensor([5, 1, 0, 6])
    (g,) = torch.autograd.grad(load_balancing_loss(probs, counts), probs)
    torch.testing.assert_close(g, (E * counts / counts.sum()).expand(6, E).float())


def test_sigmoid_scores_and_normalised_weights():
    out = router(router_score="sigmoid", norm_topk_weights=True)(X)
    scores = torch.sigmoid(X @ W.t())
    ids = scores.topk(K).indices
    assert torch.equal(out.expert_ids, ids)
    w = scores.gather(1, ids)
    torch.testing.assert_close(out.weights, w / w.sum(-1, keepdim=True))
    torch.testing.assert_close(out.probs, scores / scores.sum(-1, keepdim=True))


def test_bias_changes_selection_not_weights():
    r = router(bias_update_rate=0.1)
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # forces expert 3 into every top-k
    out = r(X)
    assert (out.expert_ids == 3).any(-1).all()
    probs = (X @ W.t()).softmax(-1)
    torch.testing.assert_close(out.weights, probs.gather(1, out.expert_ids))  # unbiased scores


def test_update_bias_follows_the_sign_rule():
    r = router(bias_update_rate=0.25)
    r.update_bias(torch.tensor([10, 2, 6, 6]))  # mean 6
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.25, 0.25, 0.0, 0.0]))
    r.update_bias(torch.tensor([10, 2, 6, 6]) * 7)  # only the sign counts: DP size, microbatches
    torch.testing.assert_close(r.expert_bias, torch.tensor([-0.5, 0.5, 0.0, 0.0]))
    disabled = router()
    disabled.update_bias(torch.tensor([10, 2, 6, 6]))
    assert disabled.expert_bias is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_router_runs_in_fp32(dtype):
    r = router()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r(X.to(dtype))
    assert out.probs.dtype == torch.float32 and out.weights.dtype == torch.float32


def test_16_bit_router_logits_match_fp32(monkeypatch):
    """The GPU path of the logits (16-bit operands, FP32 accumulation and output, the
    gradient split into three BF16 parts) against FP32 copies and an FP32 GEMM. On CPU
    the FP32-output GEMM is emulated (exact: products of 16-bit values are exact in FP32)."""
    from moe_model import router

    monkeypatch.setattr(router, "_mm_fp32", lambda a, b: a.float() @ b.float())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 64, generator=g).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(8, 64, generator=g)).bfloat16().requires_grad_()
    dlogits = torch.randn(96, 8, generator=g) * 1e-3
    logits = router._RouterLogits.apply(x, w)
    logits.backward(dlogits)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = x32 @ w32.t()
    want.backward(dlogits)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    # gradients in the operands' dtype: within one BF16 rounding of the FP32 ones
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=2**-8, atol=1e-9)
    torch.testing.assert_close(w.grad.float(), w32.grad, rtol=2**-8, atol=1e-9)
    # and rounded like them: the split keeps the gradient's FP32 precision until the
    # one rounding (without the low parts, a large share of elements would differ)
    for got, ref in ((x.grad, x32.grad), (w.grad, w32.grad)):
        assert (got != ref.bfloat16()).float().mean() < 0.02
