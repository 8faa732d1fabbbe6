"""FP8GroupedExperts (emulated GEMMs) against per-expert FP32 oracles built on torchao's
quantization functions; recipes in MXFP8Config; the gradient sink route."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from moe_mxfp8 import (
    FP8_RECIPES,
    FP8GroupedExperts,
    MXFP8Config,
    apply_mxfp8,
    refresh_weight_caches,
    unmatched_targets,
)
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from sink_helpers import LaterGradient, RecordingSink  # noqa: E402

torchao_float8 = pytest.importorskip("torchao.float8.float8_utils")
from torchao.float8.config import ScalingGranularity  # noqa: E402
from torchao.prototype.blockwise_fp8_training.kernels import (  # noqa: E402
    torch_blockwise_scale_act_quant_lhs,
    torch_blockwise_scale_act_quant_rhs,
    torch_blockwise_scale_weight_quant,
)

TIGHT = dict(rtol=2e-5, atol=2e-6)  # FP32 accumulation-order differences only


class ToyExperts(nn.Module):
    """Stands in for moe_model.GroupedExperts: same parameter names, shapes and attributes."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, seed: int = 0) -> None:
        super().__init__()
        self.expert_start, self.n_local = 0, n_experts
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, d_model, generator=g) * 0.2)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, d_model, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_model, hidden, generator=g) * 0.2)


def rowwise(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torchao float8 rowwise round trip (power-of-two scales along ``dim``), in FP32."""
    scale = torchao_float8.tensor_to_scale(
        x, torch.float8_e4m3fn, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
        round_scales_to_power_of_2=True)
    return torchao_float8.to_fp8_saturated(x.float() * scale, torch.float8_e4m3fn).float() / scale


def act_1x128(x: torch.Tensor) -> torch.Tensor:
    data, inv = torch_blockwise_scale_act_quant_lhs(x.contiguous())
    return data.float() * inv.repeat_interleave(128, dim=1)


def tokens_128x1(x: torch.Tensor) -> torch.Tensor:
    """torchao's blockwise weight-gradient operand round trip (per column and 128 rows, the
    rows zero-padded to whole blocks), in FP32."""
    padded = F.pad(x.float(), (0, 0, 0, -x.shape[0] % 128))
    data, inv = torch_blockwise_scale_act_quant_rhs(padded.contiguous())
    return (data.float() * inv.repeat_interleave(128, dim=0))[:x.shape[0]]


def weight_128x128(w: torch.Tensor) -> torch.Tensor:
    out = []
    for w_e in w:
        data, inv = torch_blockwise_scale_weight_quant(w_e.contiguous())
        out.append(data.float() * inv.repeat_interleave(128, 0).repeat_interleave(128, 1))
    return torch.stack(out)


def oracle(recipe, rows, offsets, w1, w3, w2, dy):
    """Per-expert loop, FP32 products of operands quantized by torchao's functions."""
    w13 = torch.cat([w1, w3], dim=1).detach().bfloat16()  # caches quantize the BF16 weight
    w2b = w2.detach().bfloat16()
    if recipe.startswith("fp8_rowwise"):
        act = rowwise
        w13_f, w13_b, w2_f, w2_b = rowwise(w13, -1), rowwise(w13, -2), rowwise(w2b, -1), rowwise(w2b, -2)
    else:
        act = act_1x128
        w13_f, w2_f = weight_128x128(w13), weight_128x128(w2b)
        w13_b, w2_b = w13_f, w2_f  # 128x128 blocks: the transpose's blocks are the same
    F_ = w1.shape[1]
    y = torch.zeros(rows.shape[0], w2.shape[1])
    drows = torch.zeros_like(rows)
    dw13, dw2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        seg = slice(start, end)
        start = end
        if seg.stop == seg.start:
            continue
        h13 = (act(rows[seg]) @ w13_f[e].T).requires_grad_()
        h = F.silu(h13[:, :F_]) * h13[:, F_:]
        y[seg] = act(h.detach()) @ w2_f[e].T
        dh = act(dy[seg]) @ w2_b[e]
        (dh13,) = torch.autograd.grad(h, h13, dh)
        drows[seg] = act(dh13) @ w13_b[e]
        if recipe == "fp8_rowwise":  # per expert and column, along the tokens
            dw13[e] = rowwise(dh13, 0).T @ rowwise(rows[seg], 0)
            dw2[e] = rowwise(dy[seg], 0).T @ rowwise(h.detach(), 0)
        elif recipe == "fp8_blockwise_gw_fp8":  # per expert, column and 128 tokens
            dw13[e] = tokens_128x1(dh13).T @ tokens_128x1(rows[seg])
            dw2[e] = tokens_128x1(dy[seg]).T @ tokens_128x1(h.detach())
        else:  # weight gradients in the compute dtype
            dw13[e] = dh13.T @ rows[seg]
            dw2[e] = dy[seg].T @ h.detach()
    return y, drows, dw13[:, :F_], dw13[:, F_:], dw2


