"""MXFP8 layers against the "dequantize, then multiply in FP32" reference; weight caches."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from moe_mxfp8 import (
    MXFP8Config,
    MXFP8GroupedExperts,
    MXFP8Linear,
    apply_mxfp8,
    dequantize,
    name_matches,
    quantize,
    refresh_weight_caches,
    unmatched_targets,
)
from moe_testing import saved_tensor_bytes
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from sink_helpers import LaterDense, LaterGradient, RecordingSink  # noqa: E402

TIGHT = dict(rtol=2e-5, atol=2e-6)  # FP32 accumulation-order differences only


def mx(x: torch.Tensor, axis: int = -1) -> torch.Tensor:
    """Reference MXFP8 round trip in FP32 (pure torch)."""
    return dequantize(*quantize(x, axis, backend="reference"), axis, dtype=torch.float32,
                      backend="reference")


def mx_weight(w: torch.Tensor, axis: int) -> torch.Tensor:
    """Weights are quantized from their BF16 rounding, as the caches do."""
    return mx(w.detach().bfloat16(), axis)


class ToyExperts(nn.Module):
    """Stands in for moe_model.GroupedExperts: same parameter names, shapes and attributes."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.expert_start, self.n_local, self.backend = 0, n_experts, "auto"
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, d_model, generator=g) * 0.2)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, d_model, generator=g) * 0.2)
        self.w2 = nn.Parameter(torch.randn(n_experts, d_model, hidden, generator=g) * 0.2)


def reference_experts(rows, offsets, w1, w3, w2, dy, mx_saved: bool):
    """Per-expert loop: MXFP8 operands along each GEMM's reduction dim, FP32 products."""
    w13 = torch.cat([w1, w3], dim=1)
    w13_f, w13_b = mx_weight(w13, -1), mx_weight(w13, -2)
    w2_f, w2_b = mx_weight(w2, -1), mx_weight(w2, -2)
    F_ = w1.shape[1]
    rows_q = mx(rows)
    ends = offsets.tolist()
    y = torch.zeros(rows.shape[0], w2.shape[1])
    drows = torch.zeros_like(rows)
    dw13, dw2 = torch.zeros_like(w13), torch.zeros_like(w2)
    start = 0
    for e, end in enumerate(ends):
        seg = slice(start, end)
        start = end
        h13 = (rows_q[seg] @ w13_f[e].T).requires_grad_()
        h = F.silu(h13[:, :F_]) * h13[:, F_:]
        h_q = mx(h.detach())
        y[seg] = h_q @ w2_f[e].T
        dh = mx(dy[seg]) @ w2_b[e]
        h13_saved = mx(h13.detach()).requires_grad_() if mx_saved else h13
        h_s = F.silu(h13_saved[:, :F_]) * h13_saved[:, F_:]
        (dh13,) = torch.autograd.grad(h_s, h13_saved, dh)
        drows[seg] = mx(dh13) @ w13_b[e]
        dw13[e] = dh13.T @ (rows_q[seg] if mx_saved else rows[seg])
        dw2[e] = dy[seg].T @ (h_q if mx_saved else h.detach())
    return y, drows, dw13[:, :F_], dw13[:, F_:], dw2


@pytest.mark.parametrize("mx_saved", [False, True])
@pytest.mark.parametrize("R", [27, 30])  # without and with padding rows past the last offset
def test_grouped_experts_match_reference(mx_saved, R):
    E, D, F_ = 4, 40, 24  # neither width is a multiple of 32
    experts = ToyExperts(E, D, F_)
    layer = MXFP8GroupedExperts.from_module(experts, save_mxfp8_activations=mx_saved)
    offsets = torch.tensor([5, 5, 18, 27], dtype=torch.int32)  # odd sizes, one empty expert
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(R, D, generator=g)
    rows[27:] = float("nan")  # padding rows must not leak into real rows or weight grads
    dy = torch.randn(R, D, generator=g)
    rows.requires_grad_()
    y = layer(rows, offsets)
    y.backward(dy)
    ref = reference_experts(rows.detach(), offsets, experts.w1, experts.w3, experts.w2, dy, mx_saved)
    torch.testing.assert_close(y[:27], ref[0][:27], **TIGHT)
    torch.testing.assert_close(rows.grad[:27], ref[1][:27], **TIGHT)
    for got, want in zip((experts.w1.grad, experts.w3.grad, experts.w2.grad), ref[2:], strict=True):
        torch.testing.assert_close(got, want, **TIGHT)
    assert experts.w1.grad[1].abs().sum() == 0  # the empty expert


