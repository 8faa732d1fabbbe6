"""FP8Linear (emulated GEMMs) against FP32 oracles built on torchao's quantization functions;
the FP8 recipes converting dense layers in ``apply_mxfp8``."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from moe_mxfp8 import FP8_RECIPES, FP8Linear, MXFP8Config, apply_mxfp8, refresh_weight_caches
from torch import nn

pytest.importorskip("torchao.float8.float8_utils")
sys.path.insert(0, str(Path(__file__).parent))
from sink_helpers import LaterDense, RecordingSink  # noqa: E402
from test_fp8_experts import (  # noqa: E402
    TIGHT,
    ToyExperts,
    act_1x128,
    rowwise,
    weight_128x128,
)


def oracle(recipe: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """``y``, ``dx``, ``dw`` from FP32 products of operands quantized by torchao's functions."""
    wb = w.detach().bfloat16()  # the cache quantizes the BF16 weight
    if recipe.startswith("fp8_rowwise"):
        act, w_fwd, w_bwd = rowwise, rowwise(wb, -1), rowwise(wb, 0)
    else:
        act = act_1x128
        w_fwd = w_bwd = weight_128x128(wb[None])[0]  # the transpose's blocks are the same
    y = act(x) @ w_fwd.T
    dx = act(dy) @ w_bwd
    if recipe == "fp8_rowwise":  # per column, along the rows
        dw = rowwise(dy, 0).T @ rowwise(x, 0)
    else:  # in the compute dtype
        dw = dy.T @ x
    return y, dx, dw


CASES = {"fp8_rowwise": (48, 40), "fp8_rowwise_gw_hp": (48, 40), "fp8_blockwise": (256, 128)}


