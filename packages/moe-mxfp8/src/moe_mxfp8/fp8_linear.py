"""FP8Linear: ``nn.Linear`` whose GEMMs read scaled E4M3 operands, by the FP8 recipes.

Shape legend: M rows (all leading dims flattened), K in_features, N out_features. The
recipes are ``FP8GroupedExperts``' (``moe_mxfp8.fp8_experts.FP8_RECIPES``), applied to one
weight ``[N, K]``:

- forward ``y = x @ w^T``: ``x`` scaled by the recipe's activation blocks along K, ``w``
  from the cache's ``rows`` (scaled along K);
- input gradient ``dx = dy @ w``: ``dy`` scaled along N, ``w`` from the cache's ``cols``
  (the transpose, scaled along N);
- weight gradient ``dw = dy^T @ x``: in FP8 where the recipe says (``fp8_rowwise``:
  both operands scaled per column along the M rows), else in the compute dtype from the
  unquantized operands.

``gemm``: ``native`` (rowwise recipes: ``torch._scaled_mm``, the dense FP8 GEMM of torch
on sm_90, and ``torch._scaled_grouped_mm`` for the FP8 weight gradient), ``triton`` (the
package's FP8 grouped GEMM over one group, every recipe), ``emulated`` (dequantize, FP32
matmul; every device). ``fast_accum`` as ``FP8GroupedExperts``'.

Layers sharing an input (``FP8Linear.shared_input_forward``: attention's q, k and v) add
their input gradients into one tensor. ``torch._scaled_mm`` cannot add into its output, so
on ``native`` every input gradient after the first runs on the Triton GEMM, which adds in
its epilogue (rounded once), wherever the package's Triton kernels run; elsewhere it is
torch's GEMM and then an add. At bench-1gpu's k and v shapes that GEMM is also the faster
of the two (docs/performance.md, the dense GEMM table).

Weight gradient into a sink, as ``FP8GroupedExperts``' (``moe_mxfp8.sink``): where
``grad_sink`` accepts the weight and the backward runs its ``AccumulateGrad`` node, the
gradient goes to the sink as an add into its FP32 accumulator and ``weight.grad`` stays
``None``; otherwise it returns through autograd (this package stands alone). In the
recipes whose weight gradient runs in the compute dtype (``FP8Recipe.fp8_wgrad`` false),
``dense_weight_gradient(x_MK, dy_MN)``, when set, makes that add from the operands
(``target += dy^T @ x`` in the weight's storage order): the model's wiring sets it to
``moe_model.linear.DenseWeightGradient``, on CUDA one cuBLAS GEMM with FP32 output
adding into the main grad (the LM head at ``bench-1gpu``'s shapes: 4.64 ms per
microbatch against 4.98 for a BF16 gradient that the wrapper then re-reads and adds,
``moe_model.linear``). Unset, the layer computes the gradient and the sink adds it.

Output gradient encoded by its producer: a layer of a rowwise recipe (one scale per row
of ``dy``) sets an ``RowCodes`` as ``GRADIENT_ROW_ENCODER`` on its output
(``moe_mxfp8.row_codes``). moe_model's fused cross-entropy, given that output as
logits, writes ``dy``'s E4M3 codes and scales in the pass that writes ``dy``, and the
input gradient uses them instead of quantizing ``dy`` again: for an LM head that saves
reading the ``[8192, 100352]`` BF16 gradient twice per microbatch. They are the codes
``quantize_fp8`` gives for that ``dy`` (tests check it bit for bit), and they are used only
where the gradient the layer receives is the very tensor they were made from and unchanged
since (so not where anything else added to it, nor after a gradient hook edited it in
place); otherwise the layer quantizes as always.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_mxfp8 import _triton_support
from moe_mxfp8.fp8 import FP8Tensor, quantize_fp8
from moe_mxfp8.fp8_experts import FP8_RECIPES, FP8WeightCache, check_layer_choices
from moe_mxfp8.fp8_gemm import (
    FAST_ACCUM_DEFAULT,
    check_gemm_runs,
    check_native_widths,
    fp8_grouped_mm,
    fp8_grouped_wgrad,
)
from moe_mxfp8.gemm import compute_dtype
from moe_mxfp8.linear import DenseWeightGradientMaker
from moe_mxfp8.row_codes import GRADIENT_ROW_ENCODER, RowCodes
from moe_mxfp8.sink import SinkRoute, carry_grad_sink, computes_now, give, hand_over, sink_route


def _one_group(t: FP8Tensor) -> FP8Tensor:
    """A weight copy ``[N, K]`` as the ``[1, N, K]`` stack the grouped GEMMs take."""
    return FP8Tensor(t.data.unsqueeze(0), t.scale.unsqueeze(0), t.block)


def _mm(a: FP8Tensor, b: FP8Tensor, rows: torch.Tensor | None, gemm: str, dtype: torch.dtype,
        fast: bool, accumulate_into: torch.Tensor | None = None,
        dequant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``a [M, K] @ b^T`` for ``b [N, K]``, both scaled along K; ``rows``: ``[M]``, the one
    group's end, for the grouped GEMMs; ``accumulate_into``: ``fp8_grouped_mm``'s;
    ``dequant``: ``native`` only, ``(1 / a.scale, 1 / b.scale)`` computed ahead (else here)."""
    if gemm == "native":
        a_inv, b_inv = dequant if dequant is not None else (a.scale.reciprocal(), b.scale.reciprocal())
        y = torch._scaled_mm(a.data, b.data.t(), a_inv, b_inv.view(1, -1), out_dtype=dtype,
                             use_fast_accum=fast)
        return y if accumulate_into is None else accumulate_into.add_(y)
    return fp8_grouped_mm(a, _one_group(b), rows, dtype, gemm, fast, accumulate_into)


