"""Routing telemetry accumulated on the device (no host sync until someone reads it).

Every rank holds the whole count matrix after the count exchange, so the figures
are global (the same on every rank) without another collective.
"""

from __future__ import annotations

import torch


def _per_destination(rows_ME: torch.Tensor) -> torch.Tensor:
    """Sum a [source, expert] matrix per destination rank (experts are contiguous per rank)."""
    M, E = rows_ME.shape
    return rows_ME.view(M, M, E // M).sum((0, 2))


class EPTelemetry:
    """Running sums of the count matrices, added by the plan's own kernel: no launch per call."""

    def __init__(self) -> None:
        self._sum_2ME: torch.Tensor | None = None  # int64: sums of rows (asked, kept) per (source, expert)
        self.calls = 0

    def running_sum(self, n_ranks: int, n_experts: int, device: torch.device) -> torch.Tensor:
        """The int64 ``[2, M, E]`` sums that one call's plan adds its ``stats_2ME`` to
        (``plan_routes(stats_sum_2ME=...)``); counts the call. Zeros after a :meth:`pop`
        (one fill per pop)."""
        if self._sum_2ME is None:
            self._sum_2ME = torch.zeros(2, n_ranks, n_experts, dtype=torch.int64, device=device)
        self.calls += 1
        return self._sum_2ME

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
