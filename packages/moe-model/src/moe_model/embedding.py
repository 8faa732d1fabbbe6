"""Token embedding whose weight gradient may go straight into a gradient sink.

``Embedding`` is ``nn.Embedding`` with a ``grad_sink`` slot (filled by
``moe_model.wire_model``). With a ``GradientSink`` that accepts
the embedding's weight (a data-parallel wrapper's FP32 main grads), on CUDA with Triton,
the backward adds the gradient of the tokens' rows to the sink's FP32 target
(``_embedding_kernels``) instead of returning a dense ``[vocab, d_model]`` BF16 gradient
for the wrapper's hook to add: the rows not seen cost nothing. A tied head (the same
parameter) must not use it: the head's gradient reaches the parameter through autograd,
so the model wires no sink into it then. The sink lives on the module (not on the model's
root), so every view of the model that shares the module (a pipeline stage) shares it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_model._triton_support import Backend, use_fused
from moe_model.experts import sink_adds_in_kernel
from moe_model.sink import GradientSink, SinkRoute, accumulator_layout, sink_route, will_run


def embedding_grad_accumulate_reference_(target: torch.Tensor, tokens: torch.Tensor, dy: torch.Tensor,
                                         vocab: int) -> None:
    """``target += dW`` for the ``[vocab, D]`` embedding whose output gradient is ``dy [..., D]``
    at token ids ``tokens [...]`` (in ``[0, vocab)``), in eager PyTorch: ``dW`` summed in FP32
    by ``index_add_``, then added once. ``target`` is FP32 and holds the weight's elements in
    storage order: 1-D, or ``[rows, cols]`` with contiguous rows read row by row
    (``moe_model.sink.accumulator_layout``)."""
    D = dy.shape[-1]
    accumulator_layout(target, vocab * D, "embedding gradient")
    if dy.shape[:-1] != tokens.shape:
        raise ValueError(f"embedding gradient: dy {tuple(dy.shape)} does not match tokens {tuple(tokens.shape)}")
    dw = torch.zeros(vocab, D, dtype=torch.float32, device=dy.device).index_add_(
        0, tokens.reshape(-1), dy.reshape(-1, D).float())
    target.add_(dw.view(target.shape))


def embedding_grad_accumulate_(target: torch.Tensor, tokens: torch.Tensor, dy: torch.Tensor, vocab: int,
                               backend: Backend = "auto") -> None:
    """``embedding_grad_accumulate_reference_``'s update; the fused path is one Triton kernel
    (``_embedding_kernels``) that sums each token id's gradient rows in FP32, in token order,
    and adds the sum to the target's row once: no dense ``dW``, no atomics."""
    if use_fused("embedding_grad_accumulate_", backend, dy.device):
        from moe_model import _embedding_kernels as k

        k.embedding_grad_accumulate_(target, tokens, dy, vocab)
        return
    embedding_grad_accumulate_reference_(target, tokens, dy, vocab)


class EmbeddingGradient:
    """The embedding's weight gradient not computed yet: the token ids and their output
    gradient. Calling it adds the gradient to an FP32 target (see the module docstring)."""

    def __init__(self, tokens: torch.Tensor, dy: torch.Tensor, vocab: int) -> None:
        self.tokens, self.dy, self.vocab = tokens, dy, vocab

    def __call__(self, target: torch.Tensor) -> None:
        embedding_grad_accumulate_(target, self.tokens, self.dy, self.vocab)


class _EmbeddingIntoSink(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, weight: nn.Parameter, route: SinkRoute) -> torch.Tensor:
        ctx.save_for_backward(tokens)
        ctx.route, ctx.param = route, weight
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, None, None]:
        (tokens,) = ctx.saved_tensors
        # only in a backward that runs the weight's AccumulateGrad node (a pipeline's
        # input-gradient pass does not), so the gradient lands exactly once
        if will_run(ctx.route):
            ctx.route[0].add_gradient(ctx.param, EmbeddingGradient(tokens, dy, ctx.param.shape[0]))
        return None, None, None


def embed(module: nn.Embedding, tokens: torch.Tensor, sink: GradientSink | None) -> torch.Tensor:
    """``module(tokens)``; the weight's gradient goes into ``sink`` when it accepts it, the
    tokens are on CUDA with Triton available and a backward may run."""
    plain = (module.padding_idx is None and module.max_norm is None
             and not module.scale_grad_by_freq and not module.sparse)
    route = sink_route(sink, module.weight) if plain and sink_adds_in_kernel(tokens) else None
    if route is None:
        return F.embedding(tokens, module.weight, module.padding_idx, module.max_norm,
                           module.norm_type, module.scale_grad_by_freq, module.sparse)
    return _EmbeddingIntoSink.apply(tokens, module.weight, route)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose weight gradient goes into ``grad_sink`` when one is wired
    (see ``embed``); the same parameters and state dict as ``nn.Embedding``."""

    grad_sink: GradientSink | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return embed(self, tokens, self.grad_sink)