class _FP8LinearsFn(torch.autograd.Function):
    """``y_i = x @ w_i^T`` for one or more ``FP8Linear`` layers of one recipe, GEMM and fast
    accumulation that share the input ``x`` (one layer's forward, or attention's q, k and v
    through ``FP8Linear.shared_input_forward``): ``x`` is quantized once for all, and the
    input gradient ``sum_i dy_i @ w_i`` adds up in the GEMMs (the Triton GEMM's epilogue)
    instead of separate ``[M, K]`` results that autograd adds afterwards. ``grad_rows``:
    where one layer's ``dy`` may arrive already quantized (module notes)."""

    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, layers: tuple[FP8Linear, ...], dtype: torch.dtype,
                routes: tuple[SinkRoute | None, ...], grad_rows: RowCodes | None,
                *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first = layers[0]
        r, fast = first.recipe, "output" in first.fast_accum
        # the one group's end, which the grouped GEMMs (and FP8 weight gradients) read
        rows = (torch.full((1,), x_MK.shape[0], dtype=torch.int32, device=x_MK.device)
                if first.gemm != "native" or r.fp8_wgrad
                or (len(layers) > 1 and _adds_in_triton(first.gemm, x_MK.device)) else None)
        x_q = quantize_fp8(x_MK, r.act_block, r.pow2)
        caches = [layer.weight_cache for layer in layers]
        # the native GEMM's dequant factors: the weights' held by their caches (layers built
        # on it), the input's made once for every layer
        held = first.gemm == "native" and all(c.rows_dequant is not None for c in caches)
        x_inv = x_q.scale.reciprocal() if held else None
        ys = tuple(_mm(x_q, c.rows, rows, first.gemm, dtype, fast, None,
                       (x_inv, c.rows_dequant) if held else None) for c in caches)
        ctx.save_for_backward(x_MK, rows)
        # The backward uses the weight copies this forward saw, whatever happens in between.
        ctx.layers, ctx.dtype, ctx.routes, ctx.grad_rows = layers, dtype, routes, grad_rows
        ctx.w_cols = tuple(c.cols for c in caches)
        ctx.w_cols_inv = tuple(c.cols_dequant if held else None for c in caches)
        ctx.weight_gradients = tuple(None if r.fp8_wgrad else layer.dense_weight_gradient
                                     for layer in layers)
        return ys

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        first, dtype = ctx.layers[0], ctx.dtype
        r, fast = first.recipe, first.fast_accum
        x_MK, rows = ctx.saved_tensors
        dx = None
        grads: list[torch.Tensor | None] = []
        for i, dy_MN in enumerate(dys):
            if dy_MN is None:
                grads.append(None)
                continue
            dy_MN = dy_MN.to(dtype).contiguous()  # e.g. the expanded gradient of a sum
            if ctx.needs_input_grad[0]:
                # (assigned first, so the previous output's codes are gone before these are made)
                dy_q = None if ctx.grad_rows is None else ctx.grad_rows.take(dy_MN)
                if dy_q is None:
                    dy_q = quantize_fp8(dy_MN, r.act_block, r.pow2)
                gemm = _input_gradient_gemm(first.gemm, dx)
                w_inv = ctx.w_cols_inv[i] if gemm == "native" else None
                dx = _mm(dy_q, ctx.w_cols[i], rows, gemm, dtype, "grad_input" in fast, dx,
                         None if w_inv is None else (dy_q.scale.reciprocal(), w_inv))
            grads.append(_weight_gradient(ctx, i, x_MK, dy_MN, rows))
        return dx, None, None, None, None, *grads