@pytest.mark.parametrize("recipe", list(CASES))
def test_linear_matches_torchao_oracle(recipe):
    n_in, n_out = CASES[recipe]
    g = torch.Generator().manual_seed(2)
    linear = nn.Linear(n_in, n_out)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n_out, n_in, generator=g) * 0.2)
    layer = FP8Linear.from_module(linear, recipe)
    x = (torch.randn(3, 7, n_in, generator=g) * 3).requires_grad_()  # leading dims flatten
    dy = torch.randn(3, 7, n_out, generator=g)
    y = layer(x)
    y.backward(dy)
    ref_y, ref_dx, ref_dw = oracle(recipe, x.detach().reshape(21, n_in), linear.weight,
                                   dy.reshape(21, n_out))
    torch.testing.assert_close(y, (ref_y + linear.bias.detach()).view(3, 7, n_out), **TIGHT)
    torch.testing.assert_close(x.grad, ref_dx.view(3, 7, n_in), **TIGHT)
    torch.testing.assert_close(linear.weight.grad, ref_dw, **TIGHT)
    torch.testing.assert_close(linear.bias.grad, dy.sum((0, 1)), **TIGHT)
    # the oracle is not the unquantized product: FP8 is seen
    assert not torch.allclose(y, linear(x.detach()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("maker", [None, LaterDense], ids=["computed", "maker"])
@pytest.mark.parametrize("recipe", list(CASES))
def test_linear_weight_gradient_goes_into_the_sink(recipe, maker):
    """With a sink that takes the weight: its accumulator gets what autograd's path returns
    (two microbatches summed), ``weight.grad`` stays None, the maker gets the operands in
    the compute-dtype recipes (never in ``fp8_rowwise``, whose gradient is FP8), and a
    backward that does not run the weight's node (a pipeline's input pass) adds nothing."""
    n_in, n_out = CASES[recipe]
    g = torch.Generator().manual_seed(3)
    linear = nn.Linear(n_in, n_out, bias=False)
    x = (torch.randn(2, 9, n_in, generator=g) * 3).requires_grad_()
    dy = torch.randn(2, 9, n_out, generator=g)
    FP8Linear.from_module(linear, recipe)(x).backward(dy)
    want_dw, want_dx = linear.weight.grad.clone(), x.grad.clone()
    linear.weight.grad = x.grad = None
    linear.grad_sink = RecordingSink([linear.weight])
    layer = FP8Linear.from_module(linear, recipe)
    assert layer.grad_sink is linear.grad_sink
    layer.dense_weight_gradient = maker
    LaterDense.made = []
    for _ in range(2):
        layer(x).backward(dy)
    sink = linear.grad_sink
    assert sink.calls == 2 and linear.weight.grad is None
    torch.testing.assert_close(sink.targets[id(linear.weight)], 2 * want_dw.reshape(-1), **TIGHT)
    torch.testing.assert_close(x.grad, 2 * want_dx)
    assert len(LaterDense.made) == (2 if maker and not FP8_RECIPES[recipe].fp8_wgrad else 0)
    if LaterDense.made:
        assert torch.equal(LaterDense.made[0].x, x.detach().reshape(18, n_in))
        assert torch.equal(LaterDense.made[0].dy, dy.reshape(18, n_out))
    torch.autograd.grad(layer(x).sum(), x)
    assert sink.calls == 2


def test_recipes_convert_linear_layers_and_experts_and_refresh_their_caches():
    model = nn.ModuleDict({"experts": ToyExperts(3, 64, 32), "proj": nn.Linear(64, 64, bias=False)})
    params = list(model.parameters())
    replaced = apply_mxfp8(model, MXFP8Config(targets=("experts", "proj"), recipe="fp8_rowwise_gw_hp"))
    assert replaced == ["experts", "proj"] and isinstance(model["proj"], FP8Linear)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert "recipe=fp8_rowwise_gw_hp" in repr(model["proj"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows, offsets = torch.randn(40, 64), torch.tensor([10, 25, 40], dtype=torch.int32)
    model["proj"](model["experts"](rows, offsets)).square().sum().backward()
    assert model["proj"].weight.grad is not None and model["experts"].w1.grad is not None
    opt.step()
    with pytest.raises(RuntimeError, match="refresh_weight_cache"):
        model["proj"](rows)
    assert refresh_weight_caches(model) == 2
    fresh = FP8Linear(model["proj"].weight, recipe="fp8_rowwise_gw_hp")
    assert torch.equal(model["proj"](rows), fresh(rows))


def test_dense_gemm_sets_the_linear_layers_gemm_and_leaves_the_experts_on_gemm():
    model = nn.ModuleDict({"experts": ToyExperts(3, 64, 32), "proj": nn.Linear(64, 64, bias=False)})
    config = MXFP8Config(targets=("experts", "proj"), recipe="fp8_rowwise_gw_hp", gemm="triton",
                         dense_gemm="native")
    apply_mxfp8(model, config)
    assert (model["experts"].gemm, model["proj"].gemm) == ("triton", "native")
    same = nn.ModuleDict({"experts": ToyExperts(3, 64, 32), "proj": nn.Linear(64, 64, bias=False)})
    apply_mxfp8(same, MXFP8Config(targets=("experts", "proj"), recipe="fp8_rowwise", gemm="triton"))
    assert (same["experts"].gemm, same["proj"].gemm) == ("triton", "triton")  # None: gemm's


@pytest.mark.parametrize("fields, match", [
    ({"recipe": "fp8_rowwise", "dense_gemm": "fast"}, "dense_gemm must be one of"),
    ({"recipe": "fp8_blockwise", "gemm": "triton", "dense_gemm": "native"},
     "dense_gemm: recipe fp8_blockwise has no native"),
    ({"recipe": "mxfp8", "dense_gemm": "native"}, "dense_gemm applies to the FP8 recipes"),
])
def test_bad_dense_gemm_is_refused_naming_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        MXFP8Config(**fields)


def test_bad_construction_is_refused_naming_the_field():
    w = nn.Parameter(torch.randn(40, 24))
    with pytest.raises(ValueError, match="recipe must be one of"):
        FP8Linear(w, recipe="mxfp8")
    with pytest.raises(ValueError, match="no native FP8 GEMM"):
        FP8Linear(w, recipe="fp8_blockwise", gemm="native")
    with pytest.raises(ValueError, match="divisible by 16"):
        FP8Linear(w, gemm="native")
    with pytest.raises(ValueError, match="drop grad_weight"):
        FP8Linear(w, recipe="fp8_rowwise_gw_hp", fast_accum=("grad_weight",))
    with pytest.raises(ValueError, match=r"inputs \[\.\.\., 24\]"):
        FP8Linear(w)(torch.randn(3, 40))


def test_native_linear_on_torch_scaled_mm_matches_the_emulation(monkeypatch):
    """``gemm="native"`` runs ``torch._scaled_mm`` (on CPU here, the GPU check being
    ``test_fp8_gpu.py``): the reciprocal scales in the shapes it takes, the cache's
    transposed copy for the input gradient; equal to the emulation to the BF16 rounding."""
    import moe_mxfp8.fp8_gemm as fp8_gemm

    monkeypatch.setattr(fp8_gemm, "fp8_native_available", lambda device: True)
    g = torch.Generator().manual_seed(5)
    weight = nn.Parameter((torch.randn(48, 64, generator=g) * 0.2).bfloat16())
    x = torch.randn(37, 64, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(37, 48, generator=g).bfloat16()
    outs = []
    for gemm in ("native", "emulated"):
        y = FP8Linear(weight, recipe="fp8_rowwise_gw_hp", gemm=gemm)(x)
        outs.append((y, *torch.autograd.grad(y, [x, weight], dy)))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_native_linear_keeps_its_weight_dequant_scales_fresh_through_refreshes(monkeypatch):
    """A layer on the native GEMM holds its weight copies' ``1 / scale`` in the cache, derived
    with the copies (in place by an in-place refresh, at the same address a captured graph
    reads), so a GEMM after an update uses the new scales; other GEMMs hold none."""
    import moe_mxfp8.fp8_gemm as fp8_gemm

    monkeypatch.setattr(fp8_gemm, "fp8_native_available", lambda device: True)
    g = torch.Generator().manual_seed(6)
    weight = nn.Parameter((torch.randn(48, 64, generator=g) * 0.2).bfloat16())
    x = torch.randn(37, 64, generator=g).bfloat16().requires_grad_()
    dy = torch.randn(37, 48, generator=g).bfloat16()
    layer = FP8Linear(weight, recipe="fp8_rowwise_gw_hp", gemm="native")
    cache = layer.weight_cache
    held = (cache.rows_dequant, cache.cols_dequant)
    before = [t.clone() for t in held]
    with torch.no_grad():
        weight.mul_(torch.linspace(0.01, 40, 48).bfloat16()[:, None])  # new scales on most rows
    layer.refresh_weight_cache(in_place=True)
    assert cache.rows_dequant is held[0] and cache.cols_dequant is held[1]
    for inverse, copy, old in zip(held, (cache.rows, cache.cols), before, strict=True):
        assert torch.equal(inverse, copy.scale.reciprocal()) and not torch.equal(inverse, old)
    outs = []
    for model in (layer, FP8Linear(weight, recipe="fp8_rowwise_gw_hp", gemm="emulated")):
        y = model(x)
        outs.append((y, *torch.autograd.grad(y, [x], dy)))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    # q, k and v on the native GEMM share the input's factor: the same outputs as one by one,
    # bit for bit, and the same input gradient up to the BF16 rounding of its additions
    layers = tuple(FP8Linear(nn.Parameter((torch.randn(n, 64, generator=g) * 0.2).bfloat16()),
                             recipe="fp8_rowwise_gw_hp", gemm="native") for n in (48, 32, 32))
    xs = torch.randn(2, 9, 64, generator=g).bfloat16()
    dys = [torch.randn(2, 9, m.out_features, generator=g).bfloat16() for m in layers]
    runs = []
    for shared in (True, False):
        xg = xs.clone().requires_grad_()
        ys = FP8Linear.shared_input_forward(xg, layers) if shared else tuple(m(xg) for m in layers)
        runs.append((ys, torch.autograd.grad(ys, [xg], dys)[0]))
    (ys_shared, dx_shared), (ys_alone, dx_alone) = runs
    assert all(torch.equal(a, b) for a, b in zip(ys_shared, ys_alone, strict=True))
    torch.testing.assert_close(dx_shared, dx_alone, rtol=1.6e-2, atol=1e-2)
    layer.refresh_weight_cache()
    assert cache.rows_dequant is not held[0] and torch.equal(cache.rows_dequant, held[0])
    assert FP8Linear(weight, recipe="fp8_rowwise_gw_hp", gemm="emulated").weight_cache.rows_dequant is None


def test_native_shared_input_gradients_add_in_the_triton_gemm(monkeypatch):
    """On ``native``, q, k and v's input gradient starts on torch's GEMM and the k and v
    terms go to the Triton GEMM, which adds in its epilogue, wherever the package's kernels
    run; elsewhere all three stay on torch's GEMM, then an add. (Recorded here with the
    Triton GEMM's calls run emulated; ``test_fp8_gpu.py`` runs them on a GPU.)"""
    import moe_mxfp8.fp8_gemm as fp8_gemm
    from moe_mxfp8 import fp8_linear

    monkeypatch.setattr(fp8_gemm, "fp8_native_available", lambda device: True)
    mm, calls = fp8_linear._mm, []

    def recorded(a, b, rows, gemm, *args):
        calls.append((gemm, rows is not None))
        return mm(a, b, rows, "emulated" if gemm == "triton" else gemm, *args)

    monkeypatch.setattr(fp8_linear, "_mm", recorded)
    g = torch.Generator().manual_seed(7)
    layers = tuple(FP8Linear(nn.Parameter((torch.randn(n, 64, generator=g) * 0.2).bfloat16()),
                             recipe="fp8_rowwise_gw_hp", gemm="native") for n in (48, 32, 32))
    x = torch.randn(2, 9, 64, generator=g).bfloat16()
    dys = [torch.randn(2, 9, m.out_features, generator=g).bfloat16() for m in layers]
    for kernels, backward in ((False, ["native"] * 3), (True, ["native", "triton", "triton"])):
        # what fp8_linear alone sees (the quantisation stays on its CPU path)
        monkeypatch.setattr(fp8_linear, "_triton_support",
                            SimpleNamespace(fused_kernels_enabled=lambda device, on=kernels: on))
        xg = x.clone().requires_grad_()
        ys = FP8Linear.shared_input_forward(xg, layers)
        calls.clear()
        dx = torch.autograd.grad(ys, [xg], dys)[0]
        assert [gemm for gemm, _ in calls] == backward
        assert all(has_rows for gemm, has_rows in calls if gemm == "triton")
        alone = sum(torch.autograd.grad(m(xg), [xg], dy)[0].float() for m, dy in zip(layers, dys, strict=True))
        torch.testing.assert_close(dx.float(), alone, rtol=1.6e-2, atol=2e-2)


def _three_projections(recipe: str, seed: int):
    """q, k and v shaped projections of one input width (nn.Linear, no bias), and an input."""
    n_in, n_out = CASES[recipe]
    g = torch.Generator().manual_seed(seed)
    linears = [nn.Linear(n_in, n, bias=False) for n in (n_out, n_out // 2, n_out // 2)]
    with torch.no_grad():
        for linear in linears:
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.2)
    x = torch.randn(2, 9, n_in, generator=g) * 3
    dys = [torch.randn(2, 9, linear.out_features, generator=g) for linear in linears]
    return linears, x, dys


@pytest.mark.parametrize("recipe", list(CASES))
def test_layers_sharing_an_input_quantize_it_once_and_match_separate_calls(recipe, monkeypatch):
    """``shared_input_forward`` (attention's q, k and v): the same outputs and weight
    gradients as calling each layer, bit for bit, and the same input gradient up to the
    order of the additions, from one quantisation of the input instead of three."""
    from moe_mxfp8 import fp8_linear

    linears, x, dys = _three_projections(recipe, seed=4)
    results, calls = [], []
    quantize = fp8_linear.quantize_fp8
    monkeypatch.setattr(fp8_linear, "quantize_fp8", lambda t, *a: calls.append(t.shape) or quantize(t, *a))
    for shared in (False, True):
        for linear in linears:
            linear.weight.grad = None
        layers = tuple(FP8Linear.from_module(linear, recipe) for linear in linears)
        xg = x.clone().requires_grad_()
        calls.clear()
        ys = FP8Linear.shared_input_forward(xg, layers) if shared else tuple(layer(xg) for layer in layers)
        forward_quantizations = len(calls)
        torch.autograd.backward(ys, dys)
        results.append((ys, xg.grad, [linear.weight.grad for linear in linears], forward_quantizations))
    (ys0, dx0, dw0, n0), (ys1, dx1, dw1, n1) = results
    assert (n0, n1) == (3, 1)
    for a, b in zip([*ys0, *dw0], [*ys1, *dw1], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(dx1, dx0, rtol=1e-6, atol=1e-6)


def test_layers_of_other_recipes_sharing_an_input_are_called_one_by_one(monkeypatch):
    """Each FP8 layer quantizes the input itself (two quantisations for two FP8 layers of
    different recipes), and a plain layer among them is called as it is."""
    from moe_mxfp8 import fp8_linear

    linears, x, dys = _three_projections("fp8_rowwise", seed=5)
    layers = (FP8Linear.from_module(linears[0], "fp8_rowwise"),
              FP8Linear.from_module(linears[1], "fp8_rowwise_gw_hp"), linears[2])
    calls = []
    quantize = fp8_linear.quantize_fp8
    monkeypatch.setattr(fp8_linear, "quantize_fp8", lambda t, *a: calls.append(t.shape) or quantize(t, *a))
    ys = FP8Linear.shared_input_forward(x, layers)
    assert len(calls) == 2
    for y, layer in zip(ys, layers, strict=True):
        assert torch.equal(y, layer(x))


def test_layers_sharing_an_input_give_their_weight_gradients_to_the_sink():
    """Through the sink (``dense_weight_gradient`` set, as the model wires it): each weight's
    add gets its own output gradient and the shared input rows."""
    linears, x, dys = _three_projections("fp8_rowwise_gw_hp", seed=6)
    sink = RecordingSink([linear.weight for linear in linears])
    layers = []
    for linear in linears:
        linear.grad_sink = sink
        layer = FP8Linear.from_module(linear, "fp8_rowwise_gw_hp")
        layer.dense_weight_gradient = LaterDense
        layers.append(layer)
    LaterDense.made = []
    xg = x.clone().requires_grad_()
    torch.autograd.backward(FP8Linear.shared_input_forward(xg, tuple(layers)), dys)
    assert sink.calls == 3 and all(linear.weight.grad is None for linear in linears)
    assert [made.dy.shape[1] for made in LaterDense.made] == [linear.out_features for linear in linears]
    for linear, dy in zip(linears, dys, strict=True):
        want = dy.reshape(18, -1).T @ x.reshape(18, -1)
        torch.testing.assert_close(sink.targets[id(linear.weight)], want.reshape(-1), **TIGHT)


def test_output_gradient_rows_attach_and_take():
    """A rowwise layer that will compute an input gradient tags its output with an
    ``RowCodes`` (none for a blockwise recipe, without grad mode or an input
    that needs no gradient); what it received is used only for the very tensor it came
    with, once; the layer's backward then skips quantizing ``dy`` and uses those codes."""
    from moe_mxfp8.fp8 import quantize_fp8_reference
    from moe_mxfp8.row_codes import GRADIENT_ROW_ENCODER, RowCodes

    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(24, 16))
    x = torch.randn(2, 5, 16, requires_grad=True)
    layer = FP8Linear(w, recipe="fp8_rowwise_gw_hp")
    y = layer(x)
    enc = getattr(y, GRADIENT_ROW_ENCODER)
    assert isinstance(enc, RowCodes) and enc.pow2
    assert not hasattr(layer(x.detach()), GRADIENT_ROW_ENCODER)
    with torch.no_grad():
        assert not hasattr(layer(x), GRADIENT_ROW_ENCODER)
    assert not hasattr(FP8Linear(w, recipe="fp8_blockwise")(x), GRADIENT_ROW_ENCODER)

    dy = torch.randn(10, 24)
    q = quantize_fp8_reference(dy, (1, 0), True)
    got = RowCodes(True)
    got.receive(dy, q.data.view(torch.uint8), q.scale)
    assert got.take(dy.clone()) is None and got.take(dy) is None  # another tensor; then forgotten
    got.receive(dy, q.data.view(torch.uint8), q.scale)
    taken = got.take(dy.view(2, 5, 24).view(10, 24))
    assert torch.equal(taken.data.view(torch.uint8), q.data.view(torch.uint8)) and taken.block == (1, 0)
    got.receive(dy, q.data.view(torch.uint8), q.scale)
    dy.view(2, 5, 24).mul_(1)  # changed in place through a view (a hook editing its argument)
    assert got.take(dy) is None

    # the backward uses received codes: deliberately wrong ones (zeros) show in dx, not in dw
    ref_dx, ref_dw = torch.autograd.grad(layer(x), (x, w), dy.view(2, 5, 24))
    y = layer(x)
    getattr(y, GRADIENT_ROW_ENCODER).receive(dy, torch.zeros(10, 24, dtype=torch.uint8), q.scale)
    dx, dw = torch.autograd.grad(y, (x, w), dy.view(2, 5, 24))
    assert torch.equal(dw, ref_dw) and (dx == 0).all() and ref_dx.abs().sum() > 0
    y = layer(x)
    getattr(y, GRADIENT_ROW_ENCODER).receive(dy, q.data.view(torch.uint8), q.scale)
    dx, _ = torch.autograd.grad(y, (x, w), dy.view(2, 5, 24))
    assert torch.equal(dx, ref_dx)
