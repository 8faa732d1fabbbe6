"""Dense linear layers whose weight gradient may go straight into a gradient sink.

``Linear`` is ``nn.Linear`` (same parameters, names, initialisation and forward) with a
``grad_sink`` slot that ``moe_model.wire_model`` fills. With a sink that accepts
the weight (a data-parallel wrapper's FP32 main grads), on CUDA, without a bias and
outside autocast, the backward adds ``dy^T @ x`` to the sink's FP32 target in one cuBLAS
GEMM with FP32 output and beta = 1 (``torch.addmm(..., out_dtype=torch.float32)``)
instead of returning a BF16 ``[out, in]`` gradient that the wrapper's hook re-reads and
adds at copy speed once per microbatch: 4 bytes per weight element fewer per microbatch,
one launch and one hook fewer per weight, and the gradient rounded once (FP32) instead of
first to BF16. Measured on an H200 at ``bench-1gpu``'s shapes (8192 tokens), ms per
microbatch, GEMM with FP32 add / BF16 GEMM then the hook's add: LM head 4.64 / 4.98,
2048 x 2048 projection 0.109 / 0.120, 512 x 2048 projection 0.033 / 0.041.

Layers sharing one input (attention's q, k and v projections; a SwiGLU's gate and up)
go through ``shared_input_linears``: one autograd node for all, whose input gradient is
added up inside the GEMMs (beta 1) rather than from separate results.

Elsewhere (CPU, another sink-less run) it is ``nn.Linear`` exactly. The CPU path of
``dense_grad_accumulate_`` exists so that the same routing is testable without a GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_model.backward_needs import grads_needed
from moe_model.sink import GradientSink, SinkRoute, accumulator_layout, sink_route, will_run


def _addmm_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a @ b`` with ``out`` FP32 and one rounding where the device allows it."""
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, out=out)
    elif out.is_cuda:  # cuBLAS: 16-bit operands, FP32 accumulation, C read and written in FP32
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # no mixed-dtype GEMM on CPU: the product in the operands' dtype, then the add
        out.add_(torch.mm(a, b))


def dense_grad_accumulate_(target: torch.Tensor, x_TI: torch.Tensor, dy_TO: torch.Tensor) -> None:
    """``target += dy^T @ x``: the weight gradient of ``y = x @ w^T`` (``w`` of shape
    ``[O, I]``) added to an FP32 accumulator holding ``w``'s elements in storage order,
    flat or as ``[G, piece]`` rows of an owner-major bucket (``sink.accumulator_layout``).

    Where each piece holds whole rows of ``w`` (a bucket split over ``G`` owners with
    ``G`` dividing ``O``: the usual case) it is one GEMM per piece straight into the
    target; otherwise the FP32 gradient is formed once and added piece by piece.
    """
    rows_in, n_in = x_TI.shape
    n_out = dy_TO.shape[1]
    if dy_TO.shape[0] != rows_in:
        raise ValueError(f"dense_grad_accumulate_: x {tuple(x_TI.shape)} and dy {tuple(dy_TO.shape)} "
                         "have different numbers of rows")
    piece, _ = accumulator_layout(target, n_out * n_in, "dense_grad_accumulate_")
    pieces = target.view(1, -1) if target.dim() == 1 else target
    if piece % n_in == 0:
        rows = piece // n_in  # of the weight, per piece
        for g, out in enumerate(pieces):
            _addmm_(out.view(rows, n_in), dy_TO[:, g * rows:(g + 1) * rows].t(), x_TI)
        return
    dw = torch.zeros(n_out, n_in, dtype=target.dtype, device=target.device)
    _addmm_(dw, dy_TO.t(), x_TI)
    pieces.add_(dw.view(pieces.shape))