def _adds_in_triton(gemm: str, device: torch.device) -> bool:
    """Whether the input-gradient GEMMs that add into an earlier one's result leave ``gemm``
    for the Triton GEMM: ``native`` where the package's kernels run (module notes)."""
    return gemm == "native" and _triton_support.fused_kernels_enabled(device)


def _input_gradient_gemm(gemm: str, dx: torch.Tensor | None) -> str:
    """The GEMM of an input gradient that adds into ``dx`` (``None``: the first)."""
    return "triton" if dx is not None and _adds_in_triton(gemm, dx.device) else gemm


def _weight_gradient(ctx: Any, i: int, x_MK: torch.Tensor, dy_MN: torch.Tensor,
                     rows: torch.Tensor | None) -> torch.Tensor | None:
    """Layer ``i``'s weight gradient, returned through autograd or handed to its sink
    (module notes); computed where autograd wants it back, or where the sink takes it in a
    backward that runs the weight's node (not a pipeline's input pass)."""
    layer, route = ctx.layers[i], ctx.routes[i]
    if (not computes_now(route, ctx.needs_input_grad[5 + i])
            or hand_over(route, layer.weight, ctx.weight_gradients[i], x_MK, dy_MN)):
        return None
    r = layer.recipe
    if r.fp8_wgrad:
        dw = fp8_grouped_wgrad(dy_MN, x_MK, rows, r.pow2, ctx.dtype, layer.gemm,
                               "grad_weight" in layer.fast_accum, r.blockwise)[0]
    else:
        dw = dy_MN.t() @ x_MK
    return give(route, layer.weight, dw)