CASES = {"fp8_rowwise": (40, 24), "fp8_rowwise_gw_hp": (40, 24),
         "fp8_blockwise": (128, 128), "fp8_blockwise_gw_fp8": (128, 128)}  # (d_model, hidden)


@pytest.mark.parametrize("recipe", list(CASES))
def test_experts_match_torchao_oracle(recipe):
    D, F_ = CASES[recipe]
    experts = ToyExperts(4, D, F_)
    layer = FP8GroupedExperts.from_module(experts, recipe)
    offsets = torch.tensor([5, 5, 18, 27], dtype=torch.int32)  # odd sizes, one empty expert
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(30, D, generator=g)
    rows[27:] = float("nan")  # padding rows must not leak into real rows or weight grads
    dy = torch.randn(30, D, generator=g)
    rows.requires_grad_()
    y = layer(rows, offsets)
    y.backward(dy)
    ref = oracle(recipe, rows.detach(), offsets, experts.w1, experts.w3, experts.w2, dy)
    torch.testing.assert_close(y[:27], ref[0][:27], **TIGHT)
    # blockwise: the input gradient reduces over 2F = 256 in two promoted 128-blocks, the
    # oracle in one FP32 matmul, of terms up to |drows| ~ 70: on some CPUs' BLAS (AVX-512)
    # that reordering moves small entries by 1e-5 to 3e-5. Scaled by the largest entry,
    # the tolerance stays a hundredth of one E4M3 step of a wrong quantization.
    scale = float(ref[1][:27].abs().max())
    dtol = dict(rtol=2e-5, atol=2e-6 * scale) if FP8_RECIPES[recipe].blockwise else TIGHT
    torch.testing.assert_close(rows.grad[:27], ref[1][:27], **dtol)
    # unquantized weight gradients (gw_hp, blockwise) see the layer's SwiGLU derivative, an ulp
    # away from autograd's, without a quantization step to absorb it
    wtol = TIGHT if FP8_RECIPES[recipe].fp8_wgrad else dict(rtol=2e-5, atol=1e-5)
    for got, want in zip((experts.w1.grad, experts.w3.grad, experts.w2.grad), ref[2:], strict=True):
        torch.testing.assert_close(got, want, **wtol)
    assert experts.w1.grad[1].abs().sum() == 0  # the empty expert


