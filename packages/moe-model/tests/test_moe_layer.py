"""The MoE layer and model: auxiliary losses, global-batch balancing over ranks,
recompute policies, shared experts and dense layers."""

import pytest
import torch
import torch.distributed as dist
from moe_model import (
    LocalDispatcher,
    ModelWiring,
    MoEConfig,
    MoELayer,
    MoETransformer,
    PipelinesExperts,
    init_weights,
    lm_loss_sum,
    load_balancing_loss,
    wire_model,
)
from moe_testing import run_distributed

SMALL = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
             n_experts=8, top_k=2, expert_hidden=16)


def layer_and_input(seed=0, T=24, **kw):
    cfg = MoEConfig(**{**SMALL, **kw})
    layer = MoELayer(cfg)
    init_weights(layer, cfg, seed=seed)
    x = torch.randn(1, T, cfg.d_model, generator=torch.Generator().manual_seed(seed + 1))
    return cfg, layer, x


def test_aux_loss_gradient_is_scaled_and_reaches_the_router():
    cfg, layer, x = layer_and_input(lb_loss_coef=0.5, z_loss_coef=0.25)
    scale = 1 / 48
    layer.aux_loss_scale = scale
    y = layer(x)
    (g_total,) = torch.autograd.grad(y.sum(), layer.router.weight)
    # the same layer without auxiliary losses, plus the aux terms computed by hand
    routing = layer.router(x.view(-1, cfg.d_model))
    aux = 0.5 * load_balancing_loss(routing.probs, routing.tokens_per_expert) + 0.25 * routing.z_loss
    (g_aux,) = torch.autograd.grad(aux * scale, layer.router.weight)
    layer.lb_coef = layer.z_coef = 0.0
    (g_main,) = torch.autograd.grad(layer(x).sum(), layer.router.weight)
    torch.testing.assert_close(g_total, g_main + g_aux)


def test_step_stats_accumulate_and_reset():
    _, layer, x = layer_and_input(capacity_factor=0.5)
    layer(x)
    layer(x)
    s = layer.pop_step_stats()
    assert s["n_tokens"].item() == 48
    assert s["tokens_per_expert"].sum().item() == 48 * 2
    assert s["dropped_per_expert"].sum().item() > 0
    assert s["lb_loss_sum"].item() > 0 and s["z_loss_sum"].item() > 0
    assert layer.pop_step_stats() == {}
    layer(x)
    first = layer.take_step_stats()  # a group of microbatches; the step goes on
    layer(x)
    second = layer.take_step_stats()
    assert layer.take_step_stats() == {}
    assert (first["n_tokens"] + second["n_tokens"]).item() == 48
    for key in ("tokens_per_expert", "dropped_per_expert", "lb_loss_sum", "z_loss_sum"):
        assert torch.equal(first[key] + second[key], s[key]), key


def test_unpopped_stats_are_folded_and_still_sum_exactly(monkeypatch):
    """Training forwards never popped are summed every ``_FOLD_EVERY`` entries: the list
    stays short and the totals equal those of one forward times the count."""
    from moe_model import moe

    monkeypatch.setattr(moe, "_FOLD_EVERY", 4)
    _, layer, x = layer_and_input(capacity_factor=0.5)
    layer(x)
    one = layer.pop_step_stats()
    for _ in range(11):
        layer(x)
    assert len(layer._pending) < 4
    s = layer.pop_step_stats()
    for key in ("tokens_per_expert", "dropped_per_expert", "n_tokens"):
        assert torch.equal(s[key], one[key] * 11), key
    for key in ("lb_loss_sum", "z_loss_sum"):
        torch.testing.assert_close(s[key], one[key] * 11)


def test_global_batch_counts_run_over_the_step():
    """Microbatch m balances against the counts of microbatches 1..m; the step boundary resets."""
    _, layer, x = layer_and_input(lb_loss_granularity="global_batch")
    x1, x2 = x[:, :12], x[:, 12:]
    c1 = layer.router(x1.view(12, -1)).tokens_per_expert
    c2 = layer.router(x2.view(12, -1)).tokens_per_expert
    layer(x1)
    running = layer._step_counts
    assert torch.equal(layer._balance_counts(c2), c1 + c2)
    assert layer.take_step_stats()["tokens_per_expert"].sum() > 0  # the step goes on
    assert torch.equal(layer._balance_counts(c1), c1 + c2 + c1)
    layer.pop_step_stats()
    assert torch.equal(layer._balance_counts(c2), c2)
    # one buffer, updated in place: a forward captured in a CUDA graph keeps adding to it
    assert layer._step_counts is running


