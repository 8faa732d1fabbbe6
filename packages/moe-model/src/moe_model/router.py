"""Top-k token router, computed in FP32.

Shape legend: T tokens, D d_model, E experts (all, not local), k top_k.
Everything the router returns stays on the device: counting uses
``scatter_add_`` rather than ``bincount`` (which synchronises with the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moe_model.config import MoEConfig


@dataclass
class RoutingResult:
    expert_ids: torch.Tensor  # [T, k] int64, global expert ids
    weights: torch.Tensor  # [T, k] float32, combine weights
    tokens_per_expert: torch.Tensor  # [E] int64, routed (token, slot) pairs per expert
    lb_loss: torch.Tensor  # scalar float32, load-balancing loss summed over tokens (see MoELayer)


def count_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Histogram of expert ids without a host synchronisation."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class TopKRouter(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))

    def forward(self, x_TD: torch.Tensor) -> RoutingResult:
        logits_TE = x_TD.float() @ self.weight.float().t()
        probs_TE = logits_TE.softmax(dim=-1)
        weights_Tk, expert_ids_Tk = probs_TE.topk(self.top_k, dim=-1)
        counts_E = count_per_expert(expert_ids_Tk, self.n_experts)
        # Switch-style balance term, in token-sum form so that the caller scales it
        # with the same divisor as the token loss: sum_t sum_e f_e * p_te * E, with
        # f_e the fraction of this microbatch's routed slots that went to expert e.
        T = x_TD.shape[0]
        f_E = counts_E.float() / (T * self.top_k)
        lb_loss = self.n_experts * (f_E * probs_TE.sum(0)).sum()
        return RoutingResult(expert_ids_Tk, weights_Tk, counts_E, lb_loss)
