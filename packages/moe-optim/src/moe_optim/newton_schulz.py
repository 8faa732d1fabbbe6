"""Muon's orthogonalisation: a quintic Newton-Schulz iteration on matrices.

Muon (Jordan et al. 2024) replaces a matrix's momentum ``M`` by an approximation
of ``U V^T`` from its SVD ``M = U S V^T``: the iteration
``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` and ``(a, b, c) = (3.4445,
-4.7750, 2.0315)``, started from ``M / ||M||_F``, pushes every singular value
towards 1 in a few steps. The leading dimensions of a stacked tensor (experts)
are a batch: each ``[..., m, n]`` matrix is orthogonalised on its own.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(m: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Approximately orthogonalise each trailing ``[m, n]`` matrix of ``m``; FP32 result."""
    a, b, c = _COEFFICIENTS
    wide = m.shape[-2] <= m.shape[-1]
    x = m.to(dtype) if wide else m.to(dtype).mT  # iterate on the side with fewer rows
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return (x if wide else x.mT).to(torch.float32)


def update_scale(shape: torch.Size, kind: str) -> float:
    """Per-matrix factor on the orthogonalised update.

    ``spectral``: ``sqrt(max(1, rows/cols))`` (Muon's published default).
    ``match_adamw_rms``: ``0.2 sqrt(max(rows, cols))``, which gives updates the RMS
    of a typical AdamW update so AdamW's learning rate carries over.
    """
    rows, cols = shape[-2], shape[-1]
    if kind == "spectral":
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


def orthogonalize_many(
    mats: list[torch.Tensor], steps: int, dtype: torch.dtype, scale: str
) -> list[torch.Tensor]:
    """``newton_schulz`` times ``update_scale`` for each tensor, batching equal matrix shapes."""
    by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, m in enumerate(mats):
        by_shape[(m.shape[-2], m.shape[-1])].append(i)
    out: list[torch.Tensor | None] = [None] * len(mats)
    for (rows, cols), indices in by_shape.items():
        batch = torch.cat([mats[i].reshape(-1, rows, cols) for i in indices])
        result = newton_schulz(batch, steps, dtype).mul_(update_scale(batch.shape, scale))
        start = 0
        for i in indices:
            count = mats[i].numel() // (rows * cols)
            out[i] = result[start : start + count].reshape(mats[i].shape)
            start += count
    return out  # type: ignore[return-value]