def _global_batch_rank() -> None:
    rank = dist.get_rank()
    cfg, layer, x = layer_and_input(seed=3, T=32, lb_loss_granularity="global_batch", lb_loss_coef=1.0)
    wire_model(layer, ModelWiring(count_reducer=lambda c: (dist.all_reduce(c), c)[1]))
    layer.aux_loss_scale = 1 / 32
    mine = x[:, rank * 16:(rank + 1) * 16]
    (g,) = torch.autograd.grad(layer(mine).sum() * 0, layer.router.weight)  # aux-loss gradient only
    dist.all_reduce(g)
    # oracle: one process routing the whole global batch at once
    oracle = MoELayer(cfg)
    init_weights(oracle, cfg, seed=3)
    oracle.aux_loss_scale = 1 / 32
    (g_ref,) = torch.autograd.grad(oracle(x).sum() * 0, oracle.router.weight)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)
    # and microbatch granularity differs (the point of the option)
    local = MoELayer(MoEConfig(**{**SMALL, "lb_loss_coef": 1.0}))
    init_weights(local, cfg, seed=3)
    local.aux_loss_scale = 1 / 32
    (g_local,) = torch.autograd.grad(local(mine).sum() * 0, local.router.weight)
    dist.all_reduce(g_local)
    assert not torch.allclose(g_local, g_ref, rtol=1e-3, atol=1e-6)


@pytest.mark.multiprocess
def test_global_batch_balancing_over_two_ranks_matches_one_process():
    run_distributed(_global_batch_rank, 2, timeout=120)


