"""GPU checks: no host synchronisation in a warmed-up MoE step; kernels at real widths."""

import pytest
import torch
from moe_model import MoEConfig, MoELayer, MoETransformer, grouped_mm, init_weights, lm_loss_sum
from moe_model.experts import grouped_mm_reference
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
    ref = grouped_mm_reference(x.float(), w.float(), offsets)
    rdx, rdw = torch.autograd.grad(ref[:valid], (x, store), dy[:valid].float())
    torch.testing.assert_close(out[:valid].float(), ref[:valid], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dx[:valid].float(), rdx[:valid].float(), rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(dw.float(), rdw.float(), rtol=2e-2, atol=5e-2)
    assert dw.float()[(sizes == 0).cuda()].abs().max() == 0


def test_paired_gate_up_matches_reference_at_real_widths():
    """The gate/up pair in one launch (TMA descriptors over both weights) and its input
    gradient as one GEMM over the joint reduction, against the FP32 per-expert loop."""
    from moe_model.experts import gate_up

    g = torch.Generator(device="cuda").manual_seed(0)
    E, D, F = 16, 1024, 512
    sizes = torch.tensor([0, 517, 1, 0, 2048, 33, 700, 0, 129, 1000, 5, 0, 256, 300, 64, 3])
    offsets = sizes.cumsum(0).to(torch.int32).cuda()
    valid = int(sizes.sum())
    R = valid + 37  # padding rows past offsets[-1]
    x = (torch.randn(R, D, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    w1, w3 = ((torch.randn(E, F, D, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
              for _ in range(2))
    dg, du = (torch.randn(R, F, device="cuda", generator=g).bfloat16() for _ in range(2))
    gg, uu = gate_up(x, w1, w3, offsets, None)
    dx, dw1, dw3 = torch.autograd.grad((gg[:valid], uu[:valid]), (x, w1, w3), (dg[:valid], du[:valid]))
    rg = grouped_mm_reference(x.float(), w1.float().transpose(1, 2), offsets)
    ru = grouped_mm_reference(x.float(), w3.float().transpose(1, 2), offsets)
    rdx, rdw1, rdw3 = torch.autograd.grad((rg[:valid], ru[:valid]), (x, w1, w3),
                                          (dg[:valid].float(), du[:valid].float()))
    for got, want, tol in ((gg[:valid], rg[:valid], 2e-2), (uu[:valid], ru[:valid], 2e-2),
                           (dx[:valid], rdx[:valid], 5e-2), (dw1, rdw1, 5e-2), (dw3, rdw3, 5e-2)):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=tol)


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


class _Targets:
    """A gradient sink over FP32 buffers: flat, or [2, piece] rows of a wider owner-major
    bucket; with ``merge`` > 1, each parameter's gradients are held and merged until
    ``merge`` of them go in one launch (as moe_ddp does when asked)."""

    def __init__(self, params, owner_major: bool, merge: int = 1):
        self.targets, self.added, self.merge, self.held = {}, {}, merge, {}
        for p in params:
            if owner_major:
                self.targets[p] = torch.zeros(2, p.numel() // 2 + 64, device=p.device)[:, : p.numel() // 2]
            else:
                self.targets[p] = torch.zeros(p.numel(), device=p.device)

    def accepts(self, param):
        return param in self.targets

    def add_gradient(self, param, add):
        if self.merge > 1:
            held = self.held.pop(param, None)
            add = add if held is None else held.merged(add)
            if len(add.sources) < self.merge:
                self.held[param] = add
                return
        add(self.targets[param])
        self.added[param] = self.added.get(param, 0) + 1


@pytest.mark.parametrize(("owner_major", "merge"), [(False, 1), (True, 1), (True, 2), (False, 4), (True, 4)])
def test_expert_weight_gradients_into_a_sink_at_model_width(owner_major, merge):
    """The grouped experts' weight gradients added to FP32 targets in the wgrad kernel's
    epilogue equal the FP32 sum of what autograd computes (BF16 operands, FP32 products),
    over four microbatches (``merge`` of them per launch), with an empty expert and
    experts empty in some microbatches only, and without a host synchronisation; the
    atomic adds give each element one add per launch, so a rerun is bitwise equal."""
    from moe_model import GroupedExperts

    E, D, F, R = 8, 2048, 1024, 6144
    g = torch.Generator(device="cuda").manual_seed(0)
    offsets = [torch.tensor(o, dtype=torch.int32, device="cuda") for o in (
        [700, 700, 1500, 2600, 3300, 4100, 5000, 6000], [0, 0, 1200, 2600, 2600, 4100, 6144, 6144],
        [2000, 2000, 2000, 2000, 3000, 4000, 5000, 6100], [700, 700, 700, 700, 700, 700, 700, 700])]
    mod = GroupedExperts(E, D, F, backend="grouped_mm").cuda()
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.02, generator=g)
    mod.to(torch.bfloat16)
    rows = [torch.randn(R, D, device="cuda", generator=g).bfloat16() for _ in offsets]
    douts = [torch.randn(R, D, device="cuda", generator=g).bfloat16() for _ in offsets]
    reference = {n: torch.zeros(p.shape, device="cuda") for n, p in mod.named_parameters()}
    for x, o, dout in zip(rows, offsets, douts, strict=True):
        mod(x, o).backward(dout)
        for n, p in mod.named_parameters():
            reference[n] += p.grad.float()  # rounded to BF16 once: the tolerance covers it
            p.grad = None
    sink = _Targets(list(mod.parameters()), owner_major, merge)
    mod.grad_sink = sink

    def four_microbatches():
        for t in sink.targets.values():
            t.zero_()
        for x, o, dout in zip(rows, offsets, douts, strict=True):
            mod(x, o).backward(dout)

    assert_no_host_sync(four_microbatches, warmup=1)
    for n, p in mod.named_parameters():
        # warm-up + checked run: four launches each, or 4 / merge
        assert p.grad is None and sink.added[p] == 2 * 4 // merge and not sink.held
        got = sink.targets[p].reshape(p.shape)
        scale = reference[n].abs().max().item()
        torch.testing.assert_close(got, reference[n], rtol=1e-2, atol=1e-2 * scale, msg=n)
        assert got[1].abs().max() == 0  # expert 1 holds no rows
    first = {p: t.clone() for p, t in sink.targets.items()}
    four_microbatches()
    for n, p in mod.named_parameters():
        assert torch.equal(sink.targets[p], first[p]), f"{n}: a rerun gave other bits"


def test_merged_weight_gradient_with_operands_far_apart():
    """Four batches of rows in one weight-gradient launch whose operands lie more than
    2^31 elements apart from each other (views into one 6 GiB buffer, on both sides of the
    first batch's): each offset fits in int32, their differences do not, so the kernel's
    pointer jumps between batches must be int64. Empty experts, a batch with one expert
    only and padding rows past a batch's last group included."""
    from moe_model._grouped_mm_launch import wgrad_accumulate_

    E, D, F, R = 4, 256, 128, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    span = 3 * 2**30  # elements between the lowest and the highest batch
    buf = torch.empty(span + R * D, dtype=torch.bfloat16, device="cuda")
    xs = [buf[s:s + R * D].view(R, D) for s in (span // 2, 0, span, span // 4)]
    for x in xs:
        x.copy_(torch.randn(R, D, device="cuda", generator=g))
    dys = [torch.randn(R, F, device="cuda", generator=g).bfloat16() for _ in xs]
    offsets = [torch.tensor(o, dtype=torch.int32, device="cuda")
               for o in ([100, 100, 300, 512], [0, 200, 200, 400], [512] * 4, [50, 60, 70, 80])]
    like = torch.empty(E, F, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # [E, D, F]
    target = torch.zeros(E * F * D, device="cuda")
    wgrad_accumulate_(target, xs[0], dys[0], offsets[0], like,
                      more=list(zip(xs[1:], dys[1:], offsets[1:], strict=True)))
    expect = torch.zeros(E, D, F, device="cuda")
    for x, dy, ends in zip(xs, dys, offsets, strict=True):
        start = 0
        for e, end in enumerate(ends.tolist()):
            expect[e] += x[start:end].float().T @ dy[start:end].float()
            start = end
    got = target.view(E, F, D).transpose(1, 2)
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4 * expect.abs().max().item())


@pytest.mark.parametrize("recompute", ["none", "block", "selective"])
def test_sink_under_activation_recompute_matches_autograd(recompute):
    """With recomputed blocks the experts' weight gradients still land once, with the
    values autograd gives (FP32 parameters under BF16 autocast, as the FSDP2-free path)."""
    from moe_model import ModelWiring, wire_model

    tokens = torch.randint(0, LAYER["vocab_size"], (2, 129), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    cfg = MoEConfig(**LAYER, recompute=recompute)
    results = []
    for use_sink in (False, True):
        model = MoETransformer(cfg).cuda()
        init_weights(model, cfg, seed=0)
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        sink = _Targets(experts, owner_major=False)
        wire_model(model, ModelWiring(gradient_sink=sink if use_sink else None))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        (lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
        if use_sink:
            assert all(p.grad is None and sink.added[p] == 1 for p in experts)
            results.append([sink.targets[p].view(p.shape) for p in experts])
        else:
            results.append([p.grad.float() for p in experts])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-5)


def _autograd_node_names(out: torch.Tensor) -> set[str]:
    names, todo, seen = set(), [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo.extend(fn for fn, _ in node.next_functions)
    return names


@pytest.mark.gpu
def test_attention_backends_run_the_kernel_asked_for_at_bf16_error():
    """cuDNN and flash SDPA: the kernel named runs, and the BF16 module's output and gradients
    are as close to an FP32 math-kernel reference with one as with the other."""
    import copy

    from moe_model.layers import Attention

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention needs sm90+ at head dim 128")
    kernel = {"cudnn": "ScaledDotProductCudnnAttentionBackward0",
              "flash": "ScaledDotProductFlashAttentionBackward0"}
    cfg = MoEConfig(d_model=1024, n_heads=8, n_kv_heads=2, head_dim=128)
    torch.manual_seed(0)
    ref = Attention(cfg).cuda()
    for p in ref.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(2, 1024, 1024, device="cuda")
    g = torch.randn_like(x)

    def run(module, x):
        x = x.clone().requires_grad_()
        y = module(x)
        y.backward(g.to(y.dtype))
        return y, [y.float(), x.grad.float(), *(p.grad.float() for p in module.parameters())]

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        _, gold = run(ref, x)
    errors = {}
    for backend in ("cudnn", "flash", "auto"):
        module = copy.deepcopy(ref).to(torch.bfloat16)
        module.backend = backend
        y, got = run(module, x.bfloat16())
        if backend in kernel:
            assert kernel[backend] in _autograd_node_names(y)
        errors[backend] = max(float((a - b).norm() / b.norm()) for a, b in zip(got, gold, strict=True))
    for backend in ("cudnn", "auto"):  # auto: PyTorch's choice, cuDNN on H200 with torch 2.11
        assert errors[backend] < 2e-2 and errors[backend] <= 1.25 * errors["flash"], errors


def test_router_logits_on_tensor_cores_match_fp32():
    """The router's BF16 GPU path (FP32-output GEMM, the gradient split into three BF16
    parts) against FP32 copies and an FP32 GEMM at model width, without a host sync."""
    from moe_model.router import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 2048, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(64, 2048, device="cuda", generator=g)).bfloat16().requires_grad_()
    dlogits = 1e-4 * torch.randn(8192, 64, device="cuda", generator=g)

    def step():
        x.grad = w.grad = None
        logits = router_logits(x, w)
        logits.backward(dlogits)
        return logits

    assert_no_host_sync(step, warmup=1)
    logits = step()
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = x32 @ w32.t()  # FP32 GEMM (TF32 is off by default)
    want.backward(dlogits)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for got, ref in ((x.grad, x32.grad), (w.grad, w32.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=1e-6 * ref.abs().max().item())
        assert (got != ref.bfloat16()).float().mean() < 0.02


@pytest.mark.parametrize("owners", [1, 2])
def test_dense_weight_gradient_added_into_fp32_by_cublas(owners):
    """``dense_grad_accumulate_`` on CUDA: ``target += dy^T @ x`` through cuBLAS's FP32-output
    GEMM writing into the target itself (beta 1: the add must not overwrite), into a flat
    target and an owner-major bucket, BF16 operands at the attention projection's widths,
    against FP64, without a host synchronisation."""
    from moe_model.linear import dense_grad_accumulate_

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    dy = torch.randn(4096, 1536, device="cuda", generator=g).bfloat16()
    start = torch.randn(1536 * 2048, device="cuda", generator=g) * 100
    want = start.double() + (dy.double().t() @ x.double()).reshape(-1)
    piece = start.numel() // owners
    bucket = torch.zeros(owners, piece + 64, device="cuda")
    target = bucket[:, :piece] if owners > 1 else bucket.view(-1)[: start.numel()]

    def add_once():
        target.copy_(start.view(target.shape))
        dense_grad_accumulate_(target, x, dy)

    assert_no_host_sync(add_once, warmup=1)
    got = target.reshape(-1).double()
    # FP32 accumulation over 4096 products: relative error ~1e-6 of the largest sums
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if owners > 1:
        assert (bucket[:, piece:] == 0).all(), "wrote past a piece"


def test_dense_weight_gradients_into_a_sink_train_like_autograd():
    """A BF16 model's dense linear weights (attention, the head) with a sink: each weight's
    gradient lands once, in FP32 (one rounding), equal to autograd's BF16 gradient within
    BF16's rounding; the step has no host synchronisation."""
    from moe_model import ModelWiring, wire_model
    from moe_model.linear import Linear

    tokens = torch.randint(0, LAYER["vocab_size"], (2, 129), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    cfg = MoEConfig(**LAYER)
    grads = []
    for use_sink in (False, True):
        model = MoETransformer(cfg).cuda()
        init_weights(model, cfg, seed=0)
        model.to(torch.bfloat16)
        dense = [m.weight for m in model.modules() if isinstance(m, Linear)]
        sink = _Targets(dense, owner_major=use_sink)
        wire_model(model, ModelWiring(gradient_sink=sink if use_sink else None))

        def step(model=model, sink=sink):
            for t in sink.targets.values():
                t.zero_()
            for p in model.parameters():
                p.grad = None
            (lm_loss_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()).backward()

        assert_no_host_sync(step, warmup=1)
        if use_sink:
            assert all(p.grad is None and sink.added[p] == 2 for p in dense)  # warm-up + checked
            grads.append([sink.targets[p].reshape(p.shape) for p in dense])
        else:
            grads.append([p.grad.float() for p in dense])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
def test_norm_kernels_split_backward_launches_equal_the_full_backward():
    """The compiled dx-only and dw-only launches a zero-bubble split runs (``need_dx`` /
    ``need_dw``) at the bench shapes: bit for bit the full backward's gradients."""
    from moe_model import _qk_norm_rope_kernels as qk
    from moe_model import _rms_norm_kernels as rk
    from moe_model.layers import rope_tables

    dev, bf = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(2, 4096, 2048, device=dev, dtype=bf)
    w = torch.randn(2048, device=dev, dtype=bf)
    _, rstd, _ = rk.rms_norm_fwd(x, w, 1e-6)
    dy = torch.randn_like(x)
    for grad_in in (None, torch.randn_like(x)):
        dx, dw = rk.rms_norm_bwd(dy, x, w, rstd, grad_in=grad_in)
        dx_only, none_w = rk.rms_norm_bwd(dy, x, w, rstd, grad_in=grad_in, need_dw=False)
        none_x, dw_only = rk.rms_norm_bwd(dy, x, w, rstd, grad_in=grad_in, need_dx=False)
        assert none_w is None and none_x is None
        assert torch.equal(dx_only, dx) and torch.equal(dw_only, dw)
    cos, sin = rope_tables(4096, 128, 10000.0, dev)
    for heads in (16, 4):
        q = torch.randn(2, 4096, heads, 128, device=dev, dtype=bf)
        wq = torch.randn(128, device=dev, dtype=bf)
        _, rs = qk.qk_norm_rope_fwd(q, wq, 1e-6, cos, sin)
        g = torch.randn(2, heads, 4096, 128, device=dev, dtype=bf).transpose(1, 2)  # as SDPA gives it
        dx, dw = qk.qk_norm_rope_bwd(g, q, wq, rs, cos, sin)
        dx_only, none_w = qk.qk_norm_rope_bwd(g, q, wq, rs, cos, sin, need_dw=False)
        none_x, dw_only = qk.qk_norm_rope_bwd(g, q, wq, rs, cos, sin, need_dx=False)
        assert none_w is None and none_x is None
        assert torch.equal(dx_only, dx) and torch.equal(dw_only, dw)
