"""MXFP8GroupedExperts: routed SwiGLU experts whose grouped GEMMs read MXFP8 operands.

Shape legend: R dispatched rows (expert-major), E local experts, D d_model,
F expert hidden, 2F gate and up side by side.
Weights, as in the model they replace: ``w1 [E,F,D]`` (gate), ``w3 [E,F,D]`` (up),
``w2 [E,D,F]`` (down); ``forward(rows[R,D], group_offsets[E] int32 cumulative ends)``.

Per layer, with every GEMM accumulating in FP32:
- forward: ``h13 = rows @ w13^T`` (one grouped GEMM for gate and up; ``w13`` is
  ``cat(w1, w3)`` along F, a cache layout only), ``h = silu(h1) * h3``,
  ``y = h @ w2^T``; ``rows`` and ``h`` quantized along their reduction dim (D, F),
  the weights from the caches' ``rows`` orientation.
- input gradients: ``dh = dy @ w2`` and ``drows = dh13 @ w13`` with ``dy``/``dh13``
  quantized along D/2F and the weights from the caches' ``cols`` orientation.
- weight gradients ``dw = dy^T @ x`` per expert in the compute dtype (not quantized).

Weight gradients into a sink, as ``FP8GroupedExperts``' (``moe_mxfp8.fp8_experts``): with a
``grad_sink`` that accepts a weight, in a backward that runs the weight's ``AccumulateGrad``
node, the gradient is added to the sink's FP32 accumulator and ``param.grad`` stays
``None``; with ``weight_gradient`` set as well (the model's wiring sets moe_model's
``ExpertWeightGradient.from_rows`` on CUDA) the sink gets that maker's add of the GEMM's
operands instead of a computed gradient: rows and the gate or up half of ``dh13``, ``h``
and ``dy``. Unset (the default; this package stands alone), autograd gets the gradients.

``save_mxfp8_activations`` keeps the tensors saved for backward in MXFP8: ``rows``
and ``h`` in the form the forward GEMMs already used, and the SwiGLU input ``h13``
quantized once more; otherwise ``rows`` and ``h13`` are kept in the compute dtype
and ``h`` is recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from moe_mxfp8.cache import MXFP8WeightCache, WeightCache
from moe_mxfp8.format import MXFP8Tensor, quantize, quantize_dequantize
from moe_mxfp8.gemm import carrier_dtype, compute_dtype, grouped_mm, grouped_weight_grad
from moe_mxfp8.sink import SinkRoute, carry_grad_sink, computes_now, deliver, hand_over, sink_route
from moe_mxfp8.swiglu import swiglu, swiglu_backward

_CARRIED_ATTRS = (bool, int, float, str, type(None))
LayerT = TypeVar("LayerT", bound=nn.Module)

# (x_RK, dy_RN, offsets_E, like_EKN) -> a sink's add of ``x_e^T @ dy_e`` (module notes)
WeightGradientMaker = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                               Callable[[torch.Tensor], None]]


def expert_weights(experts: nn.Module) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """A grouped-experts module's own ``w1``, ``w3``, ``w2`` (matched by structure)."""
    params = dict(experts.named_parameters(recurse=False))
    missing = [n for n in ("w1", "w3", "w2") if n not in params]
    if missing:
        raise TypeError(
            f"{type(experts).__name__} has no parameter(s) {missing}; expected w1, w3, w2"
        )
    return params["w1"], params["w3"], params["w2"]


def take_over(source: nn.Module, layer: LayerT) -> LayerT:
    """``layer``, built on ``source``'s own weights, given ``source``'s public plain
    attributes (e.g. the expert range) and its ``grad_sink``, so code reading them keeps
    working."""
    for name, value in vars(source).items():
        if not name.startswith("_") and name != "training" and isinstance(value, _CARRIED_ATTRS):
            setattr(layer, name, value)
    carry_grad_sink(source, layer)
    return layer


class CachedGroupedExperts(nn.Module):
    """Grouped SwiGLU experts whose GEMMs read low-precision copies of ``w1``/``w3``
    (``w13_cache``) and ``w2`` (``w2_cache``), derived from the weights once per update."""

    w13_cache: WeightCache
    w2_cache: WeightCache

    def refresh_weight_cache(self, in_place: bool = False) -> None:
        """Re-derive the weight copies; call after every weight update (``in_place``: see
        ``WeightCache.refresh``)."""
        self.w13_cache.refresh((self.w1, self.w3), in_place)
        self.w2_cache.refresh((self.w2,), in_place)


