"""Gradient sinks: where a weight's gradient can be added directly, skipping autograd's.

A data-parallel wrapper that keeps FP32 main grads (``moe_ddp.MultiGroupDDP``) can take a
weight's gradient as a callable that adds it to the main grad, instead of a BF16
``param.grad`` that its hook re-reads and adds at copy speed once per microbatch. The
layers that produce such callables (routed experts, the untied embedding, dense linear
layers) meet the wrapper only through this protocol, so moe_model imports nothing of it.

A route is only taken in a backward pass that runs the weight's ``AccumulateGrad`` node
(``will_run``): a pipeline's input-gradient pass does not, its weight pass does, so the
gradient lands exactly once whatever way the backward is split.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge


@runtime_checkable
class GradientSink(Protocol):
    """Where a parameter's gradient can be added directly (a data-parallel wrapper's main grads)."""

    def accepts(self, param: nn.Parameter) -> bool:
        """Whether ``add_gradient`` takes this parameter's gradient."""
        ...

    def add_gradient(self, param: nn.Parameter, add: Callable[[torch.Tensor], None]) -> None:
        """Call ``add(target)`` once, ``target`` the FP32 accumulator of ``param``'s gradient
        (its elements in storage order: 1-D, or ``[rows, cols]`` with contiguous rows), then
        count the gradient as arrived (what a post-accumulate-grad hook would do).

        ``add`` may have ``merged(next_add)`` (a routed expert weight's
        ``ExpertWeightGradient``): a sink may then hold it and call ``add.merged(next_add)``
        when the parameter's next gradient comes (one launch for both), as long as every
        gradient is added before it is read. Others (the untied embedding's
        ``EmbeddingGradient``, a dense layer's ``DenseWeightGradient``) have no ``merged``
        and are added at once."""
        ...


SinkRoute = tuple[GradientSink, Any]  # the sink and the weight's AccumulateGrad node


def sink_route(sink: GradientSink | None, w: nn.Parameter) -> SinkRoute | None:
    """Where ``w``'s gradient goes into ``sink``: the sink accepts it and a backward may run."""
    if sink is None or not w.requires_grad or not torch.is_grad_enabled() or not sink.accepts(w):
        return None
    return sink, get_gradient_edge(w).node


def will_run(route: SinkRoute) -> bool:
    """Whether the backward now running runs the weight's ``AccumulateGrad`` node: only then
    does the gradient go into the sink (see the module docstring)."""
    return torch._C._will_engine_execute_node(route[1])


def accumulator_layout(target: torch.Tensor, numel: int, what: str) -> tuple[int, int]:
    """``(piece, stride)`` of an FP32 gradient accumulator (a ``GradientSink``'s target) for a
    parameter of ``numel`` elements: element ``i`` lives at ``(i // piece) * stride + i %
    piece`` (flat: one piece; an owner-major bucket: rows of ``piece`` elements). Raises,
    naming ``what``, on a target of another dtype, size or layout."""
    if target.dtype != torch.float32:
        raise ValueError(f"{what}: target must be float32, got {target.dtype}")
    if target.numel() != numel:
        raise ValueError(f"{what}: target has {target.numel()} elements, the weight {numel}")
    if target.dim() not in (1, 2) or target.stride(-1) != 1:
        raise ValueError(f"{what}: target must be 1-D contiguous or 2-D with contiguous rows, "
                         f"got shape {tuple(target.shape)} strides {target.stride()}")
    return (target.numel(), 0) if target.dim() == 1 else (target.shape[1], target.stride(0))


class MergingSink:
    """A ``GradientSink`` for a module called ``uses`` times in one forward (token chunks of
    an expert-parallel pipeline): it holds each parameter's gradients until all ``uses``
    have come, then hands ``sink`` one gradient, merged (``add.merged``) as far as the
    adds allow and otherwise adding each in turn.

    A sink such as moe_ddp's counts a parameter's gradient as arrived at its first
    delivery with synchronisation on (its bucket may then be reduced), so a weight used
    ``n`` times in the step's last backward must arrive once, not ``n`` times. The sink
    is captured by each use in the forward, so the caller installs this one on the module
    around each use and counts the calls into ``uses`` (a backward that runs
    the weight's ``AccumulateGrad`` node delivers every use's gradient; others none).
    """

    def __init__(self, sink: GradientSink) -> None:
        self.sink = sink
        self.uses = 0
        self._held: dict[int, list[Callable[[torch.Tensor], None]]] = {}

    def accepts(self, param: nn.Parameter) -> bool:
        return self.sink.accepts(param)

    def add_gradient(self, param: nn.Parameter, add: Callable[[torch.Tensor], None]) -> None:
        held = self._held.setdefault(id(param), [])
        held.append(add)
        if len(held) < self.uses:
            return
        del self._held[id(param)]
        self.sink.add_gradient(param, _merged(held))


def _merged(adds: list[Callable[[torch.Tensor], None]]) -> Callable[[torch.Tensor], None]:
    """One add for ``adds``: consecutive ones merged while ``merged`` takes them."""
    pieces = [adds[0]]
    for add in adds[1:]:
        merge = getattr(pieces[-1], "merged", None)
        joined = merge(add) if merge is not None else None
        if joined is None:
            pieces.append(add)
        else:
            pieces[-1] = joined
    return pieces[0] if len(pieces) == 1 else _AddEach(pieces)


class _AddEach:
    """Adds that share no launch, added one after another (not mergeable any further)."""

    def __init__(self, adds: list[Callable[[torch.Tensor], None]]) -> None:
        self.adds = adds

    def __call__(self, target: torch.Tensor) -> None:
        for add in self.adds:
            add(target)