def test_linear_matches_reference_and_keeps_parameters():
    lin = nn.Linear(40, 56, bias=True)
    layer = MXFP8Linear.from_module(lin)
    assert layer.weight is lin.weight and layer.bias is lin.bias
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 40, generator=g, requires_grad=True)
    dy = torch.randn(3, 7, 56, generator=g)
    y = layer(x)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 40), dy.reshape(-1, 56)
    y_ref = mx(x2) @ mx_weight(lin.weight, -1).T + lin.bias
    torch.testing.assert_close(y.reshape(-1, 56), y_ref, **TIGHT)
    torch.testing.assert_close(x.grad.reshape(-1, 40), mx(dy2) @ mx_weight(lin.weight, 0), **TIGHT)
    torch.testing.assert_close(lin.weight.grad, dy2.T @ x2, **TIGHT)
    torch.testing.assert_close(lin.bias.grad, dy2.sum(0), **TIGHT)


@pytest.mark.parametrize("maker", [None, LaterGradient], ids=["computed", "maker"])
@pytest.mark.parametrize("mx_saved", [False, True])
def test_experts_weight_gradients_go_into_the_sink(mx_saved, maker):
    """With a sink that takes w1 and w2: its accumulators get the reference's gradients of two
    microbatches, their ``.grad`` stays None, w3 (not the sink's) keeps autograd's path, a
    maker gets the operands (the rows as the backward reads them, the gate half of dh13,
    h, dy), and a backward that does not run the weights' nodes (a pipeline's input pass)
    adds nothing."""
    E, D, F_ = 4, 40, 24
    experts = ToyExperts(E, D, F_)
    offsets = torch.tensor([5, 5, 18, 27], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(27, D, generator=g, requires_grad=True)
    dy = torch.randn(27, D, generator=g)
    ref = reference_experts(rows.detach(), offsets, experts.w1, experts.w3, experts.w2, dy, mx_saved)
    experts.grad_sink = RecordingSink([experts.w1, experts.w2])
    layer = MXFP8GroupedExperts.from_module(experts, save_mxfp8_activations=mx_saved)
    assert layer.grad_sink is experts.grad_sink
    layer.weight_gradient = maker
    LaterGradient.made = []
    for _ in range(2):
        layer(rows, offsets).backward(dy)
    sink = experts.grad_sink
    assert sink.calls == 4 and experts.w1.grad is None and experts.w2.grad is None
    torch.testing.assert_close(sink.targets[id(experts.w1)], 2 * ref[2].reshape(-1), **TIGHT)
    torch.testing.assert_close(sink.targets[id(experts.w2)], 2 * ref[4].reshape(-1), **TIGHT)
    torch.testing.assert_close(experts.w3.grad, 2 * ref[3], **TIGHT)
    torch.testing.assert_close(rows.grad, 2 * ref[1], **TIGHT)
    assert len(LaterGradient.made) == (4 if maker else 0)
    if maker:
        gate, down = LaterGradient.made[:2]
        torch.testing.assert_close(gate.x, mx(rows.detach()) if mx_saved else rows.detach(), rtol=0, atol=0)
        assert gate.dy.shape == (27, F_) and down.x.shape == (27, F_) and torch.equal(down.dy, dy)
    torch.autograd.grad(layer(rows, offsets), rows, dy)
    assert sink.calls == 4


@pytest.mark.parametrize("maker", [None, LaterDense], ids=["computed", "maker"])
def test_linear_weight_gradient_goes_into_the_sink(maker):
    """The sink's accumulator gets the reference's weight gradient of two microbatches,
    ``weight.grad`` stays None, a maker gets the operands, and an input-gradient pass adds
    nothing."""
    lin = nn.Linear(40, 56, bias=False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 40, generator=g, requires_grad=True)
    dy = torch.randn(3, 7, 56, generator=g)
    x2, dy2 = x.detach().reshape(-1, 40), dy.reshape(-1, 56)
    lin.grad_sink = RecordingSink([lin.weight])
    layer = MXFP8Linear.from_module(lin)
    assert layer.grad_sink is lin.grad_sink
    layer.dense_weight_gradient = maker
    LaterDense.made = []
    for _ in range(2):
        layer(x).backward(dy)
    assert lin.grad_sink.calls == 2 and lin.weight.grad is None
    torch.testing.assert_close(lin.grad_sink.targets[id(lin.weight)], 2 * (dy2.T @ x2).reshape(-1), **TIGHT)
    torch.testing.assert_close(x.grad.reshape(-1, 40), 2 * mx(dy2) @ mx_weight(lin.weight, 0), **TIGHT)
    assert len(LaterDense.made) == (2 if maker else 0)
    if maker:
        assert torch.equal(LaterDense.made[0].x, x2) and torch.equal(LaterDense.made[0].dy, dy2)
    torch.autograd.grad(layer(x).sum(), x)
    assert lin.grad_sink.calls == 2


def test_bf16_autocast_runs_a_bf16_gemm_on_exact_operands():
    """Under BF16 autocast the GEMM reads BF16 operands that equal the FP32 dequantized ones."""
    lin = nn.Linear(64, 32, bias=False)
    layer = MXFP8Linear.from_module(lin)
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = mx(x.bfloat16()) @ mx_weight(lin.weight, -1).T  # FP32 product of the same operands
    torch.testing.assert_close(y, ref.bfloat16(), rtol=8e-3, atol=1e-5)  # one BF16 rounding


def test_mxfp8_saved_activations_halve_saved_bytes():
    experts = ToyExperts(4, 64, 64)
    rows = torch.randn(96, 64, dtype=torch.bfloat16, requires_grad=True)
    offsets = torch.tensor([20, 40, 70, 96], dtype=torch.int32)
    plain = saved_tensor_bytes(lambda: MXFP8GroupedExperts.from_module(experts)(rows, offsets))
    small = saved_tensor_bytes(lambda: MXFP8GroupedExperts.from_module(experts, True)(rows, offsets))
    # plain: rows [R,D] + h13 [R,2F] in BF16; MXFP8: rows, h13 and h at ~1.03 bytes each.
    assert plain == 96 * (64 + 128) * 2 + 4 * 4
    assert small < 0.7 * plain


def test_parameters_replaced_by_load_state_dict_assign_are_stale_until_refreshed():
    """``load_state_dict(assign=True)`` gives the layer new parameter objects: the cache
    must not keep serving the old ones, and a refresh quantizes the new ones."""
    model = nn.Sequential(MXFP8Linear.from_module(nn.Linear(64, 32, bias=False)))
    model.load_state_dict({"0.weight": torch.randn(32, 64)}, assign=True)
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="refresh_weight_cache"):
        model(x)
    model[0].refresh_weight_cache()
    assert torch.equal(model(x), MXFP8Linear(model[0].weight)(x))


