"""Save plan: who writes which box of each tensor, and the storage chunk grid.

Pure planning from the metadata every rank gathered (no tensors, no I/O), so every
rank computes the same plan and the rules can be tested alone.

- Writers: each element is written by the lowest rank that holds it. Ranks holding
  the same replicated box do not exchange data, so if replicas disagree the
  checkpoint holds the lowest rank's values: keeping replicas equal is the caller's
  job. The written boxes are disjoint and must cover the tensor; a gap is an error
  at save time, never zeros at load time.
- Chunk grid: a zarr chunk written by two processes needs a read-modify-write
  under tensorstore's optimistic locking, so the grid is aligned to the written
  boxes when that gives chunks of at least ``min_chunk_bytes``: along each
  dimension the chunk extent divides every box boundary. Chunks are then shrunk,
  leading dimension first and by divisors only, to at most ``target_chunk_bytes``
  (large chunks cut file count, smaller ones give tensorstore parallelism). When
  alignment would make chunks tiny (a flat shard boundary inside a row of a huge
  tensor) the grid ignores it and boundary chunks are shared, which tensorstore
  makes safe with conditional writes.
- Pieces: a written box cut by the chunk grid. A piece lies in one chunk and is
  written by one rank: it is the unit of the manifest's checksums. With an aligned
  grid a piece is exactly one zarr chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_ckpt.boxes import Box, grid_cells


@dataclass(frozen=True)
class Write:
    """A box that ``rank`` writes."""

    rank: int
    box: Box


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    writes: tuple[Write, ...]


def assign_writers(name: str, shape: Sequence[int], held: Sequence[Write]) -> tuple[Write, ...]:
    """Disjoint boxes, each element going to the lowest rank holding it.

    ``held`` lists every rank's boxes in rank order. Identical boxes (replicas)
    are dropped first; only boxes that overlap an earlier one pay for box
    subtraction, found with one vectorised overlap test.
    """
    unique: dict[Box, Write] = {}
    for w in held:
        if w.box.volume and w.box not in unique:
            unique[w.box] = w
    writes = list(unique.values())
    out: list[Write] = []
    if writes and shape:
        lo = np.array([w.box.offset for w in writes], dtype=np.int64)
        hi = np.array([w.box.end for w in writes], dtype=np.int64)
        overlap = np.all(
            (lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :]), axis=-1
        )
        np.fill_diagonal(overlap, False)
        for i, w in enumerate(writes):
            earlier = np.flatnonzero(overlap[i, :i])
            parts = [w.box]
            for j in earlier:
                parts = [p for part in parts for p in part.subtract(writes[j].box)]
            out += [Write(w.rank, p) for p in parts]
    else:
        out = writes[:1]
    covered = sum(w.box.volume for w in out)
    if covered != math.prod(shape):
        raise ValueError(
            f"tensor {name!r}: the ranks' shards cover {covered} of its "
            f"{math.prod(shape)} elements (global_shape {tuple(shape)}); every element "
            "must be held by some rank"
        )
    return tuple(out)


def choose_chunk_shape(
    shape: Sequence[int],
    itemsize: int,
    boxes: Sequence[Box],
    target_chunk_bytes: int,
    min_chunk_bytes: int,
) -> tuple[int, ...]:
    """The regular chunk grid for a tensor (see the module notes)."""
    shape = tuple(shape)
    if not shape:
        return ()
    aligned = [max(1, s) for s in shape]
    for box in boxes:
        for d, (o, e) in enumerate(zip(box.offset, box.end, strict=True)):
            aligned[d] = math.gcd(aligned[d], o, e)
    chunk = _fit(aligned, itemsize, target_chunk_bytes, divisors_only=True)
    nbytes = math.prod(shape) * itemsize
    if math.prod(chunk) * itemsize >= min(min_chunk_bytes, nbytes):
        return chunk
    return _fit([max(1, s) for s in shape], itemsize, target_chunk_bytes, divisors_only=False)


def _fit(
    limit: Sequence[int], itemsize: int, target_bytes: int, divisors_only: bool
) -> tuple[int, ...]:
    """Start from ``limit`` and shrink leading dimensions until a chunk fits the target."""
    chunk = list(limit)
    for d in range(len(chunk)):
        if math.prod(chunk) * itemsize <= target_bytes:
            break
        cap = max(1, target_bytes // (itemsize * math.prod(chunk[d + 1 :])))
        chunk[d] = _largest_divisor_at_most(limit[d], cap) if divisors_only else min(limit[d], cap)
    return tuple(chunk)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    best = 1
    for i in range(1, math.isqrt(n) + 1):
        if n % i == 0:
            for c in (i, n // i):
                if best < c <= cap:
                    best = c
    return best


def plan_tensor(
    name: str,
    shape: Sequence[int],
    dtype: str,
    itemsize: int,
    held: Sequence[Write],
    target_chunk_bytes: int,
    min_chunk_bytes: int,
) -> TensorPlan:
    writes = assign_writers(name, shape, held)
    chunk = choose_chunk_shape(
        shape, itemsize, [w.box for w in writes], target_chunk_bytes, min_chunk_bytes
    )
    return TensorPlan(name, tuple(shape), dtype, chunk, writes)


def pieces(box: Box, chunk_shape: Sequence[int]) -> list[Box]:
    """The checksum units of a written box: its parts in each chunk of the grid."""
    return list(grid_cells(box, chunk_shape))
