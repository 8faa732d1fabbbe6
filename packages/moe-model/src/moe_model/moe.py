"""The MoE feed-forward layer: route, dispatch, grouped experts, combine (+ shared experts).

Shape legend: B batch, S sequence, T = B*S tokens, D d_model, E experts, k top_k.

Auxiliary losses do not travel with the activations. ``attach_aux_loss`` returns
its input unchanged and, in backward, feeds ``aux_loss_scale`` as the gradient of
the auxiliary loss. The losses therefore reach the router on every pipeline stage
without being passed between stages, and the caller controls their weight with
the same divisor it uses for the token loss (the loss is a token *sum*; the
trainer divides by the global token count, ``wire_model(model, ModelWiring(aux_loss_scale=1/N))``).

Load-balancing granularity (what the expert load ``f_e`` is counted over):
- ``microbatch``: this rank's current microbatch.
- ``global_batch``: the optimizer step's tokens seen so far on all data-parallel
  ranks. The layer keeps a running sum of the step's counts, reduced over the
  data-parallel group by ``count_reducer`` (a callable the trainer injects, e.g.
  an all-reduce over its DP group; without one, this rank's step is the "global"
  batch). With one microbatch per step, ``f`` is exactly the global batch's load.
  With gradient accumulation, microbatch ``m`` uses the counts of microbatches
  ``1..m`` (the gradient of microbatch ``m`` exists before later microbatches are
  routed, so the full step's load cannot be used); the last microbatch sees the
  whole global batch. ``pop_step_stats()`` (or ``end_step()``) marks the step boundary
  and resets the running sum, so the trainer must call it once per optimizer step. The
  running sum is one buffer updated in place, so a forward captured in a CUDA graph
  adds to the same sum on every replay. The reducer is
  called once per MoE layer per forward (never in a recomputed forward), so all
  ranks of the DP group must run the same number of MoE forwards per step.

Only training forwards (``self.training`` with autograd enabled) count toward a step:
an evaluation or ``no_grad`` forward between steps leaves the running counts, the
reducer (a collective) and the statistics alone, and balances over its own tokens.

Per-step statistics (device tensors, detached) are accumulated for logging and
bias balancing; ``pop_step_stats`` returns and resets them (``take_step_stats`` does the
same without ending the step: the sums of a captured group of microbatches):
``tokens_per_expert`` [E] routed slots, ``dropped_per_expert`` [E] slots the
dispatcher dropped (capacity), ``lb_loss_sum`` / ``z_loss_sum`` the unweighted
token-sum losses, ``n_tokens`` the tokens routed (so per-token means are
``lb_loss_sum / n_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.dispatch import (
    EncodesRows,
    LocalDispatcher,
    PipelinesExperts,
    ReportsDrops,
    TokenDispatcher,
)
from moe_model.experts import GroupedExperts
from moe_model.layers import SwiGLU
from moe_model.recompute import is_recomputing
from moe_model.router import TopKRouter, load_balancing_loss
from moe_model.row_encoding import INPUT_ROW_ENCODER
from moe_model.sink import MergingSink

CountReducer = Callable[[torch.Tensor], torch.Tensor]  # [E] counts -> [E] summed over the DP group


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


_Stats = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, int]
_FOLD_EVERY = 256  # recorded forwards summed into one entry (more than a step's, usually)


def _sum_stats(entries: list[_Stats]) -> _Stats:
    """One entry holding the sums of ``entries`` (``dropped``: None where none reported)."""
    counts, dropped, lb, z, n_tokens = zip(*entries, strict=True)
    known_drops = [d for d in dropped if d is not None]
    # the losses' sums in FP64: exact for FP32 values of similar magnitude (a step's
    # microbatches), so sums over groups of microbatches (CUDA graphs) add up to the step's
    return (torch.stack(counts).sum(0), torch.stack(known_drops).sum(0) if known_drops else None,
            torch.stack(lb).sum(dtype=torch.float64), torch.stack(z).sum(dtype=torch.float64),
            sum(n_tokens))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: autocast's if active, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.lb_coef, self.z_coef = cfg.lb_loss_coef, cfg.z_loss_coef
        self.lb_granularity = cfg.lb_loss_granularity
        self.router = TopKRouter(cfg)
        self.experts = GroupedExperts(cfg.n_experts, cfg.d_model, cfg.expert_hidden,
                                      cfg.grouped_mm_backend)
        self.shared = SwiGLU(cfg.d_model, cfg.shared_hidden_width) if cfg.n_shared_experts else None
        self.dispatcher: TokenDispatcher = LocalDispatcher(cfg.n_experts, cfg.capacity_factor)
        self.aux_loss_scale = 1.0  # set by the trainer: 1 / (tokens in the global batch)
        self.count_reducer: CountReducer | None = None  # set by the trainer for global_batch balancing
        # per forward of this step: (counts, dropped, lb, z, tokens); see _record
        self._pending: list[_Stats] = []
        self._step_counts: torch.Tensor | None = None  # running global-batch counts of this step

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        routing = self.router(x_TD)
        x_compute = x_TD.to(_compute_dtype(x_TD))
        if isinstance(self.dispatcher, PipelinesExperts):  # it schedules the experts itself
            y_TD, handle = self._run_experts(self.dispatcher, x_compute, routing.expert_ids, routing.weights)
        else:
            rows, offsets, handle = self._dispatch(x_compute, routing.expert_ids, routing.weights)
            y_TD = self.dispatcher.combine(self.experts(rows, offsets), routing.weights, handle)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        training = self.training and torch.is_grad_enabled()  # counts toward the step
        counts = self._balance_counts(routing.tokens_per_expert) if training else routing.tokens_per_expert
        lb = load_balancing_loss(routing.probs, counts)
        if training and (self.lb_coef or self.z_coef):
            aux = self.lb_coef * lb + self.z_coef * routing.z_loss
            y_TD = attach_aux_loss(y_TD, aux, self.aux_loss_scale)
        if training and not is_recomputing():
            dropped = (self.dispatcher.dropped_per_expert(handle)
                       if isinstance(self.dispatcher, ReportsDrops) else None)
            self._record(routing.tokens_per_expert, dropped, lb, routing.z_loss, B * S)
        return y_TD.view(B, S, D)

    def _dispatch(self, x_TD: torch.Tensor, expert_ids: torch.Tensor,
                  weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The dispatcher's ``dispatch``, or ``dispatch_encoded`` with the experts'
        ``INPUT_ROW_ENCODER`` where both exist (``moe_model.row_encoding``)."""
        encoder = getattr(self.experts, INPUT_ROW_ENCODER, None)
        if encoder is not None and isinstance(self.dispatcher, EncodesRows):
            return self.dispatcher.dispatch_encoded(x_TD, expert_ids, weights, encoder)
        return self.dispatcher.dispatch(x_TD, expert_ids, weights)

    def _run_experts(self, dispatcher: PipelinesExperts, x_TD: torch.Tensor, expert_ids: torch.Tensor,
                     weights: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``dispatcher.run_experts`` with the experts; their weight gradients reach a gradient
        sink once per forward however many calls the dispatcher makes (``MergingSink``).

        The experts hold the merging sink only for the length of each call (their GEMMs take
        it in their forward): the dispatcher may hand control to another forward of this
        layer between its calls (an interleave of microbatches), which must find the
        experts' own sink."""
        sink = getattr(self.experts, "grad_sink", None)
        if sink is None:
            return dispatcher.run_experts(x_TD, expert_ids, weights, self.experts)
        merging = MergingSink(sink)

        def experts(rows: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
            merging.uses += 1
            self.experts.grad_sink = merging
            try:
                return self.experts(rows, group_offsets)
            finally:
                self.experts.grad_sink = sink

        return dispatcher.run_experts(x_TD, expert_ids, weights, experts)

    def _balance_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """The counts ``f_e`` is taken from (see the module docstring)."""
        if self.lb_granularity == "microbatch" or is_recomputing():
            return counts_E  # a recomputed forward's value is unused (see router._BalanceLoss)
        reduced = self.count_reducer(counts_E.clone()) if self.count_reducer else counts_E
        if self._step_counts is None:
            self._step_counts = torch.zeros_like(reduced)
        return self._step_counts.add_(reduced)  # read at once by the loss (it keeps f_e, not this)

    def _record(self, counts: torch.Tensor, dropped: torch.Tensor | None, lb: torch.Tensor,
                z: torch.Tensor, n_tokens: int) -> None:
        """Keep this training forward's statistics; ``pop_step_stats`` sums them. Summing once
        per step instead of adding per forward saves ~5 tiny kernels per layer and microbatch;
        forwards that are never popped are folded every ``_FOLD_EVERY`` to bound memory."""
        self._pending.append((counts, dropped, lb.detach(), z.detach(), n_tokens))
        if len(self._pending) >= _FOLD_EVERY:
            self._pending = [_sum_stats(self._pending)]

    def pop_step_stats(self) -> dict[str, torch.Tensor]:
        """Statistics accumulated since the last call (device tensors), then reset.

        Call once per optimizer step: it also ends the step for global-batch balancing.
        """
        stats = self.take_step_stats()
        self.end_step()
        return stats

    def end_step(self) -> None:
        """End the optimizer step for global-batch balancing: the running counts restart
        from zero (in place: a captured forward keeps adding to the same buffer)."""
        if self._step_counts is not None:
            self._step_counts.zero_()

    def take_step_stats(self) -> dict[str, torch.Tensor]:
        """Statistics of the forwards since the last take or pop (device tensors; ``{}`` if
        none), then reset; unlike ``pop_step_stats`` the step goes on."""
        pending, self._pending = self._pending, []
        if not pending:
            return {}
        counts, dropped, lb, z, n_tokens = _sum_stats(pending)
        return {
            "tokens_per_expert": counts,
            "dropped_per_expert": torch.zeros_like(counts) if dropped is None else dropped,
            "lb_loss_sum": lb,
            "z_loss_sum": z,
            "n_tokens": torch.full((), n_tokens, dtype=torch.int64, device=counts.device),
        }

    def update_bias(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing, once per optimizer step; see ``TopKRouter.update_bias``."""
        self.router.update_bias(counts_E)