def _linears(x: torch.Tensor, layers: tuple[FP8Linear, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` through one ``_FP8LinearsFn``; the layers share
    one recipe, GEMM and fast accumulation (``FP8Linear.shared_input_forward`` checks)."""
    first = layers[0]
    for layer in layers:
        if x.shape[-1] != layer.in_features:
            raise ValueError(f"FP8Linear expects inputs [..., {layer.in_features}], got {tuple(x.shape)}")
        layer.weight_cache.check_fresh(type(layer).__name__, (layer.weight,))
    dtype = compute_dtype(x)
    check_gemm_runs(type(first).__name__, first.gemm, x, dtype)
    routes = tuple(sink_route(layer.grad_sink, layer.weight) for layer in layers)
    # one layer of a rowwise recipe whose input gradient will be computed: its dy may come
    # quantized by whatever computes it (module notes)
    grad_rows = (RowCodes(first.recipe.pow2)
                 if len(layers) == 1 and first.recipe.act_block == (1, 0) and torch.is_grad_enabled()
                 and x.requires_grad else None)
    with torch.autocast(x.device.type, enabled=False):
        ys = _FP8LinearsFn.apply(x.reshape(-1, first.in_features).to(dtype), layers, dtype, routes,
                                 grad_rows, *(layer.weight for layer in layers))
        ys = tuple(y if layer.bias is None else y + layer.bias.to(dtype)
                   for y, layer in zip(ys, layers, strict=True))
    outs = tuple(y.view(*x.shape[:-1], layer.out_features) for y, layer in zip(ys, layers, strict=True))
    if grad_rows is not None:
        setattr(outs[0], GRADIENT_ROW_ENCODER, grad_rows)
    return outs


class FP8Linear(nn.Module):
    """A linear layer on FP8 GEMMs (a recipe of ``FP8_RECIPES``; module notes); holds the
    same ``weight``/``bias``."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None,
                 recipe: str = "fp8_rowwise", gemm: str = "emulated",
                 fast_accum: tuple[str, ...] = FAST_ACCUM_DEFAULT) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"FP8Linear weight must be 2-D [out, in], got {tuple(weight.shape)}")
        self.fast_accum = check_layer_choices(recipe, gemm, fast_accum)
        if gemm == "native":
            check_native_widths(*weight.shape)
        self.out_features, self.in_features = weight.shape
        self.weight, self.bias = weight, bias
        self.recipe_name, self.recipe, self.gemm = recipe, FP8_RECIPES[recipe], gemm
        self.weight_cache = FP8WeightCache((weight,), self.recipe, dequant_scales=gemm == "native")
        self.grad_sink: Any = None  # a GradientSink, see the module docstring
        self.dense_weight_gradient: DenseWeightGradientMaker | None = None  # module docstring

    @classmethod
    def from_module(cls, linear: nn.Linear, recipe: str = "fp8_rowwise", gemm: str = "emulated",
                    fast_accum: tuple[str, ...] = FAST_ACCUM_DEFAULT) -> FP8Linear:
        """Wrap an ``nn.Linear``'s own parameters (same objects, same names) and its
        ``grad_sink``, where it has one."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.weight, linear.bias, recipe, gemm, fast_accum)
        carry_grad_sink(linear, layer)
        return layer

    def refresh_weight_cache(self, in_place: bool = False) -> None:
        """Re-derive the FP8 weight copies; call after every weight update
        (``in_place``: see ``WeightCache.refresh``)."""
        self.weight_cache.refresh((self.weight,), in_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linears(x, (self,))[0]

    @staticmethod
    def shared_input_forward(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        """``tuple(layer(x) for layer in layers)``, the way ``moe_model.linear.
        shared_input_linears`` calls it for attention's q, k and v: where every layer is an
        ``FP8Linear`` of one recipe, GEMM and fast accumulation, ``x`` is quantized once and
        the input gradient adds up in the GEMMs (``_FP8LinearsFn``); otherwise each layer
        is called. At ``bench-1gpu``'s shapes this saves two quantisations of ``x`` and two
        adds of ``[8192, 2048]`` per layer and microbatch."""
        first = layers[0]
        same = all(isinstance(layer, FP8Linear) and (layer.recipe_name, layer.gemm, layer.fast_accum)
                   == (first.recipe_name, first.gemm, first.fast_accum) for layer in layers)
        if not same:
            return tuple(layer(x) for layer in layers)
        return _linears(x, tuple(layers))

    def extra_repr(self) -> str:
        fast = ",".join(sorted(self.fast_accum)) or "none"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe_name}, gemm={self.gemm}, "
                f"fast_accum={fast}")
