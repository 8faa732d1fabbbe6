"""This package's side of the gradient-sink protocol (``moe_model.sink`` defines it).

A data-parallel wrapper that keeps FP32 main grads can take a weight's gradient as a
callable that adds it there, instead of a ``param.grad`` that its hook re-reads and
adds. The layers here meet such a sink only through its two methods, ``accepts(param)``
and ``add_gradient(param, add)``, so the package imports nothing of the trainer's.

A route is taken only in a backward that runs the weight's ``AccumulateGrad`` node
(:func:`will_run`): a pipeline's input-gradient pass does not, its weight pass does, so
each gradient lands exactly once however the backward is split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

SinkRoute = tuple[Any, Any]  # (the sink, the weight's AccumulateGrad node)


def sink_route(sink: Any, w: nn.Parameter) -> SinkRoute | None:
    """Where ``w``'s gradient goes into ``sink``: it accepts ``w`` and a backward may run."""
    if sink is None or not w.requires_grad or not torch.is_grad_enabled() or not sink.accepts(w):
        return None
    return sink, get_gradient_edge(w).node


def will_run(route: SinkRoute) -> bool:
    """Whether the backward now running runs the weight's ``AccumulateGrad`` node."""
    return torch._C._will_engine_execute_node(route[1])


def carry_grad_sink(source: nn.Module, layer: nn.Module) -> None:
    """Give a converted layer the ``grad_sink`` of the module it replaces, where it has one."""
    layer.grad_sink = getattr(source, "grad_sink", None)


def computes_now(route: SinkRoute | None, needs_grad: bool) -> bool:
    """Whether a weight's gradient is wanted from the backward now running: autograd asks
    for it and, where a sink takes it, this backward runs the weight's node (a pipeline's
    input pass does not; its weight pass does)."""
    return needs_grad and (route is None or will_run(route))


def hand_over(route: SinkRoute | None, param: nn.Parameter, maker: Callable[..., Any] | None,
              *operands: torch.Tensor) -> bool:
    """Hand ``param``'s gradient to its sink as ``maker(*operands)``: an add built from the
    GEMM's operands that runs when the sink calls it (a kernel adding into the FP32 target
    in its epilogue). False, with nothing handed, without a route or a maker."""
    if route is None or maker is None:
        return False
    route[0].add_gradient(param, maker(*operands))
    return True


def give(route: SinkRoute | None, param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
    """A gradient computed here: to its sink as an add (``None`` goes back to autograd) or,
    without a route, back to autograd in the weight's dtype."""
    if route is None:
        return grad.to(param.dtype)
    route[0].add_gradient(param, AddGradient(grad))
    return None


def deliver(params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None],
            routes: Sequence[SinkRoute | None], computed: Sequence[bool]) -> list[torch.Tensor | None]:
    """``give`` for each weight whose gradient was computed here; ``None`` for the others
    (not wanted, or handed over already)."""
    return [give(route, param, grad) if done and grad is not None else None
            for param, grad, route, done in zip(params, grads, routes, computed, strict=True)]


class AddGradient:
    """Adds a computed weight gradient to a sink's FP32 accumulator (1-D, or rows of a bucket)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def __call__(self, target: torch.Tensor) -> None:
        check_target(target, self.grad.numel())
        target.add_(self.grad.reshape(target.shape))


def check_target(target: torch.Tensor, numel: int) -> None:
    """A sink's target must hold the weight's ``numel`` elements."""
    if target.numel() != numel:
        raise ValueError(f"gradient target has {target.numel()} elements, the weight {numel}")