def check_expert_rows(module: nn.Module, rows_RD: torch.Tensor, group_offsets: torch.Tensor) -> None:
    """Refuse rows that are not ``[R, D]`` or offsets that are not int32 ``[E]`` for the
    module's ``w1 [E, F, D]``, and weight caches older than the weights."""
    E, D = module.w1.shape[0], module.w1.shape[-1]
    if rows_RD.dim() != 2 or rows_RD.shape[1] != D:
        raise ValueError(f"rows must be [R, {D}], got {tuple(rows_RD.shape)}")
    if group_offsets.shape != (E,) or group_offsets.dtype != torch.int32:
        raise ValueError(
            f"group_offsets must be int32 [{E}], got {group_offsets.dtype} "
            f"{tuple(group_offsets.shape)}"
        )
    name = type(module).__name__
    module.w13_cache.check_fresh(name, (module.w1, module.w3))
    module.w2_cache.check_fresh(name, (module.w2,))


def expert_weight_gradients(
    ctx: Any, wanted: list[bool], rows_RD: torch.Tensor, dh13_R2F: torch.Tensor,
    h_RF: torch.Tensor | None, dy_RD: torch.Tensor, offsets_E: torch.Tensor,
    wgrad: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor | None]:
    """The gradients of ``ctx.params`` (w1, w3, w2) a SwiGLU experts' backward computes:
    each weight ``wanted`` goes to its sink as a maker's add of its GEMM's operands where
    it can (``hand_over_expert_gradient``; ``wanted`` is then cleared), else it is
    computed by ``wgrad(dy_RN, x_RK) -> [E, N, K]`` (gate and up in one call over dh13).
    ``deliver`` takes the result and ``wanted`` from here."""
    hidden = dh13_R2F.shape[1] // 2
    grads: list[torch.Tensor | None] = [None, None, None]
    for i in (0, 1):  # gate, up: the halves of dh13
        if wanted[i] and hand_over_expert_gradient(ctx, i, rows_RD,
                                                   dh13_R2F[:, i * hidden:(i + 1) * hidden], offsets_E):
            wanted[i] = False
    if wanted[0] or wanted[1]:
        dw13 = wgrad(dh13_R2F, rows_RD)
        grads[0], grads[1] = dw13[:, :hidden], dw13[:, hidden:]
    if wanted[2]:  # then h_RF is there: the backward makes it for this gradient
        if hand_over_expert_gradient(ctx, 2, h_RF, dy_RD, offsets_E):
            wanted[2] = False
        else:
            grads[2] = wgrad(dy_RD, h_RF)
    return grads


def hand_over_expert_gradient(ctx: Any, i: int, x_RK: torch.Tensor, dy_RN: torch.Tensor,
                              offsets_E: torch.Tensor) -> bool:
    """Hand expert weight ``ctx.params[i]``'s gradient ``x_e^T @ dy_e`` to its sink as the
    add ``ctx.weight_gradient`` makes of the operands (module notes); False, with nothing
    handed, where the weight is not the sink's (``ctx.routes[i]``) or no maker is set."""
    param = ctx.params[i]
    return hand_over(ctx.routes[i], param, ctx.weight_gradient, x_RK, dy_RN, offsets_E,
                     param.detach().transpose(1, 2))