class DenseWeightGradient:
    """A dense layer's weight gradient not computed yet: its input rows and output
    gradient rows. Calling it adds the gradient to an FP32 target (``dense_grad_accumulate_``)."""

    def __init__(self, x_TI: torch.Tensor, dy_TO: torch.Tensor) -> None:
        self.x, self.dy = x_TI, dy_TO

    def __call__(self, target: torch.Tensor) -> None:
        dense_grad_accumulate_(target, self.x, self.dy)


class _LinearsIntoSink(torch.autograd.Function):
    """``y_i = x @ w_i^T`` for one or more weights sharing the input ``x`` (attention's q, k
    and v projections; a SwiGLU's gate and up). Each weight's gradient goes into its sink
    (in a backward that runs the weight's ``AccumulateGrad`` node). The input gradient
    (in a backward that runs the input's node: a split backward runs each GEMM once) is
    one GEMM and, for each further weight, a GEMM adding into it (beta 1) instead of
    separate ``[T, in]`` results that autograd adds afterwards: for q, k and v at
    bench-1gpu's shapes on an H200, 158 us against 205 per microbatch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, routes: tuple[SinkRoute, ...], *weights: nn.Parameter,
                ) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x, *weights)
        ctx.routes, ctx.params = routes, weights
        return tuple(F.linear(x, w) for w in weights)

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        # forward's tensor inputs: x (input 0) and the weights (inputs 2, 3, ...)
        need = grads_needed(ctx, (0, *range(2, 2 + len(weights))))
        x_TI = x.reshape(-1, x.shape[-1])
        dx = None
        for dy, w in zip(dys, weights, strict=True):
            if dy is None or not need[0]:
                continue
            dy_TO = dy.reshape(-1, w.shape[0])
            if dx is None:
                dx = dy_TO @ w
            else:
                dx.addmm_(dy_TO, w)
        for i, (dy, route) in enumerate(zip(dys, ctx.routes, strict=True)):
            if dy is not None and need[2 + i] and will_run(route):
                route[0].add_gradient(ctx.params[i], DenseWeightGradient(x_TI, dy.reshape(-1, weights[i].shape[0])))
        return (None if dx is None else dx.view(x.shape), None, *(None for _ in weights))


def sink_takes_dense(x: torch.Tensor) -> bool:
    """Whether a dense layer's weight gradient for input ``x`` can go into a sink: on CUDA
    (cuBLAS's FP32-output GEMM) and outside autocast (the layer's dtype is its weight's)."""
    return x.is_cuda and not torch.is_autocast_enabled(x.device.type)


class Linear(nn.Linear):
    """``nn.Linear`` whose weight gradient goes into ``grad_sink`` when one is installed
    and accepts it (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.grad_sink: GradientSink | None = None

    def sink_route(self, x: torch.Tensor) -> SinkRoute | None:
        """Where this layer's weight gradient for input ``x`` goes, or ``None``: autograd's path."""
        # (an input of another dtype than the weight's fails in F.linear on either path)
        if self.grad_sink is None or self.bias is not None or not sink_takes_dense(x):
            return None
        return sink_route(self.grad_sink, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.sink_route(x)
        if route is None:
            return super().forward(x)
        return _LinearsIntoSink.apply(x, (route,), self.weight)[0]


def shared_input_linears(x: torch.Tensor, layers: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)``; when every layer is a ``Linear`` whose weight
    gradient goes into a sink, in one autograd node whose input gradient adds the layers'
    into one tensor (``_LinearsIntoSink``). Layers of another class that has a
    ``shared_input_forward(x, layers)`` (e.g. moe_mxfp8's ``FP8Linear``, which quantizes
    ``x`` once for all) go through it when the first layer's class has one; other modules
    are simply called."""
    shared = getattr(type(layers[0]), "shared_input_forward", None)
    if shared is not None and not isinstance(layers[0], Linear):
        return tuple(shared(x, layers))
    routes = tuple(layer.sink_route(x) if isinstance(layer, Linear) else None for layer in layers)
    if any(route is None for route in routes):
        return tuple(layer(x) for layer in layers)
    return _LinearsIntoSink.apply(x, routes, *(layer.weight for layer in layers))
