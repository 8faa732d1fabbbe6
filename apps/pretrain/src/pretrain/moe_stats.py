"""MoE routing statistics of one optimizer step, reduced over ranks, as metrics.

What the app needs from a MoE layer (declared here, by the consumer): a
``pop_step_stats()`` returning device tensors accumulated since the last call,

- ``tokens_per_expert`` ``[E]`` int: routed (token, slot) pairs per expert (required);
- ``lb_loss_sum`` scalar: the weighted load-balancing loss in token-sum form;
- ``z_loss_sum`` scalar (optional): the weighted router z-loss in token-sum form;
- ``dropped_per_expert`` ``[E]`` int (optional): slots no expert processed.
  Absent means the layer's dispatcher drops nothing (the local dropless path).

Shape legend: L MoE layers (in model order), E experts.
All layers' values travel in one flat FP64 tensor so a step costs one
all-reduce however many layers there are (FP64 keeps token counts exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class StepStatsSource(Protocol):
    def pop_step_stats(self) -> Mapping[str, torch.Tensor]: ...


@dataclass
class MoEStepStats:
    tokens_per_expert_LE: torch.Tensor  # float64, summed over microbatches (and ranks once reduced)
    lb_loss_sum_L: torch.Tensor
    z_loss_sum_L: torch.Tensor | None  # None: no layer computes a z-loss
    dropped_L: torch.Tensor

    @staticmethod
    def pop(layers: Iterable[StepStatsSource]) -> MoEStepStats | None:
        """Read and reset every layer's statistics; None when there are no MoE layers."""
        stats = [layer.pop_step_stats() for layer in layers]
        stats = [s for s in stats if s]
        if not stats:
            return None
        counts = torch.stack([s["tokens_per_expert"].double() for s in stats])
        zero = counts.new_zeros(())

        def scalars(key: str) -> torch.Tensor:
            return torch.stack([s[key].double().reshape(()) if key in s else zero for s in stats])

        dropped = torch.stack([s["dropped_per_expert"].double().sum() if "dropped_per_expert" in s
                               else zero for s in stats])
        has_z = any("z_loss_sum" in s for s in stats)
        return MoEStepStats(counts, scalars("lb_loss_sum"),
                            scalars("z_loss_sum") if has_z else None, dropped)

    def all_reduce(self, group: dist.ProcessGroup | None) -> None:
        """Sum over ``group`` (the ranks that saw different tokens of the same layers)."""
        parts = [self.tokens_per_expert_LE, self.lb_loss_sum_L, self.dropped_L]
        if self.z_loss_sum_L is not None:
            parts.append(self.z_loss_sum_L)
        flat = torch.cat([p.reshape(-1) for p in parts])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in parts:
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def record(self, n_tokens: int, with_load: bool) -> dict[str, Any]:
        """Metric fields; ``n_tokens`` is the step's token count the sums are over."""
        counts = self.tokens_per_expert_LE
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        out: dict[str, Any] = {
            "lb_loss": (self.lb_loss_sum_L.mean() / n_tokens).item(),
            "z_loss": None if self.z_loss_sum_L is None
            else (self.z_loss_sum_L.mean() / n_tokens).item(),
            "expert_load_imbalance": imbalance.max().item(),
            "dropped_token_rate": (self.dropped_L.sum() / counts.sum().clamp_min(1)).item(),
        }
        if with_load:
            out["expert_load"] = counts.long().tolist()
        return out
