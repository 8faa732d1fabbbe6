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


class AddGradient:
    """Adds a computed weight gradient to a sink's FP32 accumulator (1-D, or rows of a bucket)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    def __call__(self, target: torch.Tensor) -> None:
        if target.numel() != self.grad.numel():
            raise ValueError(f"gradient target has {target.numel()} elements, the weight "
                             f"{self.grad.numel()}")
        target.add_(self.grad.reshape(target.shape))