def test_cache_after_adamw_step_equals_fresh_quantization():
    model = nn.ModuleDict({"experts": ToyExperts(3, 64, 32), "proj": nn.Linear(64, 64)})
    names_before = [n for n, _ in model.named_parameters()]
    params_before = list(model.parameters())
    replaced = apply_mxfp8(model, MXFP8Config(targets=("experts", "proj")))
    assert replaced == ["experts", "proj"]
    assert [n for n, _ in model.named_parameters()] == names_before
    assert all(a is b for a, b in zip(model.parameters(), params_before, strict=True))
    assert model["experts"].expert_start == 0 and model["experts"].n_local == 3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = torch.randn(40, 64)
    offsets = torch.tensor([10, 25, 40], dtype=torch.int32)
    loss = model["proj"](model["experts"](rows, offsets)).square().sum()
    loss.backward()
    opt.step()
    with pytest.raises(RuntimeError, match="refresh_weight_cache"):
        model["experts"](rows, offsets)  # stale: the step changed the weights
    assert refresh_weight_caches(model) == 2  # what the optimizer's weights-updated hook calls
    experts, proj = model["experts"], model["proj"]
    checks = [(experts.w13_cache, torch.cat([experts.w1, experts.w3], dim=1)),
              (experts.w2_cache, experts.w2), (proj.weight_cache, proj.weight)]
    for cache, weight in checks:
        w = weight.detach().bfloat16()
        for got, axis in ((cache.rows, -1), (cache.cols, -2)):
            data, scales = quantize(w, axis, backend="reference")
            assert torch.equal(got.data.view(torch.uint8), data.view(torch.uint8))
            assert torch.equal(got.scales.view(torch.uint8), scales.view(torch.uint8))
    model["experts"](rows, offsets)  # fresh again


