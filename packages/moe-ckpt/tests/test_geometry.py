"""Box geometry and save planning, checked against brute-force element sets."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from moe_ckpt.boxes import Box, flat_run_boxes, full_box, grid_cells
from moe_ckpt.plan import Write, assign_writers, choose_chunk_shape
from moe_ckpt.shards import BoxShard, FlatShard, describe, fill_from


def _flat_indices(shape: tuple[int, ...], box: Box) -> set[int]:
    idx = np.arange(math.prod(shape)).reshape(shape)
    return set(idx[box.slices()].reshape(-1).tolist())


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5), (4, 1, 3, 2)])
def test_flat_runs_decompose_into_ordered_contiguous_boxes(shape):
    n = math.prod(shape)
    for start, stop in itertools.combinations(range(n + 1), 2):
        boxes = flat_run_boxes(shape, start, stop)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        pos = start
        for box in boxes:  # each box is the next contiguous run, in order
            assert _flat_indices(shape, box) == set(range(pos, pos + box.volume))
            pos += box.volume
        assert pos == stop


def test_subtract_leaves_exactly_the_difference():
    rng = random.Random(0)
    shape = (6, 5, 4)
    for _ in range(300):
        a, b = (
            Box(
                tuple(rng.randrange(s) for s in shape),
                tuple(rng.randrange(1, 4) for _ in shape),
            )
            for _ in range(2)
        )
        a = a.intersect(full_box(shape)) or full_box(shape)
        b = b.intersect(full_box(shape)) or full_box(shape)
        parts = a.subtract(b)
        got = [_flat_indices(shape, p) for p in parts]
        assert sum(len(g) for g in got) == len(set().union(*got))  # disjoint
        assert set().union(*got) == _flat_indices(shape, a) - _flat_indices(shape, b)


def test_grid_cells_cut_a_box_along_the_grid():
    box = Box((1, 3), (6, 7))
    cells = list(grid_cells(box, (4, 5)))
    assert sum(c.volume for c in cells) == box.volume
    for c in cells:
        assert c.offset[0] // 4 == (c.end[0] - 1) // 4 and c.offset[1] // 5 == (c.end[1] - 1) // 5


def test_lowest_rank_writes_replicas_and_overlaps_once():
    shape = (10, 4)
    held = [
        Write(0, Box((0, 0), (6, 4))),
        Write(1, Box((0, 0), (6, 4))),  # replica of rank 0: dropped
        Write(1, Box((4, 0), (6, 4))),  # overlaps rank 0 in rows 4-5
        Write(2, full_box(shape)),  # full replica: adds nothing
    ]
    writes = assign_writers("t", shape, held)
    owner = np.full(shape, -1)
    for w in writes:
        assert (owner[w.box.slices()] == -1).all()
        owner[w.box.slices()] = w.rank
    assert (owner[:6] == 0).all() and (owner[6:] == 1).all()


def test_gaps_are_an_error_naming_the_tensor():
    with pytest.raises(ValueError, match="'w'.*cover 20 of its 40"):
        assign_writers("w", (10, 4), [Write(0, Box((0, 0), (5, 4)))])


def test_chunk_grid_aligns_to_shard_boundaries_and_respects_the_cap():
    shape = (64, 1024)  # 4 B items: 4 KiB rows
    boxes = [Box((r, 0), (n, 1024)) for r, n in [(0, 24), (24, 24), (48, 16)]]
    chunk = choose_chunk_shape(shape, 4, boxes, target_chunk_bytes=40 << 10, min_chunk_bytes=0)
    assert chunk == (8, 1024)  # gcd of boundaries is 8; 8 rows = 32 KiB <= 40 KiB
    chunk = choose_chunk_shape(shape, 4, boxes, target_chunk_bytes=1 << 30, min_chunk_bytes=0)
    assert chunk == (8, 1024)
    # A flat boundary inside a row: aligned chunks would be tiny, so the grid ignores it.
    mid_row = [Box((0, 0), (1, 512)), Box((0, 512), (1, 512)), Box((1, 0), (63, 1024))]
    assert choose_chunk_shape(shape, 4, mid_row, 1 << 30, 0) == (1, 512)
    assert choose_chunk_shape(shape, 4, mid_row, 1 << 30, 1 << 20) == shape


def test_describe_views_local_memory_for_both_shard_kinds():
    local = torch.arange(10.0)
    regions = describe("f", FlatShard(local, (3, 4), 1), rank=0).regions
    assert [r.box for r in regions] == [
        Box((0, 1), (1, 3)),
        Box((1, 0), (1, 4)),
        Box((2, 0), (1, 3)),
    ]
    for r in regions:
        r.view.fill_(-1)
    assert (local == -1).all()
    box = describe("b", BoxShard(torch.zeros(2, 4), (3, 4), (1, 0)), rank=0).regions
    assert box[0].box == Box((1, 0), (2, 4))
    with pytest.raises(ValueError, match="'b'.*outside"):
        describe("b", BoxShard(torch.zeros(3, 4), (3, 4), (1, 0)), rank=0)
    with pytest.raises(ValueError, match="'f'.*stride 1"):
        describe("f", FlatShard(torch.zeros(10)[::2], (20,), 0), rank=0)
    with pytest.raises(TypeError, match="'u'.*uint16|'u'.*not supported"):
        describe("u", torch.zeros(2, dtype=torch.uint16), rank=0)


def test_fill_from_reads_only_the_boxes_a_shard_holds():
    full = torch.arange(2 * 3 * 5, dtype=torch.float64).reshape(2, 3, 5)
    asked = []

    def read(name, offset, shape):
        asked.append((name, offset, shape))
        return full[Box(offset, shape).slices()].float()

    flat = FlatShard(torch.zeros(13), (2, 3, 5), flat_offset=7)
    box = BoxShard(torch.zeros(1, 3, 5), (2, 3, 5), (1, 0, 0))
    fill_from({"flat": flat, "box": box}, read)
    assert torch.equal(flat.local, full.reshape(-1)[7:20].float())
    assert torch.equal(box.local, full[1:].float())
    assert sum(math.prod(shape) for _, _, shape in asked) == 13 + 15  # nothing else read
    with pytest.raises(ValueError, match="'box'"):
        fill_from({"box": box}, lambda name, offset, shape: torch.zeros(3))
