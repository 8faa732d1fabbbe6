"""MXFP8Linear: ``nn.Linear`` with MXFP8 forward and input-gradient GEMMs.

Shape legend: M rows (all leading dims flattened), K in_features, N out_features.

- forward ``y = x @ w^T``: ``x`` quantized along K, ``w`` from the cache's ``rows``.
- input gradient ``dx = dy @ w``: ``dy`` quantized along N, ``w`` from the cache's
  ``cols`` (blocked along N).
- weight gradient ``dw = dy^T @ x`` in the compute dtype (BF16 in training), not
  quantized: it feeds the optimizer directly.
All three accumulate in FP32. ``save_mxfp8_input`` keeps ``x`` for the weight
gradient in its MXFP8 form (already computed for the forward) instead of in the
compute dtype: about half the saved bytes, at the cost of a quantized ``x`` in ``dw``.

Weight gradient into a sink, as ``FP8Linear``'s (``moe_mxfp8.fp8_linear``): where
``grad_sink`` accepts the weight and the backward runs its ``AccumulateGrad`` node, the
gradient is added to the sink's FP32 accumulator and ``weight.grad`` stays ``None``; with
``dense_weight_gradient(x_MK, dy_MN)`` set as well (the model's wiring sets moe_model's
``DenseWeightGradient``), the sink gets that maker's add of the operands instead of a
computed gradient. Unset (the default; this package stands alone), autograd gets it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moe_mxfp8.cache import MXFP8WeightCache
from moe_mxfp8.format import MXFP8Tensor, quantize, quantize_dequantize
from moe_mxfp8.gemm import carrier_dtype, compute_dtype, native_mx_available, native_mx_mm
from moe_mxfp8.sink import SinkRoute, carry_grad_sink, computes_now, give, hand_over, sink_route

GEMMS = ("emulated", "native")

# (x_MK, dy_MN) -> a sink's add of ``dy^T @ x`` into an FP32 target (module notes)
DenseWeightGradientMaker = Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], None]]


class _MXFP8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK: torch.Tensor, weight: torch.Tensor, layer: MXFP8Linear,
                dtype: torch.dtype, route: SinkRoute | None) -> torch.Tensor:
        cache = layer.weight_cache
        carrier = carrier_dtype(dtype)
        if layer.gemm == "native":
            x_mx = MXFP8Tensor(*quantize(x_MK), axis=1)
            y_MN = native_mx_mm(x_mx, cache.rows, dtype)
        else:
            x_deq, x_mx = quantize_dequantize(x_MK, carrier, keep_mxfp8=layer.save_mxfp8_input)
            y_MN = (x_deq @ cache.rows.dequantize(carrier).t()).to(dtype)
        if layer.save_mxfp8_input:
            ctx.save_for_backward(x_mx.data, x_mx.scales)
        else:
            ctx.save_for_backward(x_MK)
        # The backward uses the weight copy this forward saw, whatever happens in between.
        ctx.layer, ctx.dtype, ctx.w_cols, ctx.route = layer, dtype, cache.cols, route
        ctx.weight_gradient = layer.dense_weight_gradient
        return y_MN

    @staticmethod
    def backward(ctx: Any, dy_MN: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layer, dtype, w_cols = ctx.layer, ctx.dtype, ctx.w_cols
        carrier = carrier_dtype(dtype)
        dy_MN = dy_MN.to(dtype).contiguous()  # e.g. the expanded gradient of a sum
        if layer.save_mxfp8_input:
            data, scales = ctx.saved_tensors
            x_MK = MXFP8Tensor(data, scales, axis=1).dequantize(dtype)
        else:
            (x_MK,) = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            if layer.gemm == "native":
                dy_mx = MXFP8Tensor(*quantize(dy_MN), axis=1)
                w_KN = MXFP8Tensor(w_cols.data.t().contiguous(), w_cols.scales.t().contiguous(),
                                   axis=1)
                dx = native_mx_mm(dy_mx, w_KN, dtype)
            else:
                dy_deq, _ = quantize_dequantize(dy_MN, carrier)
                dx = (dy_deq @ w_cols.dequantize(carrier)).to(dtype)
        if (computes_now(ctx.route, ctx.needs_input_grad[1])
                and not hand_over(ctx.route, layer.weight, ctx.weight_gradient, x_MK, dy_MN)):
            dw = give(ctx.route, layer.weight, dy_MN.t() @ x_MK)
        return dx, dw, None, None, None


class MXFP8Linear(nn.Module):
    """A linear layer whose GEMMs read MXFP8 operands; holds the same ``weight``/``bias``."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None = None,
                 save_mxfp8_input: bool = False, gemm: str = "emulated") -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"MXFP8Linear weight must be 2-D [out, in], got {tuple(weight.shape)}")
        if gemm not in GEMMS:
            raise ValueError(f"gemm must be one of {GEMMS}, got {gemm!r}")
        if gemm == "native":
            if not native_mx_available(weight.device):
                raise ValueError(
                    "gemm='native' needs a CUDA device of compute capability 10.x "
                    f"(block-scaled tensor cores); weight is on {weight.device}"
                )
            if weight.shape[0] % 32 or weight.shape[1] % 32:
                raise ValueError(
                    f"gemm='native' needs both weight dims divisible by 32, got {tuple(weight.shape)}"
                )
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = bias
        self.save_mxfp8_input = save_mxfp8_input
        self.gemm = gemm
        self.weight_cache = MXFP8WeightCache((weight,))
        self.grad_sink: Any = None  # a GradientSink, see the module docstring
        self.dense_weight_gradient: DenseWeightGradientMaker | None = None  # module docstring

    @classmethod
    def from_module(cls, linear: nn.Linear, save_mxfp8_input: bool = False,
                    gemm: str = "emulated") -> MXFP8Linear:
        """Wrap an ``nn.Linear``'s own parameters (same objects, same names) and its
        ``grad_sink``, where it has one."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        layer = cls(linear.weight, linear.bias, save_mxfp8_input, gemm)
        carry_grad_sink(linear, layer)
        return layer

    def refresh_weight_cache(self, in_place: bool = False) -> None:
        """Re-derive the MXFP8 weight copies; call after every weight update
        (``in_place``: see ``WeightCache.refresh``)."""
        self.weight_cache.refresh((self.weight,), in_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"MXFP8Linear expects inputs [..., {self.in_features}], got {tuple(x.shape)}"
            )
        self.weight_cache.check_fresh(type(self).__name__, (self.weight,))
        dtype = compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            y = _MXFP8LinearFn.apply(x.reshape(-1, self.in_features).to(dtype), self.weight, self,
                                     dtype, sink_route(self.grad_sink, self.weight))
            if self.bias is not None:
                y = y + self.bias.to(dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, gemm={self.gemm}, "
                f"save_mxfp8_input={self.save_mxfp8_input}")