def test_apply_mxfp8_patterns():
    model = nn.ModuleDict({
        "blocks": nn.ModuleDict({str(i): nn.ModuleDict({
            "attn": nn.ModuleDict({"wq": nn.Linear(8, 8), "wo": nn.Linear(8, 8)}),
            "mlp": nn.ModuleDict({"experts": ToyExperts(2, 32, 32), "router": nn.Linear(32, 2)}),
        }) for i in range(2)}),
        "head": nn.Linear(8, 4),
    })
    targets = ("experts", "attn.w?", "mlp", "exprts", "attn")  # ModuleDicts are not layers
    assert unmatched_targets(model, targets) == ["mlp", "exprts", "attn"]
    assert apply_mxfp8(model, MXFP8Config(targets=("experts", "attn.w?"))) == [
        "blocks.0.attn.wq", "blocks.0.attn.wo", "blocks.0.mlp.experts",
        "blocks.1.attn.wq", "blocks.1.attn.wo", "blocks.1.mlp.experts",
    ]
    assert isinstance(model["blocks"]["1"]["mlp"]["experts"], MXFP8GroupedExperts)
    assert isinstance(model["blocks"]["0"]["mlp"]["router"], nn.Linear)
    assert apply_mxfp8(model, MXFP8Config(targets=("experts",))) == []  # already converted
    assert unmatched_targets(model, targets) == ["mlp", "exprts", "attn"]  # converted still match
    assert name_matches("blocks.0.mlp.experts", "blocks.0.*")
    assert not name_matches("blocks.10.mlp.experts", "blocks.1.*.experts")
    with pytest.raises(ValueError, match="gemm"):
        MXFP8Config(gemm="fast")
    with pytest.raises(ValueError, match="targets"):
        MXFP8Config(targets="experts")


def test_bad_inputs_name_the_field():
    layer = MXFP8GroupedExperts.from_module(ToyExperts(2, 32, 32))
    with pytest.raises(ValueError, match="group_offsets must be int32"):
        layer(torch.randn(4, 32), torch.tensor([2, 4]))
    with pytest.raises(ValueError, match="rows must be"):
        layer(torch.randn(4, 31), torch.tensor([2, 4], dtype=torch.int32))
    with pytest.raises(TypeError, match="w1"):
        MXFP8GroupedExperts.from_module(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="native"):
        MXFP8Linear.from_module(nn.Linear(64, 64), gemm="native")  # no sm_100 here
