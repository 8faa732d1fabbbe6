"""Boxes: axis-aligned blocks of a logical tensor, the unit of every read and write.

Everything moe-ckpt stores or loads is described by boxes in the global index space
of a logical tensor: a box shard is one box; a flat shard (a contiguous run of the
row-major flattening, how the distributed optimizer shards) is decomposed into at
most ``2 * ndim - 1`` boxes, each of which is itself a contiguous run, so the local
1-D tensor can be viewed piecewise with box shapes and no copy.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """``offset`` and ``shape`` in global coordinates; a 0-d tensor is the box ``((), ())``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def volume(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common part, or None when it is empty."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(b <= a for a, b in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(b - a for a, b in zip(lo, hi, strict=True)))

    def slices(self, within: Box | None = None) -> tuple[slice, ...]:
        """Index of this box in global coordinates, or relative to a box containing it."""
        base = within.offset if within is not None else (0,) * len(self.offset)
        return tuple(
            slice(o - b, o - b + s) for o, b, s in zip(self.offset, base, self.shape, strict=True)
        )

    def subtract(self, other: Box) -> list[Box]:
        """Disjoint boxes covering ``self`` minus ``other`` (at most ``2 * ndim``)."""
        inter = self.intersect(other)
        if inter is None:
            return [self]
        lo, hi = list(self.offset), list(self.end)
        out: list[Box] = []
        for d in range(len(lo)):
            if lo[d] < inter.offset[d]:
                out.append(_box_between(lo, hi, d, lo[d], inter.offset[d]))
                lo[d] = inter.offset[d]
            if inter.end[d] < hi[d]:
                out.append(_box_between(lo, hi, d, inter.end[d], hi[d]))
                hi[d] = inter.end[d]
        return out

    def to_json(self) -> dict[str, list[int]]:
        return {"offset": list(self.offset), "shape": list(self.shape)}

    @staticmethod
    def from_json(obj: dict[str, Sequence[int]]) -> Box:
        return Box(tuple(int(v) for v in obj["offset"]), tuple(int(v) for v in obj["shape"]))


def _box_between(lo: list[int], hi: list[int], dim: int, start: int, stop: int) -> Box:
    offset = list(lo)
    shape = [b - a for a, b in zip(lo, hi, strict=True)]
    offset[dim], shape[dim] = start, stop - start
    return Box(tuple(offset), tuple(shape))


def full_box(shape: Sequence[int]) -> Box:
    return Box((0,) * len(shape), tuple(shape))


def flat_run_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering elements ``[start, stop)`` of the row-major flattening of ``shape``.

    Returned in flattening order; each is a contiguous run (fixed leading indices,
    one ranged dimension, full trailing dimensions), so consecutive slices of a 1-D
    local tensor view them exactly.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    zeros = (0,) * (len(shape) - 1)
    if start % inner == 0 and stop % inner == 0:
        return [Box((start // inner, *zeros), (stop // inner - start // inner, *shape[1:]))]
    boxes: list[Box] = []
    row = start // inner
    if start % inner:
        head_stop = min(stop, (row + 1) * inner)
        boxes += _prefixed(row, flat_run_boxes(shape[1:], start % inner, head_stop - row * inner))
        row += 1
    if stop // inner > row:
        boxes.append(Box((row, *zeros), (stop // inner - row, *shape[1:])))
    if stop % inner and stop // inner >= row:
        boxes += _prefixed(stop // inner, flat_run_boxes(shape[1:], 0, stop % inner))
    return boxes


def _prefixed(index: int, boxes: list[Box]) -> list[Box]:
    return [Box((index, *b.offset), (1, *b.shape)) for b in boxes]


def grid_cells(box: Box, chunk_shape: Sequence[int]) -> Iterator[Box]:
    """The parts of ``box`` cut by a regular grid of ``chunk_shape`` (one per grid cell)."""
    if box.volume == 0:
        return
    ranges = [
        range(o // c, (e - 1) // c + 1)
        for o, e, c in zip(box.offset, box.end, chunk_shape, strict=True)
    ]
    for index in itertools.product(*ranges):
        cell = Box(
            tuple(i * c for i, c in zip(index, chunk_shape, strict=True)), tuple(chunk_shape)
        )
        part = box.intersect(cell)
        if part is not None:
            yield part