@pytest.mark.parametrize("policy", ["block", "selective"])
def test_recompute_gives_identical_gradients_and_stats(policy):
    base = dict(SMALL, n_shared_experts=1, n_dense_layers=1, z_loss_coef=1e-2, capacity_factor=1.0,
                lb_loss_granularity="global_batch")
    tokens = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in ("none", policy):
        cfg = MoEConfig(**base, recompute=recompute)
        model = MoETransformer(cfg)
        init_weights(model, cfg, seed=0)
        wire_model(model, ModelWiring(aux_loss_scale=1 / 24))
        (lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / 24).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        stats = [layer.pop_step_stats() for _, layer in model.moe_layers()]
        results.append((grads, stats))
    (g0, s0), (g1, s1) = results
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=name)
    for a, b in zip(s0, s1, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shared_experts_and_dense_layers():
    cfg = MoEConfig(**SMALL, n_shared_experts=2, shared_expert_hidden=8, n_dense_layers=1,
                    dense_hidden=24, tie_embeddings=True)
    model = MoETransformer(cfg)
    names = dict(model.named_parameters())
    assert names["blocks.0.mlp.w1.weight"].shape == (24, 32)
    assert names["blocks.1.mlp.shared.w1.weight"].shape == (16, 32)
    assert "blocks.0.mlp.router.weight" not in names
    assert [n for n, _ in model.moe_layers()] == ["blocks.1.mlp", "blocks.2.mlp"]
    assert model.head.weight is model.embed.weight and "head.weight" not in names
    init_weights(model, cfg, seed=0)
    logits = model(torch.randint(0, 97, (2, 5)))
    assert logits.shape == (2, 5, 97) and torch.isfinite(logits).all()


def swiglu_by_hand(x, w1, w3, w2):
    """silu(x W1^T) * (x W3^T) W2^T."""
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def routed_reference(x, ids, weights, w1, w3, w2):
    """sum_j w[t,j] * expert_{ids[t,j]}(x[t]), one token at a time (test_dispatch's
    dense_reference, dropless)."""
    y = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            y[t] = y[t] + weights[t, j] * swiglu_by_hand(x[t], w1[e], w3[e], w2[e])
    return y


def fp64_leaves(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def assert_matches_fp64(got, want, params, params64, seed):
    """FP32 output and weight gradients against the FP64 oracle (an FP32 GEMM over 32 terms:
    well inside 2e-5 relative)."""
    torch.testing.assert_close(got, want.float(), rtol=2e-5, atol=2e-6)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(got, params, dy)
    grads64 = torch.autograd.grad(want, params64, dy.double())
    for a, b in zip(grads, grads64, strict=True):
        torch.testing.assert_close(a, b.float(), rtol=2e-5, atol=2e-6)


def test_shared_experts_add_their_swiglus_ungated_to_the_routed_mixture():
    """The layer's output is the routed mixture plus, for each of the 2 shared experts
    (hidden 8 each: rows [8s, 8s+8) of the fused width-16 shared SwiGLU), that expert's
    SwiGLU of x with weight 1; weight gradients likewise (the routing itself is the
    router's tests' business: its ids and weights are taken as given)."""
    cfg, layer, x = layer_and_input(seed=4, T=10, n_shared_experts=2, shared_expert_hidden=8)
    layer.eval()
    y = layer(x).view(10, cfg.d_model)
    x_TD = x.view(10, cfg.d_model)
    with torch.no_grad():
        routing = layer.router(x_TD)
    sh, ex, H = layer.shared, layer.experts, 8
    assert sh.w1.weight.shape == sh.w3.weight.shape == (2 * H, cfg.d_model)
    assert sh.w2.weight.shape == (cfg.d_model, 2 * H)
    params = [ex.w1, ex.w3, ex.w2, sh.w1.weight, sh.w3.weight, sh.w2.weight]
    e1, e3, e2, s1, s3, s2 = params64 = fp64_leaves(params)
    x64 = x_TD.double()
    shared = sum(swiglu_by_hand(x64, s1[s * H:(s + 1) * H], s3[s * H:(s + 1) * H], s2[:, s * H:(s + 1) * H])
                 for s in range(2))
    routed = routed_reference(x64, routing.expert_ids, routing.weights.double(), e1, e3, e2)
    assert shared.abs().max() > 0.3 * routed.abs().max()  # neither part is negligible
    assert_matches_fp64(y, routed + shared, params, params64, seed=5)


def test_a_dense_layer_is_a_swiglu_mlp_of_the_dense_width():
    """The first ``n_dense_layers`` blocks: an MLP silu(x W1^T) * (x W3^T) W2^T of width
    dense_hidden (default: the MoE layer's active width, top_k * expert_hidden + shared)."""
    cfg = MoEConfig(**SMALL, n_shared_experts=1, n_dense_layers=2)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=2)
    assert [n for n, _ in model.moe_layers()] == ["blocks.2.mlp"]
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    for i in ("0", "1"):
        mlp = model.blocks[i].mlp
        assert mlp.w1.weight.shape == mlp.w3.weight.shape == (2 * 16 + 16, 32)
        params = [mlp.w1.weight, mlp.w3.weight, mlp.w2.weight]
        params64 = fp64_leaves(params)
        assert_matches_fp64(mlp(x), swiglu_by_hand(x.double(), *params64), params, params64, seed=6)


@pytest.mark.parametrize("granularity", ["microbatch", "global_batch"])
def test_an_evaluation_forward_between_steps_leaves_the_next_step_alone(granularity):
    """A validation pass (eval mode, no autograd) after a step: the next step's balancing
    gradient, its popped loads (which drive the bias step) and the reducer (a collective)
    are what they are without it."""
    def next_step(evaluate):
        _, layer, x = layer_and_input(T=24, lb_loss_granularity=granularity, lb_loss_coef=1.0)
        calls = []
        layer.count_reducer = lambda c: (calls.append(1), c)[1]
        layer.aux_loss_scale = 1 / 24
        if evaluate:
            layer.eval()
            with torch.no_grad():
                layer(torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(9)))
            layer.train()
        (grad,) = torch.autograd.grad(layer(x).sum() * 0, layer.router.weight)  # the aux loss's only
        return grad, layer.pop_step_stats(), len(calls)

    want_grad, want_stats, want_calls = next_step(False)
    grad, stats, calls = next_step(True)
    assert torch.equal(grad, want_grad) and calls == want_calls
    assert stats.keys() == want_stats.keys()
    for key in want_stats:
        assert torch.equal(stats[key], want_stats[key]), key


class _TwoHalves:
    """A ``PipelinesExperts`` stand-in: a local dispatcher's calls, the tokens in two halves."""

    def __init__(self, local: LocalDispatcher) -> None:
        self.local, self.calls = local, 0

    def dispatch(self, x, expert_ids, weights=None):
        return self.local.dispatch(x, expert_ids, weights)

    def combine(self, rows_out, weights, handle):
        return self.local.combine(rows_out, weights, handle)

    def run_experts(self, x, expert_ids, weights, experts):
        self.calls += 1
        ys, handles = [], []
        for xc, ic, wc in zip(x.tensor_split(2), expert_ids.tensor_split(2), weights.tensor_split(2), strict=True):
            rows, offsets, handle = self.local.dispatch(xc, ic, wc)
            ys.append(self.local.combine(experts(rows, offsets), wc, handle))
            handles.append(handle)
        return torch.cat(ys), handles

    def dropped_per_expert(self, handles):
        return sum(h.dropped_per_expert for h in handles)


