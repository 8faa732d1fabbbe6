"""Routed experts: SwiGLU weights stacked per expert, run as grouped GEMMs.

Shape legend: E local experts, D d_model, F expert hidden, R dispatched rows.
Weights follow ``nn.Linear``'s [out, in] convention per expert:
``w1_EFD`` (gate), ``w3_EFD`` (up), ``w2_EDF`` (down).

The module may hold a contiguous range of the model's experts
(``expert_start``, ``n_local``): expert parallelism narrows it, and the
initialiser uses ``expert_start`` so every expert gets the same values whatever
range a rank holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _grouped_mm_loop(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul per expert. Reads the offsets on the host (synchronises)."""
    ends = offsets.tolist()
    out = x_RK.new_zeros(x_RK.shape[0], w_EKN.shape[-1])
    start = 0
    for e, end in enumerate(ends):
        if end > start:
            out[start:end] = x_RK[start:end] @ w_EKN[e]
        start = end
    return out


def _fits_grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor) -> bool:
    """``torch._grouped_mm`` needs every stride a multiple of 16 bytes."""
    size = x_RK.element_size()
    return (x_RK.shape[-1] * size) % 16 == 0 and (w_EKN.shape[-1] * size) % 16 == 0


def grouped_mm(
    x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """``out[r] = x[r] @ w[e(r)]`` with expert segments given by cumulative ``offsets``.

    ``auto`` uses ``torch._grouped_mm`` when the shapes meet its 16-byte stride rule
    (always true for real model widths) and the per-expert loop otherwise.
    """
    if backend == "auto":
        backend = "grouped_mm" if _fits_grouped_mm(x_RK, w_EKN) else "loop"
    if backend == "loop":
        return _grouped_mm_loop(x_RK, w_EKN, offsets)
    if backend == "grouped_mm":
        return torch._grouped_mm(x_RK, w_EKN, offs=offsets)
    raise ValueError(f"unknown grouped GEMM backend {backend!r}")


class GroupedExperts(nn.Module):
    def __init__(
        self, n_experts: int, d_model: int, hidden: int, backend: str = "auto"
    ) -> None:
        super().__init__()
        self.n_experts_total = n_experts
        self.expert_start = 0
        self.n_local = n_experts
        self.backend = backend
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    @property
    def expert_range(self) -> range:
        return range(self.expert_start, self.expert_start + self.n_local)

    def narrow_(self, start: int, count: int) -> None:
        """Keep only experts ``[start, start+count)`` of those currently held."""
        if start < 0 or count <= 0 or start + count > self.n_local:
            raise ValueError(
                f"expert range [{start}, {start + count}) is outside the {self.n_local} held experts"
            )
        for name in ("w1", "w3", "w2"):
            old = getattr(self, name)
            setattr(self, name, nn.Parameter(old.detach()[start : start + count].clone()))
        self.expert_start += start
        self.n_local = count

    def forward(self, rows_RD: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        dtype = rows_RD.dtype
        w1, w3, w2 = (w.to(dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        h_RF = F.silu(grouped_mm(rows_RD, w1, group_offsets, self.backend)) * grouped_mm(
            rows_RD, w3, group_offsets, self.backend
        )
        return grouped_mm(h_RF, w2, group_offsets, self.backend)
