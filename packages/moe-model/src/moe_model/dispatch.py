"""Token dispatch: the interface between routing and the expert GEMMs.

A dispatcher gathers the routed (token, slot) rows into an expert-major buffer
that a grouped GEMM consumes directly, and scatters expert outputs back. The
interface is a structural ``Protocol``: implementations (the local dispatcher
here, expert-parallel transports elsewhere) do not import this package.

Contract:
- ``dispatch(x[T,D], expert_ids[T,k]) -> (rows[R,D], group_offsets[E_local] int32, handle)``:
  rows for local expert ``e`` are ``rows[group_offsets[e-1]:group_offsets[e]]``
  (``group_offsets`` are cumulative end offsets, as ``torch._grouped_mm`` takes them);
  rows past ``group_offsets[-1]`` are padding and are ignored by ``combine``.
  ``R`` is a static bound (no host synchronisation is needed to size it).
- ``combine(rows_out[R,D], weights[T,k], handle) -> y[T,D]``: the top-k weighted sum
  of each token's expert outputs, accumulated in FP32.
- Both are differentiable; all metadata stays on the device.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenDispatcher(Protocol):
    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, rows_out: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts on this rank: a stable sort by expert id; dropless, R = T * k."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts

    def dispatch(
        self, x: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        T, k = expert_ids.shape
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slot index, expert-major
        token_of_row = order // k
        rows = x.index_select(0, token_of_row)
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        group_offsets = counts.cumsum(0).to(torch.int32)
        return rows, group_offsets, (order, token_of_row, T)

    def combine(self, rows_out: torch.Tensor, weights: torch.Tensor, handle: Any) -> torch.Tensor:
        order, token_of_row, T = handle
        w_R = weights.reshape(-1).index_select(0, order).float()
        y = torch.zeros(T, rows_out.shape[-1], dtype=torch.float32, device=rows_out.device)
        y = y.index_add(0, token_of_row, rows_out.float() * w_R[:, None])
        return y.to(rows_out.dtype)