def test_a_dispatcher_that_pipelines_the_experts_runs_them():
    """The layer hands the experts to a ``PipelinesExperts`` dispatcher and reports the drops
    of the handle it returns; the result is the local dispatch of each half."""
    cfg, layer, x = layer_and_input(capacity_factor=1.0, lb_loss_coef=0.0, z_loss_coef=0.0)
    stand_in = _TwoHalves(LocalDispatcher(cfg.n_experts, cfg.capacity_factor))
    assert isinstance(stand_in, PipelinesExperts) and not isinstance(layer.dispatcher, PipelinesExperts)
    wire_model(layer, ModelWiring(dispatchers={"": stand_in}))
    x = x.requires_grad_(True)
    y = layer(x)
    (dx,) = torch.autograd.grad((y * y).sum(), x)
    assert stand_in.calls == 1
    stats = layer.pop_step_stats()
    # by hand: each half through the local dispatcher (its own capacity) and the experts
    x_TD = x.detach().view(-1, cfg.d_model).requires_grad_(True)
    routing = layer.router(x_TD)
    ys, dropped = [], 0
    for xc, ic, wc in zip(x_TD.tensor_split(2), routing.expert_ids.tensor_split(2),
                          routing.weights.tensor_split(2), strict=True):
        rows, offsets, handle = stand_in.local.dispatch(xc, ic, wc)
        ys.append(stand_in.local.combine(layer.experts(rows, offsets), wc, handle))
        dropped = dropped + handle.dropped_per_expert
    want = torch.cat(ys)
    (want_dx,) = torch.autograd.grad((want * want).sum(), x_TD)
    assert torch.equal(y.view(-1, cfg.d_model), want) and torch.equal(dx.view(-1, cfg.d_model), want_dx)
    assert torch.equal(stats["dropped_per_expert"], dropped) and int(dropped.sum()) > 0


class _RecordingSink:
    def __init__(self) -> None:
        self.got = []

    def accepts(self, param) -> bool:
        return True

    def add_gradient(self, param, add) -> None:
        self.got.append((param, add))


def test_a_pipelining_dispatcher_delivers_each_expert_weight_gradient_once():
    """The experts called once per chunk: the sink they capture holds each weight's gradients
    until every call's has come, then hands the layer's sink one (merged where it can). The
    experts hold it only during each call: between calls (where an interleaved forward of
    the same layer may run) they hold their own sink."""
    from moe_model.experts import ExpertWeightGradient
    from moe_model.sink import MergingSink

    cfg, layer, x = layer_and_input()
    sink = _RecordingSink()
    layer.experts.grad_sink = sink
    seen, between = [], []

    class Spy(_TwoHalves):
        def run_experts(self, x, expert_ids, weights, experts):
            def spied(rows, offsets):
                between.append(layer.experts.grad_sink)
                return experts(rows, offsets)
            return super().run_experts(x, expert_ids, weights, spied)

    wire_model(layer, ModelWiring(gradient_sink=sink, dispatchers={"": Spy(LocalDispatcher(cfg.n_experts))}))
    layer.experts.register_forward_pre_hook(lambda module, args: seen.append(module.grad_sink))
    layer(x)
    merging = seen[0]
    assert seen == [merging, merging] and between == [sink, sink]
    assert isinstance(merging, MergingSink) and merging.sink is sink and merging.uses == 2
    assert layer.experts.grad_sink is sink  # restored after the forward
    w = layer.experts.w1
    rows = torch.zeros(4, cfg.d_model)
    parts = [ExpertWeightGradient(((rows, torch.zeros(4, cfg.expert_hidden), torch.tensor([4])),), w)
             for _ in range(2)]
    merging.add_gradient(w, parts[0])
    assert sink.got == []  # held: one use's gradient of two
    merging.add_gradient(w, parts[1])
    ((param, add),) = sink.got
    assert param is w and isinstance(add, ExpertWeightGradient) and len(add.sources) == 2
    # gradients that do not merge are added one after another, in one delivery
    merging = MergingSink(sink)
    merging.uses = 2
    added = []
    merging.add_gradient(w, lambda target: added.append(1))
    merging.add_gradient(w, lambda target: added.append(2))
    sink.got[-1][1](torch.zeros(1))
    assert len(sink.got) == 2 and added == [1, 2]