def test_blockwise_fp8_weight_gradients_scale_every_128_tokens_of_an_expert():
    """Experts of 1, 130 and 269 rows, an outlier row (1e5 times the others, with a zero
    output gradient) in the last expert's last 128-token block: the weight gradients equal
    torchao's blockwise operands' FP32 products (blocks counted from each expert's first
    row); the outlier coarsens only its own block's other rows, where one scale per expert
    and column coarsens all of the expert's."""
    D, F_ = CASES["fp8_blockwise_gw_fp8"]
    experts = ToyExperts(4, D, F_, seed=3)
    layer = FP8GroupedExperts.from_module(experts, "fp8_blockwise_gw_fp8")
    offsets = torch.tensor([1, 1, 131, 400], dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(400, D, generator=g)
    rows[395] *= 1e5  # in the last expert's third block (rows 387-399)
    dy = torch.randn(400, D, generator=g)
    dy[395] = 0.0
    rows.requires_grad_()
    layer(rows, offsets).backward(dy)
    ref = oracle("fp8_blockwise_gw_fp8", rows.detach(), offsets, experts.w1, experts.w3,
                 experts.w2, dy)
    grads = (experts.w1.grad, experts.w3.grad, experts.w2.grad)
    # sums of up to 269 products: FP32 accumulation-order differences, bounded relative to
    # each expert's largest entry
    for got, want in zip(grads, ref[2:], strict=True):
        for e in range(4):
            torch.testing.assert_close(got[e], want[e], rtol=2e-5, atol=2e-6 * float(want[e].abs().max()))
    from moe_mxfp8.fp8_gemm import fp8_grouped_wgrad

    x = rows.detach()
    per_expert = fp8_grouped_wgrad(dy, x, offsets, False, torch.float32, "emulated", False)
    per_block = fp8_grouped_wgrad(dy, x, offsets, False, torch.float32, "emulated", False,
                                  blockwise=True)
    exact = dy[131:].T @ x[131:]
    # relative errors 0.045 and 0.13: the outlier scales the other rows into E4M3's subnormals
    assert (per_block[3] - exact).norm() < 0.5 * (per_expert[3] - exact).norm()


def test_output_gradient_rows_attach_and_serve_the_down_projection():
    """Rowwise experts tag their output with an ``RowCodes`` (not a blockwise
    recipe's, nor without grad mode); the backward uses what it received for its very
    ``dy``: deliberately wrong codes (zeros) zero the input gradient and every gradient
    behind ``dh``, not ``w2``'s (from the unquantized ``dy``); the right ones change
    nothing."""
    from moe_mxfp8.fp8 import quantize_fp8_reference
    from moe_mxfp8.row_codes import GRADIENT_ROW_ENCODER, RowCodes

    D, F_ = CASES["fp8_rowwise_gw_hp"]
    experts = ToyExperts(4, D, F_)
    layer = FP8GroupedExperts.from_module(experts, "fp8_rowwise_gw_hp")
    offsets = torch.tensor([5, 5, 18, 30], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(30, D, generator=g, requires_grad=True)
    dy = torch.randn(30, D, generator=g)
    params = (rows, experts.w1, experts.w3, experts.w2)
    enc = getattr(layer(rows, offsets), GRADIENT_ROW_ENCODER)
    assert isinstance(enc, RowCodes) and enc.pow2
    with torch.no_grad():
        assert not hasattr(layer(rows, offsets), GRADIENT_ROW_ENCODER)
    blockwise = FP8GroupedExperts.from_module(ToyExperts(2, 128, 128), "fp8_blockwise")
    assert not hasattr(blockwise(torch.randn(4, 128), torch.tensor([2, 4], dtype=torch.int32)),
                       GRADIENT_ROW_ENCODER)

    ref = torch.autograd.grad(layer(rows, offsets), params, dy)
    q = quantize_fp8_reference(dy, (1, 0), True)
    y = layer(rows, offsets)
    getattr(y, GRADIENT_ROW_ENCODER).receive(dy, torch.zeros(30, D, dtype=torch.uint8), q.scale)
    wrong = torch.autograd.grad(y, params, dy)
    assert all((t == 0).all() for t in wrong[:3]) and torch.equal(wrong[3], ref[3])
    assert all(t.abs().sum() > 0 for t in ref)
    y = layer(rows, offsets)
    getattr(y, GRADIENT_ROW_ENCODER).receive(dy, q.data.view(torch.uint8), q.scale)
    for got, want in zip(torch.autograd.grad(y, params, dy), ref, strict=True):
        assert torch.equal(got, want)


def unquantized(rows, offsets, w1, w3, w2):
    y = torch.zeros(rows.shape[0], w2.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        x = rows[start:end]
        y[start:end] = (F.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T
        start = end
    return y


@pytest.mark.parametrize("recipe", list(CASES))
def test_quantization_error_is_bounded_against_fp32(recipe):
    D, F_ = CASES[recipe]
    experts = ToyExperts(3, D, F_, seed=4)
    rows = torch.randn(48, D, generator=torch.Generator().manual_seed(5), requires_grad=True)
    offsets = torch.tensor([10, 30, 48], dtype=torch.int32)
    y = FP8GroupedExperts.from_module(experts, recipe)(rows, offsets)
    (dx,) = torch.autograd.grad(y.square().sum(), rows)
    w = [p.detach() for p in (experts.w1, experts.w3, experts.w2)]
    rows_ref = rows.detach().requires_grad_()
    y_ref = unquantized(rows_ref, offsets, *w)
    (dx_ref,) = torch.autograd.grad(y_ref.square().sum(), rows_ref)
    for got, want in ((y, y_ref), (dx, dx_ref)):
        rel = (got - want).norm() / want.norm()
        # quantized (not the FP32 result), and within a few compounded E4M3 roundings
        # (each up to 2**-4 relative; measured ~0.065 here)
        assert 0.01 < rel < 0.1, rel


def test_weight_gradients_go_into_the_sink():
    experts = ToyExperts(3, 32, 16)
    rows = torch.randn(20, 32, requires_grad=True)
    offsets = torch.tensor([4, 12, 20], dtype=torch.int32)
    dy = torch.randn(20, 32)
    plain = FP8GroupedExperts.from_module(experts)
    plain(rows, offsets).backward(dy)
    want = {n: getattr(experts, n).grad.clone() for n in ("w1", "w3", "w2")}
    dx = rows.grad.clone()
    for p in (rows, *experts.parameters()):
        p.grad = None
    experts.grad_sink = RecordingSink([experts.w1, experts.w2])
    layer = FP8GroupedExperts.from_module(experts)
    assert layer.grad_sink is experts.grad_sink
    for _ in range(2):  # two microbatches accumulate
        layer(rows, offsets).backward(dy)
    sink = experts.grad_sink
    assert sink.calls == 4 and experts.w1.grad is None and experts.w2.grad is None
    torch.testing.assert_close(sink.targets[id(experts.w1)], 2 * want["w1"].reshape(-1))
    torch.testing.assert_close(sink.targets[id(experts.w2)], 2 * want["w2"].reshape(-1))
    torch.testing.assert_close(experts.w3.grad, 2 * want["w3"])  # not accepted: autograd's
    torch.testing.assert_close(rows.grad, 2 * dx)
    # a backward that does not run the weights' nodes (a pipeline's input pass) adds nothing
    torch.autograd.grad(layer(rows, offsets), rows, dy)
    assert sink.calls == 4


@pytest.mark.parametrize("recipe", list(CASES))
def test_compute_dtype_weight_gradients_go_to_the_sink_as_the_makers_adds(recipe):
    """With ``weight_gradient`` set, the recipes that compute the weight gradients in the
    compute dtype hand the sink the maker's adds of the right operands (rows and the gate
    or up half of dh13, h and dy), which add what the layer computes itself; the FP8
    weight-gradient recipe and weights the sink does not take keep the computed path."""
    D, Fh = CASES[recipe]
    experts = ToyExperts(3, D, Fh)
    rows = torch.randn(20, D, requires_grad=True)
    offsets = torch.tensor([4, 12, 20], dtype=torch.int32)
    dy = torch.randn(20, D)
    FP8GroupedExperts.from_module(experts, recipe)(rows, offsets).backward(dy)
    want = {n: getattr(experts, n).grad.clone() for n in ("w1", "w3", "w2")}
    for p in (rows, *experts.parameters()):
        p.grad = None
    experts.grad_sink = RecordingSink([experts.w1, experts.w2])
    layer = FP8GroupedExperts.from_module(experts, recipe)
    layer.weight_gradient = LaterGradient
    LaterGradient.made = []
    for _ in range(2):
        layer(rows, offsets).backward(dy)
    sink = experts.grad_sink
    later = not FP8_RECIPES[recipe].fp8_wgrad
    assert len(LaterGradient.made) == (4 if later else 0) and sink.calls == 4
    torch.testing.assert_close(sink.targets[id(experts.w1)], 2 * want["w1"].reshape(-1), **TIGHT)
    torch.testing.assert_close(sink.targets[id(experts.w2)], 2 * want["w2"].reshape(-1), **TIGHT)
    torch.testing.assert_close(experts.w3.grad, 2 * want["w3"])  # not the sink's: autograd's
    if later:
        gate, down = LaterGradient.made[:2]
        assert gate.x is not None and torch.equal(gate.x, rows.detach())
        assert gate.dy.shape == (20, Fh) and down.x.shape == (20, Fh)
        assert torch.equal(down.dy, dy) and down.like.shape == (3, Fh, D)


@pytest.mark.parametrize("recipe", [r for r in CASES if r in FP8_RECIPES and FP8_RECIPES[r].fp8_wgrad])
def test_fp8_weight_gradients_reach_the_sink_unrounded_from_operands_quantized_once(recipe, monkeypatch):
    """FP8 weight gradients go to the sink as adds that run the GEMM into the FP32 target:
    with BF16 compute, each target holds what the layer returns without a sink, blockwise
    as the FP32 sum that rounds to it (no BF16 gradient was added), rowwise rounded as
    torch's GEMM returns it; a target that cannot be
    viewed ``[E, N, K]`` (rows of a bucket) gets the same sum; and each backward quantizes
    two operand pairs, gate and up sharing theirs."""
    import moe_mxfp8.fp8_experts as fp8_experts

    D, Fh = CASES[recipe]
    experts = ToyExperts(3, D, Fh)
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(300, D, generator=g).bfloat16()
    offsets = torch.tensor([40, 170, 300], dtype=torch.int32)
    dy = torch.randn(300, D, generator=g).bfloat16()
    FP8GroupedExperts.from_module(experts, recipe)(rows, offsets).backward(dy)
    want = {n: getattr(experts, n).grad.clone() for n in ("w1", "w3", "w2")}
    for p in experts.parameters():
        p.grad = None
    sink = RecordingSink([experts.w1, experts.w3, experts.w2])
    piece = 3 * D // 2  # rows of 1.5 weight rows: no [E, N, K] view
    bucket = torch.zeros(experts.w2.numel() // piece, piece + 8)
    sink.targets[id(experts.w2)] = bucket[:, :piece]
    experts.grad_sink = sink
    quantized = []
    real = fp8_experts.quantize_wgrad_operands
    monkeypatch.setattr(fp8_experts, "quantize_wgrad_operands",
                        lambda *a: quantized.append(a[0].shape) or real(*a))
    FP8GroupedExperts.from_module(experts, recipe)(rows, offsets).backward(dy)
    assert quantized == [(300, 2 * Fh), (300, D)] and sink.calls == 3
    assert all(p.grad is None for p in experts.parameters())
    for name in ("w1", "w3", "w2"):
        got = sink.targets[id(getattr(experts, name))].reshape(want[name].shape)
        assert torch.equal(got.bfloat16().float(), want[name])
        assert torch.equal(got, want[name]) != FP8_RECIPES[recipe].blockwise  # finer than BF16
    assert not bucket[:, piece:].any()


def test_recipe_config_converts_the_targeted_experts_and_caches_refresh():
    model = nn.ModuleDict({"experts": ToyExperts(3, 64, 32), "proj": nn.Linear(64, 64)})
    params = list(model.parameters())
    assert apply_mxfp8(model, MXFP8Config(targets=("experts",), recipe="fp8_rowwise")) == ["experts"]
    layer = model["experts"]
    assert isinstance(layer, FP8GroupedExperts) and layer.n_local == 3
    assert isinstance(model["proj"], nn.Linear)  # not targeted
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert unmatched_targets(model, ("experts",)) == []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows, offsets = torch.randn(40, 64), torch.tensor([10, 25, 40], dtype=torch.int32)
    model["proj"](layer(rows, offsets)).square().sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="refresh_weight_cache"):
        layer(rows, offsets)
    assert refresh_weight_caches(model) == 1
    fresh = FP8GroupedExperts(layer.w1, layer.w3, layer.w2)
    assert torch.equal(layer(rows, offsets), fresh(rows, offsets))


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise", "fp8_blockwise"])
def test_in_place_refresh_keeps_the_cache_tensors_and_equals_a_fresh_cache(recipe):
    """What a captured CUDA graph needs: same addresses, new values."""
    D = 128 if recipe == "fp8_blockwise" else 64
    model = nn.ModuleDict({"experts": ToyExperts(2, D, D)})
    apply_mxfp8(model, MXFP8Config(targets=("experts",), recipe=recipe))
    layer = model["experts"]
    caches = (layer.w13_cache, layer.w2_cache)

    def tensors():
        return [t for c in caches for copy in (c.rows, c.cols) for t in vars(copy).values()
                if isinstance(t, torch.Tensor)]

    before = [(t.data_ptr(), t.clone()) for t in tensors()]
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(-3.0)
    assert refresh_weight_caches(model, in_place=True) == 1
    fresh = type(layer).from_module(layer, **({} if recipe == "mxfp8" else {"recipe": recipe}))
    fresh_caches = (fresh.w13_cache, fresh.w2_cache)
    for (ptr, old), t, f in zip(before, tensors(), [t for c in fresh_caches for copy in
                                                    (c.rows, c.cols) for t in vars(copy).values()
                                                    if isinstance(t, torch.Tensor)], strict=True):
        assert t.data_ptr() == ptr
        assert torch.equal(t.view(torch.uint8), f.view(torch.uint8))
        assert not torch.equal(t.view(torch.uint8), old.view(torch.uint8))
    layer(torch.randn(6, D), torch.tensor([3, 6], dtype=torch.int32))  # fresh


@pytest.mark.parametrize("recipe", list(CASES))
def test_weight_cache_copies_equal_quantizing_the_weight_and_its_transpose(recipe):
    """The input-gradient copy is the transposed weight quantized along ``out``; for square
    blocks the cache transposes the first copy's codes and scales instead, which must be
    the same bits (partial blocks included), held in storages of their own."""
    from moe_mxfp8.cache import CACHE_SOURCE_DTYPE
    from moe_mxfp8.fp8 import quantize_fp8
    from moe_mxfp8.fp8_experts import FP8_RECIPES, FP8WeightCache

    r = FP8_RECIPES[recipe]
    # 136 columns: one 128-wide block and a cut one; 100 rows: one block along the rows, so
    # the blocks' scales [3, 1, 2] transposed are contiguous already
    w = nn.Parameter(torch.randn(3, 100, 136) * torch.exp2(torch.randint(-8, 8, (3, 100, 1)).float()))
    cache = FP8WeightCache((w,), r)
    source = w.detach().to(CACHE_SOURCE_DTYPE)  # what every cache derives from
    for got, want in ((cache.rows, quantize_fp8(source, r.weight_block, r.pow2)),
                      (cache.cols, quantize_fp8(source.transpose(1, 2).contiguous(),
                                                r.weight_block, r.pow2))):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale) and got.block == want.block
        assert got.data.is_contiguous() and got.scale.is_contiguous()
    storages = [t.untyped_storage().data_ptr() for c in (cache.rows, cache.cols) for t in (c.data, c.scale)]
    assert len(set(storages)) == 4  # two copies, none a view of the other


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_blockwise"])
def test_in_place_refresh_of_parameters_of_another_shape_replaces_the_copies(recipe):
    """In place only where the copies keep their layout: a parameter of another shape gets
    new copies of its own shape (a captured graph would need recapturing anyway)."""
    from moe_mxfp8.fp8_experts import FP8_RECIPES, FP8WeightCache

    r = FP8_RECIPES[recipe]
    cache = FP8WeightCache((nn.Parameter(torch.randn(2, 128, 128)),), r)
    before = cache.rows.data.data_ptr()
    w = nn.Parameter(torch.randn(2, 256, 128))
    cache.refresh((w,), in_place=True)
    fresh = FP8WeightCache((w,), r)
    assert cache.rows.data.shape == (2, 256, 128) and cache.cols.data.shape == (2, 128, 256)
    assert cache.rows.data.data_ptr() != before
    for got, want in ((cache.rows, fresh.rows), (cache.cols, fresh.cols)):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    cache.check_fresh("layer", (w,))


def test_bad_recipe_settings_are_refused_with_the_field():
    with pytest.raises(ValueError, match="recipe"):
        MXFP8Config(recipe="fp8")
    with pytest.raises(ValueError, match="save_mxfp8_activations"):
        MXFP8Config(recipe="fp8_rowwise", save_mxfp8_activations=True)
    with pytest.raises(ValueError, match="fp8_blockwise has no native"):
        MXFP8Config(recipe="fp8_blockwise", gemm="native")
    with pytest.raises(ValueError, match="divisible by 16"):
        FP8GroupedExperts.from_module(ToyExperts(2, 40, 24), gemm="native")
    layer = FP8GroupedExperts.from_module(ToyExperts(2, 32, 16), gemm="native")
    with pytest.raises(RuntimeError, match="compute capability 9"):
        layer(torch.randn(4, 32), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="group_offsets must be int32"):
        layer(torch.randn(4, 32), torch.tensor([2, 4]))


@pytest.mark.parametrize(("recipe", "torchao_recipe"), [("fp8_rowwise", "rowwise"),
                                                      ("fp8_rowwise_gw_hp", "rowwise_with_gw_hp")])
def test_default_fast_accumulation_is_torchaos_per_gemm_choice(recipe, torchao_recipe):
    """Each GEMM role accumulates as torchao's float8 recipe of the same name configures it."""
    from torchao.float8.config import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(torchao_recipe)
    torchao_fast = {role for role in ("output", "grad_input", "grad_weight")
                    if getattr(config, f"gemm_config_{role}").use_fast_accum}
    assert torchao_fast == {"output"}  # what the FAST_ACCUM_CALLS cases above spell out
    assert FP8GroupedExperts.from_module(ToyExperts(2, 32, 16), recipe).fast_accum == torchao_fast
    assert set(MXFP8Config(recipe=recipe).fp8_fast_accum) == torchao_fast


def test_fast_accumulation_settings_are_checked_and_reach_the_layers():
    for bad, match in ((("out",), "distinct GEMM roles"), (("output", "output"), "distinct GEMM roles"),
                       ("output", "tuple of GEMM roles")):
        with pytest.raises(ValueError, match=f"MXFP8Config.fp8_fast_accum.*{match}"):
            MXFP8Config(recipe="fp8_rowwise", fp8_fast_accum=bad)
    with pytest.raises(ValueError, match="fp8_fast_accum: recipe fp8_rowwise_gw_hp computes the weight"):
        MXFP8Config(recipe="fp8_rowwise_gw_hp", fp8_fast_accum=("grad_weight",))
    with pytest.raises(ValueError, match="fp8_fast_accum applies to the FP8 recipes, not mxfp8"):
        MXFP8Config(fp8_fast_accum=())
    with pytest.raises(ValueError, match="fast_accum must list distinct"):
        FP8GroupedExperts.from_module(ToyExperts(2, 32, 16), fast_accum=("forward",))
    assert FP8GroupedExperts.from_module(ToyExperts(2, 32, 16)).fast_accum == {"output"}
    model = nn.ModuleDict({"experts": ToyExperts(2, 32, 16)})
    apply_mxfp8(model, MXFP8Config(recipe="fp8_rowwise", fp8_fast_accum=("grad_input", "grad_weight")))
    assert model["experts"].fast_accum == {"grad_input", "grad_weight"}
    assert "fast_accum=grad_input,grad_weight" in repr(model["experts"])


def stand_in_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None,
                               use_fast_accum=False, calls=None):
    """``torch._scaled_grouped_mm``'s contract on CPU (rowwise FP32 scales; torch's meta
    checks and the sm_90 kernel's group-alignment asserts), for checking the arguments the
    native path builds without a GPU; appends ``(form, use_fast_accum)`` to ``calls``
    (form ``rows`` for 2d x 3d, ``tokens`` for 2d x 2d)."""
    if calls is not None:
        calls.append(("rows" if mat_b.dim() == 3 else "tokens", use_fast_accum))
    assert type(use_fast_accum) is bool
    assert mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn
    assert mat_a.stride(-1) == 1 and mat_a.stride(-2) > 1, "mat_a must be row-major"
    assert mat_b.stride(-2) == 1 and mat_b.stride(-1) > 1, "mat_b must be column-major"
    assert scale_a.dtype == scale_b.dtype == torch.float32 and scale_a.is_contiguous()
    assert out_dtype == torch.bfloat16 and offs.dtype == torch.int32
    a, b = mat_a.float(), mat_b.float()
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if mat_a.dim() == 2 and mat_b.dim() == 3:  # rows grouped: [R, K] x [E, K, N]
        assert a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0 and b.shape[0] == len(ends)
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = torch.zeros(a.shape[0], b.shape[2])
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            out[s:t] = (a[s:t] * scale_a[s:t, None]) @ (b[e] * scale_b[e][None, :])
        return out.to(out_dtype)
    assert mat_a.dim() == mat_b.dim() == 2  # reduction grouped: [M, T] x [T, N] -> [E, M, N]
    M, N, G = a.shape[0], b.shape[1], len(ends)
    assert mat_a.stride(0) % 16 == 0 and mat_b.stride(1) % 16 == 0
    assert all(s % 16 == 0 for s in starts), "each group must start 16-byte aligned"
    assert ends[-1] <= a.shape[1] and scale_a.shape == (M * G,) and scale_b.shape == (N * G,)
    out = torch.zeros(G, M, N)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        out[e] = ((a[:, s:t] * scale_a[e * M:(e + 1) * M, None])
                  @ (b[s:t] * scale_b[e * N:(e + 1) * N][None, :]))
    return out.to(out_dtype)


# (recipe, fast_accum or None for the default) -> the native GEMM calls of one forward and
# backward in order (forward h13, y; backward dh, drows; weight gradients w13, w2) with the
# accumulation each asks for. Default: torchao's float8 rowwise per-GEMM configs (output fast,
# grad_input and grad_weight in FP32).
FAST_ACCUM_CALLS = {
    ("fp8_rowwise", None): [("rows", True)] * 2 + [("rows", False)] * 2 + [("tokens", False)] * 2,
    ("fp8_rowwise_gw_hp", None): [("rows", True)] * 2 + [("rows", False)] * 2,
    ("fp8_rowwise", ()): [("rows", False)] * 4 + [("tokens", False)] * 2,
    ("fp8_rowwise", ("grad_input",)): [("rows", False)] * 2 + [("rows", True)] * 2 + [("tokens", False)] * 2,
    ("fp8_rowwise", ("grad_weight", "output", "grad_input")): [("rows", True)] * 4 + [("tokens", True)] * 2,
}


@pytest.mark.parametrize(("recipe", "fast_accum"), list(FAST_ACCUM_CALLS),
                         ids=[f"{r}-{'default' if f is None else '+'.join(f) or 'none'}"
                              for r, f in FAST_ACCUM_CALLS])
def test_native_path_arguments_against_a_stand_in_gemm(recipe, fast_accum, monkeypatch):
    """The native path's operands, transposes, scales, padded offsets and per-GEMM
    accumulation, through a CPU stand-in for torch._scaled_grouped_mm: equal to the
    emulation up to accumulation order (the stand-in computes in FP32 whatever
    ``use_fast_accum`` says, as the emulation)."""
    import functools

    import moe_mxfp8.fp8_gemm as fp8_gemm

    experts = ToyExperts(5, 64, 48)
    for p in experts.parameters():
        p.data = p.data.bfloat16()
    emulated = FP8GroupedExperts.from_module(experts, recipe)
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(torch, "_scaled_grouped_mm",
                        functools.partial(stand_in_scaled_grouped_mm, calls=calls), raising=False)
    monkeypatch.setattr(fp8_gemm, "fp8_native_available", lambda device: True)
    native = FP8GroupedExperts.from_module(
        experts, recipe, gemm="native", **({} if fast_accum is None else {"fast_accum": fast_accum}))
    offsets = torch.tensor([7, 7, 30, 31, 50], dtype=torch.int32)  # uneven, an empty expert
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(53, 64, generator=g).bfloat16().requires_grad_()  # 3 padding rows
    dy = torch.randn(53, 64, generator=g).bfloat16()
    outs = []
    for layer in (native, emulated):
        y = layer(rows, offsets)
        outs.append((y[:50], *torch.autograd.grad(y, [rows, *experts.parameters()], dy)))
    for got, want in zip(*outs, strict=True):
        got = got[:50] if got.shape == rows.shape else got
        want = want[:50] if want.shape == rows.shape else want
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-4)
    assert calls == FAST_ACCUM_CALLS[recipe, fast_accum]
