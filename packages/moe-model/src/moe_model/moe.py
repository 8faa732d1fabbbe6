"""The MoE feed-forward layer: route, dispatch, grouped experts, combine.

Auxiliary losses do not travel with the activations. ``attach_aux_loss`` returns
its input unchanged and, in backward, feeds ``aux_loss_scale`` as the gradient of
the auxiliary loss. The losses therefore reach the router on every pipeline stage
without being passed between stages, and the caller controls their weight with
the same divisor it uses for the token loss (the loss is a token *sum*; the
trainer divides by the global token count, so no term depends on how the batch is
split into microbatches or ranks).

Per-step statistics (tokens per expert, loss values) are accumulated detached on
the device for logging and for bias-based balancing; ``pop_step_stats`` reads and
resets them once per optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.dispatch import LocalDispatcher, TokenDispatcher
from moe_model.experts import GroupedExperts
from moe_model.router import TopKRouter


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        aux_grad = torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_aux_loss(x: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``x``; backward adds ``scale * d(aux_loss)`` to the graph."""
    return _AttachAuxLoss.apply(x, aux_loss, scale)


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.lb_coef = cfg.lb_loss_coef
        self.router = TopKRouter(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.expert_hidden,
                                      cfg.grouped_mm_backend)
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.n_experts)
        self.aux_loss_scale = 1.0  # set by the trainer: 1 / (tokens in the global batch)
        self._stats: dict[str, torch.Tensor] = {}

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.router(x_TD)
        rows, offsets, handle = self.dispatcher.dispatch(x_TD, routing.expert_ids)
        rows_out = self.experts(rows, offsets)
        y_TD = self.dispatcher.combine(rows_out, routing.weights, handle)
        aux = self.lb_coef * routing.lb_loss
        if self.training and aux.requires_grad:
            y_TD = attach_aux_loss(y_TD, aux, self.aux_loss_scale)
        self._accumulate(routing.tokens_per_expert, aux.detach(), B * S)
        return y_TD.view(B, S, D)

    def _accumulate(self, counts: torch.Tensor, lb: torch.Tensor, n_tokens: int) -> None:
        if not self._stats:
            self._stats = {
                "tokens_per_expert": torch.zeros_like(counts),
                "lb_loss_sum": torch.zeros((), dtype=torch.float32, device=counts.device),
            }
        self._stats["tokens_per_expert"] += counts
        self._stats["lb_loss_sum"] += lb

    def pop_step_stats(self) -> dict[str, torch.Tensor]:
        """Statistics accumulated since the last call (device tensors), then reset."""
        stats, self._stats = self._stats, {}
        return stats
