"""Fair overflow allocation: which routed rows survive when a rank's capacity is exceeded.

Shape legend: M EP ranks, E global experts, L = E/M local experts per rank.
A *cell* is the rows one source rank ``s`` sends to one expert ``g``:
``counts_ME[s, g]`` of them, in the source's (token, slot) order.

Why this policy: truncating an expert-major buffer at capacity always drops the
highest expert ids and the highest source ranks (a peer's documented bias). Here
a destination ``r`` that is asked for ``N_r > C`` rows keeps, from every cell, a
share proportional to the cell's size (largest-remainder rounding), so every
expert and every source loses the same fraction. The few leftover rows of the
rounding go to cells in a rotated order, and inside a cell the dropped rows are a
cyclic window at a hashed start, so no position in the batch is favoured either.

The rotation seed is a hash of the count matrix itself (plus a per-layer salt):
every rank holds the same matrix, so all ranks agree on the plan without talking,
and a recomputation (activation checkpointing) reproduces it exactly. Overflow
only happens under imbalance, where counts change from step to step, which is
what moves the rotation; identical count matrices give identical drops.

Everything is integer tensor arithmetic on the device: no host synchronisation.
This module is the PyTorch definition; ``_plan_kernels`` computes the same integers
in one Triton program on CUDA (the hash constants are shared from here).
"""

from __future__ import annotations

import torch

HASH_PRIME = 2_147_483_647  # 2^31 - 1, a prime: products of two residues stay below 2^62
HASH_MULTIPLIER = 48_271  # MINSTD multiplier
HASH_START = 1_234_567
HASH_INCREMENT = 12_345
_P, _A = HASH_PRIME, HASH_MULTIPLIER


def mix(*parts: torch.Tensor | int) -> torch.Tensor | int:
    """A deterministic integer hash in ``[0, 2^31 - 1)`` of non-negative integer parts.

    Tensors broadcast. Only used to spread priorities, not for security.
    """
    h: torch.Tensor | int = HASH_START
    for p in parts:
        h = ((h + p % _P + 1) * _A) % _P
        h = (h * _A + HASH_INCREMENT) % _P
    return h


def counts_seed(counts_ME: torch.Tensor, salt: int) -> torch.Tensor:
    """A hash of the whole count matrix (same on every rank), salted per layer."""
    M, E = counts_ME.shape
    idx = torch.arange(M * E, device=counts_ME.device).view(M, E)
    coef = mix(idx, salt)
    terms = (counts_ME % _P) * coef % _P  # each < 2^31, so the sum fits int64
    return mix(terms.sum() % _P, salt)


def fair_allocation(
    counts_ME: torch.Tensor, capacity: int, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows kept per cell and the start of each cell's dropped window.

    Returns ``kept_ME`` (``<= counts_ME``; the cells of each destination sum to at
    most ``capacity``) and ``drop_start_ME`` (where the cyclic window of
    ``counts - kept`` dropped rows begins inside the cell).
    """
    M, E = counts_ME.shape
    L = E // M
    n_cells = L * M
    # Cells of destination r in its receive order: cell index l * M + s.
    c_rc = counts_ME.view(M, M, L).permute(1, 2, 0).reshape(M, n_cells)
    need_r1 = c_rc.sum(1, keepdim=True)
    over_r1 = need_r1 > capacity
    denom_r1 = need_r1.clamp(min=1)
    exact = c_rc * capacity
    share = exact // denom_r1
    leftover_r1 = capacity - share.sum(1, keepdim=True)
    eligible = (exact % denom_r1) != 0  # cells whose exact share has a fraction
    # Rank the eligible cells of each destination starting at a rotated cell.
    dest = torch.arange(M, device=counts_ME.device).view(M, 1)
    rot_r1 = mix(seed, dest) % n_cells
    cell = torch.arange(n_cells, device=counts_ME.device).view(1, n_cells)
    elig = eligible.to(torch.int64)
    before = elig.cumsum(1) - elig  # eligible cells before each cell
    at_rot = before.gather(1, rot_r1)
    total = elig.sum(1, keepdim=True)
    rotated_rank = torch.where(cell >= rot_r1, before - at_rot, before + total - at_rot)
    bonus = (eligible & (rotated_rank < leftover_r1)).to(torch.int64)
    kept_rc = torch.where(over_r1, share + bonus, c_rc)
    kept_ME = kept_rc.view(M, L, M).permute(2, 0, 1).reshape(M, E)

    src = torch.arange(M, device=counts_ME.device).view(M, 1)
    expert = torch.arange(E, device=counts_ME.device).view(1, E)
    drop_start_ME = mix(seed, src, expert) % counts_ME.clamp(min=1)
    return kept_ME, drop_start_ME


def dropped_window(
    q_N: torch.Tensor, cell_N: torch.Tensor, drop_N: torch.Tensor, start_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the row of rank ``q`` in its cell: is it dropped, and how many dropped rows precede it.

    The dropped rows of a cell of size ``c`` are ``{(start + i) mod c : i < drop}``.
    """
    c = cell_N.clamp(min=1)
    dropped = ((q_N - start_N) % c) < drop_N
    first = torch.minimum(drop_N, c - start_N)  # part of the window in [start, c)
    wrapped = drop_N - first  # part that wrapped to [0, wrapped)
    preceding = torch.minimum(q_N, wrapped) + torch.minimum((q_N - start_N).clamp(min=0), first)
    return dropped, preceding
