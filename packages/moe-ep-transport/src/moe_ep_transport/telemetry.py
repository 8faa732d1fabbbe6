"""Routing telemetry accumulated on the device (no host sync until someone reads it).

Every rank holds the whole count matrix after the count exchange, so the figures
are global (the same on every rank) without another collective.
"""

from __future__ import annotations

import torch

from moe_ep_transport.plan import RoutePlan


def _per_destination(rows_ME: torch.Tensor) -> torch.Tensor:
    """Sum a [source, expert] matrix per destination rank (experts are contiguous per rank)."""
    M, E = rows_ME.shape
    return rows_ME.view(M, M, E // M).sum((0, 2))


class EPTelemetry:
    """Running sums of the count matrices: one in-place add per call."""

    def __init__(self) -> None:
        self._sum_2ME: torch.Tensor | None = None  # int64: sums of rows (asked, kept) per (source, expert)
        self.calls = 0

    def record(self, plan: RoutePlan) -> None:
        with torch.no_grad():
            if self._sum_2ME is None:
                self._sum_2ME = plan.stats_2ME.clone()
            else:
                self._sum_2ME += plan.stats_2ME
        self.calls += 1

    def pop(self) -> dict[str, torch.Tensor]:
        """Sums since the last pop (device tensors), plus ``load_imbalance`` and ``drop_rate``.

        ``tokens_per_expert``: routed rows per global expert; ``rows_per_rank``: rows
        asked of each rank; ``dropped_rows``: rows dropped at each destination rank;
        ``load_imbalance``: the busiest rank's rows over the mean (1.0 = balanced);
        ``drop_rate``: dropped rows over routed rows.
        """
        total, self._sum_2ME, self.calls = self._sum_2ME, None, 0
        if total is None:
            return {}
        asked_ME, kept_ME = total
        stats = {
            "tokens_per_expert": asked_ME.sum(0),
            "rows_per_rank": _per_destination(asked_ME),
            "dropped_rows": _per_destination(asked_ME - kept_ME),
        }
        rows = stats["rows_per_rank"].float()
        stats["load_imbalance"] = rows.max() / rows.mean().clamp(min=1.0)
        stats["drop_rate"] = stats["dropped_rows"].sum().float() / rows.sum().clamp(min=1.0)
        return stats