class _MXFP8ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows_RD: torch.Tensor, offsets_E: torch.Tensor, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, layer: MXFP8GroupedExperts,
                dtype: torch.dtype, routes: tuple[SinkRoute | None, ...]) -> torch.Tensor:
        carrier = carrier_dtype(dtype)
        keep = layer.save_mxfp8_activations
        w13, w2c = layer.w13_cache, layer.w2_cache
        rows_deq, rows_mx = quantize_dequantize(rows_RD, carrier, keep_mxfp8=keep)
        h13_R2F = grouped_mm(rows_deq, w13.rows.dequantize(carrier).transpose(-2, -1),
                             offsets_E).to(dtype)
        h_RF = swiglu(h13_R2F)
        h_deq, h_mx = quantize_dequantize(h_RF, carrier, keep_mxfp8=keep)
        y_RD = grouped_mm(h_deq, w2c.rows.dequantize(carrier).transpose(-2, -1), offsets_E)
        if keep:
            h13_mx = MXFP8Tensor(*quantize(h13_R2F), axis=1)
            saved = (rows_mx, h13_mx, h_mx)
            ctx.save_for_backward(offsets_E, *(t for mx in saved for t in (mx.data, mx.scales)))
        else:
            ctx.save_for_backward(offsets_E, rows_RD, h13_R2F)
        # The backward uses the weight copies this forward saw, whatever happens in between.
        ctx.w13_cols, ctx.w2_cols = w13.cols, w2c.cols
        ctx.keep, ctx.dtype, ctx.routes = keep, dtype, routes
        ctx.params, ctx.weight_gradient = (w1, w3, w2), layer.weight_gradient
        return y_RD.to(dtype)

    @staticmethod
    def backward(ctx: Any, dy_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dtype = ctx.dtype
        carrier = carrier_dtype(dtype)
        offsets_E, *saved = ctx.saved_tensors
        # a weight's gradient is computed where autograd wants it back, or where its sink
        # takes it in a backward that runs the weight's node (not a pipeline's input pass)
        wanted = [computes_now(route, ctx.needs_input_grad[2 + i]) for i, route in enumerate(ctx.routes)]
        if ctx.keep:
            rows_RD, h13_R2F, h_RF = (MXFP8Tensor(saved[i], saved[i + 1], axis=1).dequantize(dtype)
                                      for i in (0, 2, 4))
        else:
            rows_RD, h13_R2F = saved
            h_RF = swiglu(h13_R2F) if wanted[2] else None  # w2's gradient reads it
        dy_RD = dy_RD.to(dtype).contiguous()  # e.g. the expanded gradient of a sum
        dy_deq, _ = quantize_dequantize(dy_RD, carrier)
        dh_RF = grouped_mm(dy_deq, ctx.w2_cols.dequantize(carrier), offsets_E)
        dh13_R2F = swiglu_backward(h13_R2F, dh_RF, dtype)
        drows = None
        if ctx.needs_input_grad[0]:
            dh13_deq, _ = quantize_dequantize(dh13_R2F, carrier)
            drows = grouped_mm(dh13_deq, ctx.w13_cols.dequantize(carrier), offsets_E).to(dtype)
        grads = expert_weight_gradients(ctx, wanted, rows_RD, dh13_R2F, h_RF, dy_RD, offsets_E,
                                        lambda dy, x: grouped_weight_grad(dy, x, offsets_E))
        return drows, None, *deliver(ctx.params, grads, ctx.routes, wanted), None, None, None


class MXFP8GroupedExperts(CachedGroupedExperts):
    """Grouped SwiGLU experts on MXFP8 GEMMs, holding the given ``w1``/``w3``/``w2``."""

    def __init__(self, w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter,
                 save_mxfp8_activations: bool = False) -> None:
        super().__init__()
        if w1.dim() != 3 or w1.shape != w3.shape:
            raise ValueError(
                f"w1 and w3 must both be [E, F, D], got {tuple(w1.shape)} and {tuple(w3.shape)}"
            )
        E, F_, D = w1.shape
        if tuple(w2.shape) != (E, D, F_):
            raise ValueError(f"w2 must be [E, D, F] = {(E, D, F_)}, got {tuple(w2.shape)}")
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.save_mxfp8_activations = save_mxfp8_activations
        self.grad_sink: Any = None  # a GradientSink, see the module docstring
        self.weight_gradient: WeightGradientMaker | None = None  # see the module docstring
        self.w13_cache = MXFP8WeightCache((w1, w3))
        self.w2_cache = MXFP8WeightCache((w2,))

    @classmethod
    def from_module(cls, experts: nn.Module,
                    save_mxfp8_activations: bool = False) -> MXFP8GroupedExperts:
        """Take over a grouped-experts module's own ``w1``/``w3``/``w2`` parameters.

        Any module with those three parameters qualifies (matched by structure, no
        import of the model package). Its public plain attributes (e.g. the expert
        range ``expert_start``/``n_local``) and its ``grad_sink`` are carried over so code
        reading them keeps working. Narrow expert ranges before converting.
        """
        return take_over(experts, cls(*expert_weights(experts), save_mxfp8_activations))

    def forward(self, rows_RD: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        check_expert_rows(self, rows_RD, group_offsets)
        dtype = compute_dtype(rows_RD)
        routes = tuple(sink_route(self.grad_sink, w) for w in (self.w1, self.w3, self.w2))
        with torch.autocast(rows_RD.device.type, enabled=False):
            return _MXFP8ExpertsFn.apply(rows_RD.to(dtype), group_offsets, self.w1, self.w3,
                                         self.w2, self, dtype, routes)

    def extra_repr(self) -> str:
        E, F_, D = self.w1.shape
        return (f"experts={E}, d_model={D}, hidden={F_}, "
                f"save_mxfp8_activations={self.save_mxfp8_activations}")
