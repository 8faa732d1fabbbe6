"""The fused router kernels (scores, top-k, weights, counts, z-loss in one kernel each
way): under the Triton interpreter on CPU, the CPU path staying eager, and on a GPU at
the bench shape against the eager path on the same tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import MoEConfig, TopKRouter, _triton_support, load_balancing_loss
from moe_model.router import (
    RoutingResult,
    count_per_expert,
    route_top_k,
    route_top_k_reference,
    router_logits,
    router_logits_reference,
)
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_fused_router_under_interpreter_matches_eager():
    run_under_triton_interpreter(Path(__file__).with_name("_router_interpret_check.py"))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_cpu_logits_take_the_eager_path(score):
    r = TopKRouter(MoEConfig(d_model=16, n_experts=8, top_k=2, router_score=score, norm_topk_weights=True,
                             bias_update_rate=0.1))
    with torch.no_grad():
        r.weight.normal_()
        r.expert_bias.normal_()
    x = torch.randn(12, 16)
    out = r(x)
    ref = route_top_k_reference(router_logits(x, r.weight), score, 2, True, r.expert_bias)
    assert out.probs.grad_fn.name() == ref.probs.grad_fn.name() != "FusedRoutingBackward"
    for field in ("expert_ids", "weights", "tokens_per_expert", "probs", "z_loss"):
        assert torch.equal(getattr(out, field), getattr(ref, field)), field


def _routing_and_grad(route, logits, upstream):
    """A routing of ``logits`` and d logits of ``sum(dw * weights) + c * balance(probs,
    counts) + dz * z_loss`` (the balancing loss hands the kernel a stride-0 gradient;
    ``counts`` is given, so both paths weigh the probabilities alike)."""
    dw, counts, c, dz = upstream
    r = route(logits)
    lb = load_balancing_loss(r.probs, counts)
    (grad,) = torch.autograd.grad((r.weights, lb, r.z_loss), logits, (dw, c, dz))
    return r, grad


@pytest.mark.gpu
@pytest.mark.parametrize(("score", "with_bias"), [("softmax", False), ("softmax", True), ("sigmoid", True)])
def test_fused_router_on_gpu_matches_eager_without_host_sync(score, with_bias):
    """T=8192, E=64, k=8 with normalised weights (the bench shape). The kernel's exp is
    the GPU's approximate one (~1e-6 relative), so an order of two keys less than that
    apart may differ from eager's: ids must agree except between such near-equal keys
    (rare: a handful of the 8192 rows at most), and values and gradients are compared on
    the rows whose ids agree."""
    T, E, k = 8192, 64, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (2 * torch.randn(T, E, device="cuda", generator=gen)).requires_grad_(True)
    bias = 0.02 * torch.randn(E, device="cuda", generator=gen) if with_bias else None
    sigmoid = score == "sigmoid"
    upstream = (torch.randn(T, k, device="cuda", generator=gen),
                torch.randint(1, 500, (E,), device="cuda", generator=gen),
                torch.tensor(0.37, device="cuda"), torch.tensor(0.3, device="cuda"))
    from moe_model._router_kernels import fused_routing

    def fused(lg):
        return RoutingResult(*fused_routing(lg, bias, k, sigmoid, True))

    eager, eager_grad = _routing_and_grad(lambda lg: route_top_k_reference(lg, score, k, True, bias), logits, upstream)
    runs = []

    def step():
        runs.append(_routing_and_grad(fused, logits, upstream))

    assert_no_host_sync(step)
    (first, first_grad), (got, grad) = runs[0], runs[-1]
    for a, b in zip((*first.__dict__.values(), first_grad), (*got.__dict__.values(), grad), strict=True):
        assert torch.equal(a, b), "two runs differ"
    assert got.probs.grad_fn.name() == "FusedRoutingBackward"
    assert got.expert_ids.dtype == got.tokens_per_expert.dtype == torch.int64

    scores = (eager.probs if not sigmoid else logits.sigmoid()).detach()
    key = scores + bias if bias is not None else scores
    # every pick is as good as eager's in its slot up to the exp's error
    torch.testing.assert_close(key.gather(1, got.expert_ids), key.gather(1, eager.expert_ids), rtol=1e-6,
                               atol=1e-7)
    same = (got.expert_ids == eager.expert_ids).all(1)
    assert same.sum() >= T - 8, f"{T - int(same.sum())} rows routed differently"
    assert torch.equal(got.tokens_per_expert, count_per_expert(got.expert_ids, E))
    torch.testing.assert_close(got.probs, eager.probs, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got.weights[same], eager.weights[same], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(got.z_loss, eager.z_loss, rtol=1e-5, atol=0)
    # d logits: a few times the exp's error relative, absolute where terms of the upstream
    # gradients' scale (~1) cancel
    torch.testing.assert_close(grad[same], eager_grad[same], rtol=2e-5, atol=2e-6)

    r = TopKRouter(MoEConfig(d_model=256, n_experts=E, top_k=k, router_score=score,
                             norm_topk_weights=True)).cuda()
    with torch.no_grad():
        r.weight.normal_(generator=gen)
    out = r(torch.randn(64, 256, device="cuda", generator=gen).bfloat16())
    assert out.weights.grad_fn.name() == "FusedRoutingBackward"


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_top_k_backends(score):
    def make():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(10, 6, generator=g).requires_grad_()
        bias = torch.randn(6, generator=g) if score == "sigmoid" else None
        return logits, score, 2, True, bias

    check_backend_api(_triton_support, route_top_k, route_top_k_reference, make)


def test_router_logits_backends():
    def make():
        g = torch.Generator().manual_seed(0)
        return (torch.randn(10, 16, generator=g).bfloat16().requires_grad_(),
                torch.randn(6, 16, generator=g).bfloat16().requires_grad_())

    check_backend_api(_triton_support, router_logits, router_logits_reference, make)
