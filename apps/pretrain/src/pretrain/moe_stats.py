"""MoE routing statistics of one optimizer step, reduced over ranks, as metrics.

What the app needs from a MoE layer (declared here, by the consumer): a
``pop_step_stats()`` returning device tensors accumulated since the last call,

- ``tokens_per_expert`` ``[E]`` int: routed (token, slot) pairs per expert;
- ``n_tokens`` scalar int: tokens routed;
- ``lb_loss_sum`` scalar: the unweighted load-balancing loss in token-sum form;
- ``z_loss_sum`` scalar (optional): the unweighted router z-loss in token-sum form;
- ``dropped_per_expert`` ``[E]`` int (optional): slots no expert processed;
  absent means the dispatcher drops nothing.

Shape legend: L MoE layers (in model order), E experts.
All layers' values travel in one flat FP64 tensor, so a step costs one
all-reduce however many layers there are (FP64 keeps token counts exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.distributed as dist


class StepStatsSource(Protocol):
    def pop_step_stats(self) -> Mapping[str, torch.Tensor]: ...


@dataclass
class MoEStepStats:
    tokens_per_expert_LE: torch.Tensor  # float64 sums over microbatches (and ranks once reduced)
    dropped_LE: torch.Tensor
    n_tokens_L: torch.Tensor
    lb_loss_sum_L: torch.Tensor
    z_loss_sum_L: torch.Tensor | None  # None: the layers compute no z-loss

    @staticmethod
    def pop(layers: Iterable[StepStatsSource]) -> MoEStepStats | None:
        """Read and reset every layer's statistics (in model order); None when none routed."""
        stats = [layer.pop_step_stats() for layer in layers]
        if not any(stats):
            return None
        if not all(stats):
            raise RuntimeError("some MoE layers recorded no routing statistics this step")

        def stack(key: str) -> torch.Tensor:
            return torch.stack([s[key].double() for s in stats])

        counts = stack("tokens_per_expert")
        dropped = stack("dropped_per_expert") if "dropped_per_expert" in stats[0] \
            else torch.zeros_like(counts)
        z_loss = stack("z_loss_sum") if "z_loss_sum" in stats[0] else None
        return MoEStepStats(counts, dropped, stack("n_tokens"), stack("lb_loss_sum"), z_loss)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (getattr(self, f.name) for f in fields(self)) if t is not None]

    def all_reduce(self, group: dist.ProcessGroup | None) -> None:
        """Sum over ``group`` (ranks that routed different tokens through the same layers)."""
        tensors = self._tensors()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def record(self, with_load: bool) -> dict[str, Any]:
        """Metric fields: per-token losses averaged over layers, load balance, drops."""
        counts = self.tokens_per_expert_LE
        n_tokens = self.n_tokens_L.clamp_min(1)
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        out: dict[str, Any] = {
            "lb_loss": (self.lb_loss_sum_L / n_tokens).mean().item(),
            "z_loss": None if self.z_loss_sum_L is None
            else (self.z_loss_sum_L / n_tokens).mean().item(),
            "expert_load_imbalance": imbalance.max().item(),
            "dropped_token_rate": (self.dropped_LE.sum() / counts.sum().clamp_min(1)).item(),
        }
        if with_load:
            out["expert_load"] = counts.long().tolist()
        return out
