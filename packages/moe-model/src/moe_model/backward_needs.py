"""Which input gradients the backward now running uses: what a custom autograd Function computes.

``ctx.needs_input_grad`` is fixed at forward time: whether each input requires grad. A
backward that runs toward part of the graph only (``torch.autograd.grad(out, inputs)``,
``backward(inputs=...)``) discards the gradients whose consumer it does not run. A
pipeline's zero-bubble split runs each boundary node twice, once toward the stage's input
(the weights' ``AccumulateGrad`` nodes not run) and once toward the weights (the input
path not run): a Function that computes from ``needs_input_grad`` alone computes both
gradients in both passes, so the weight pass costs about a full backward. Built-in nodes
compute only what the engine will use; ``grads_needed`` gives a custom Function the same
rule, from the node of each input (``ctx.next_functions``) and the engine's plan for the
backward now running. In an ordinary full backward it equals ``ctx.needs_input_grad``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_will_execute = torch._C._will_engine_execute_node


def engine_will_run(node: Any) -> bool:
    """Whether the backward now running runs (or captures the gradient reaching) ``node``.

    Answers ``True`` where the engine cannot tell: outside a backward run, and for a leaf's
    ``AccumulateGrad`` whose gradient ``torch.autograd.grad`` captures (torch refuses that
    question; a captured gradient is wanted)."""
    try:
        return _will_execute(node)
    except RuntimeError:
        return True


def grads_needed(ctx: Any, tensor_inputs: Sequence[int] | None = None) -> tuple[bool, ...]:
    """``ctx.needs_input_grad`` (indexed like it: one flag per input of ``forward``) with
    ``False`` for each gradient the backward now running would discard: its input needs
    no gradient, or the engine will not run the node it goes to. For use inside a custom
    Function's ``backward``: compute only the gradients flagged, return ``None`` for the
    others.

    ``ctx.next_functions`` holds one edge per *tensor* input of ``forward``, in order;
    ``tensor_inputs[k]`` is the position among all inputs of the ``k``-th tensor input
    (default: the tensor inputs come first, so edge ``k`` is input ``k``)."""
    needs = ctx.needs_input_grad
    edges = ctx.next_functions
    if tensor_inputs is None:
        tensor_inputs = range(len(edges))
    elif len(tensor_inputs) != len(edges):
        raise ValueError(f"grads_needed: {len(tensor_inputs)} tensor input positions given, "
                         f"the Function has {len(edges)} tensor inputs")
    out = list(needs)
    for i, (node, _) in zip(tensor_inputs, edges, strict=True):
        if out[i] and (node is None or not engine_will_run(node)):
            out[i] = False
    return tuple(out)
