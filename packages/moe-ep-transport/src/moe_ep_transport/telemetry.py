"""Routing telemetry accumulated on the device (no host sync until someone reads it).

Every rank holds the whole count matrix after the count exchange, so the figures
are global (the same on every rank) without another collective.
"""

from __future__ import annotations

import torch

from moe_ep_transport.plan import RoutePlan


class EPTelemetry:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self.calls = 0

    def record(self, plan: RoutePlan) -> None:
        M, E = plan.counts_ME.shape
        with torch.no_grad():
            figures = {
                "tokens_per_expert": plan.counts_ME.sum(0),  # routed rows per global expert
                "rows_per_rank": plan.counts_ME.view(M, M, E // M).sum((0, 2)),  # asked of each rank
                "dropped_rows": plan.dropped_M,  # dropped at each destination rank
            }
            if not self._sums:
                self._sums = {k: v.clone() for k, v in figures.items()}
            else:
                for k, v in figures.items():
                    self._sums[k] += v
        self.calls += 1

    def pop(self) -> dict[str, torch.Tensor]:
        """Sums since the last pop (device tensors), plus ``load_imbalance`` and ``drop_rate``.

        ``load_imbalance`` is the busiest rank's rows over the mean (1.0 = balanced);
        ``drop_rate`` is dropped rows over routed rows.
        """
        sums, self._sums, self.calls = self._sums, {}, 0
        if not sums:
            return {}
        rows = sums["rows_per_rank"].float()
        sums["load_imbalance"] = rows.max() / rows.mean().clamp(min=1.0)
        sums["drop_rate"] = sums["dropped_rows"].sum().float() / rows.sum().clamp(min=1.0)
        return sums
