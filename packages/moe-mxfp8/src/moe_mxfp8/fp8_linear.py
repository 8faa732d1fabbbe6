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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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
from moe_mxfp8.sink import AddGradient, SinkRoute, sink_route, will_run

# (x_MK, dy_MN) -> a sink's add of ``dy^T @ x`` into an FP32 target (module notes)
DenseWeightGradientMaker = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], None]]


def _one_group(t: FP8Tensor) -> FP8Tensor:
    """A weight copy ``[N, K]`` as the ``[1, N, K]`` stack the grouped GEMMs take."""
    return FP8Tensor(t.data.unsqueeze(0), t.scale.unsqueeze(0), t.block)


def _mm(a: FP8Tensor, b: FP8Tensor, rows: torch.Tensor, gemm: str, dtype: torch.dtype,
        fast: bool) -> torch.Tensor:
    """``a [M, K] @ b^T`` for ``b [N, K]``, both scaled along K; ``rows``: ``[M]``, the one
    group's end, for the grouped GEMMs."""
    if gemm == "native":
        return torch._scaled_mm(a.data, b.data.t(), a.scale.reciprocal(),
                                b.scale.reciprocal().view(1, -1), out_dtype=dtype,
                                use_fast_accum=fast)
    return fp8_grouped_mm(a, _one_group(b), rows, dtype, gemm, fast)


class _FP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, weight: torch.Tensor, layer: FP8Linear,
                dtype: torch.dtype, route: SinkRoute | None) -> torch.Tensor:
        r = layer.recipe
        rows = torch.full((1,), x_MK.shape[0], dtype=torch.int32, device=x_MK.device)
        x_q = quantize_fp8(x_MK, r.act_block, r.pow2)
        y_MN = _mm(x_q, layer.weight_cache.rows, rows, layer.gemm, dtype,
                   "output" in layer.fast_accum)
        ctx.save_for_backward(x_MK, rows)
        # The backward uses the weight copy this forward saw, whatever happens in between.
        ctx.layer, ctx.dtype, ctx.w_cols, ctx.route = layer, dtype, layer.weight_cache.cols, route
        ctx.weight_gradient = None if r.fp8_wgrad else layer.dense_weight_gradient
        return y_MN

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer, dtype = ctx.layer, ctx.dtype
        r, fast = layer.recipe, layer.fast_accum
        x_MK, rows = ctx.saved_tensors
        dy_MN = dy_MN.to(dtype).contiguous()  # e.g. the expanded gradient of a sum
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q = quantize_fp8(dy_MN, r.act_block, r.pow2)
            dx = _mm(dy_q, ctx.w_cols, rows, layer.gemm, dtype, "grad_input" in fast)
        route = ctx.route
        # computed where autograd wants it back, or where the sink takes it in a backward
        # that runs the weight's node (not a pipeline's input pass)
        if ctx.needs_input_grad[1] and (route is None or will_run(route)):
            if route is not None and ctx.weight_gradient is not None:
                route[0].add_gradient(layer.weight, ctx.weight_gradient(x_MK, dy_MN))
            else:
                if r.fp8_wgrad:
                    dw = fp8_grouped_wgrad(dy_MN, x_MK, rows, r.pow2, dtype, layer.gemm,
                                           "grad_weight" in fast)[0]
                else:
                    dw = dy_MN.t() @ x_MK
                if route is None:
                    dw = dw.to(layer.weight.dtype)
                else:
                    route[0].add_gradient(layer.weight, AddGradient(dw))
                    dw = None
        return dx, dw, None, None, None


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
        self.weight_cache = FP8WeightCache((weight,), self.recipe)
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
        layer.grad_sink = getattr(linear, "grad_sink", None)
        return layer

    def refresh_weight_cache(self, in_place: bool = False) -> None:
        """Re-derive the FP8 weight copies; call after every weight update
        (``in_place``: see ``WeightCache.refresh``)."""
        self.weight_cache.refresh((self.weight,), in_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects inputs [..., {self.in_features}], got {tuple(x.shape)}")
        self.weight_cache.check_fresh(type(self).__name__, (self.weight,))
        dtype = compute_dtype(x)
        check_gemm_runs(type(self).__name__, self.gemm, x, dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = _FP8LinearFn.apply(x.reshape(-1, self.in_features).to(dtype), self.weight, self,
                                   dtype, sink_route(self.grad_sink, self.weight))
            if self.bias is not None:
                y = y + self.bias.to(dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fast = ",".join(sorted(self.fast_accum)) or "none"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe_name}, gemm={self.gemm}, "
                f"fast_accum={fast}")
