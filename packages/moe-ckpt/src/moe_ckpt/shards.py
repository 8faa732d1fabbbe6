"""ShardLike: what a rank holds (to save) or wants (to load) of one logical tensor.

Declared here, produced by the optimizer and the trainer (docs/ARCHITECTURE.md).
Two forms, told apart by attribute name so that producers need no import:

- a *box shard* has ``global_offset``: ``local`` is the block of the global tensor
  starting there, ``local.shape`` its extent (expert shards, pipeline stages,
  replicated tensors at offset zero);
- a *flat shard* has ``flat_offset``: a 1-D ``local`` is the run
  ``[flat_offset, flat_offset + numel)`` of the global tensor's row-major
  flattening (the distributed optimizer's per-tensor sharding).

A plain ``torch.Tensor`` stands for the whole tensor (replicated). Either form
resolves to *regions*: (global box, view of ``local`` with the box's shape).
Loading writes through those views, so ``local`` is filled in place; ``fill_from``
does the same from a source other than a checkpoint (a Hugging Face folder).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from moe_ckpt.boxes import Box, flat_run_boxes
from moe_ckpt.dtypes import zarr_name


class BoxShardLike(Protocol):
    local: torch.Tensor
    global_shape: Sequence[int]
    global_offset: Sequence[int]


class FlatShardLike(Protocol):
    local: torch.Tensor
    global_shape: Sequence[int]
    flat_offset: int


ShardLike = BoxShardLike | FlatShardLike


@dataclass
class BoxShard:
    """A box of a global tensor; the default offset (zeros) with the full shape is a replica."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)
        self.global_offset = tuple(self.global_offset) or (0,) * len(self.global_shape)


@dataclass
class FlatShard:
    """A contiguous run of a global tensor's row-major flattening, held as a 1-D tensor."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int

    def __post_init__(self) -> None:
        self.global_shape = tuple(self.global_shape)


@dataclass(frozen=True)
class Region:
    """One box of a logical tensor and the view of the local tensor that holds it."""

    box: Box
    view: torch.Tensor


@dataclass(frozen=True)
class Held:
    """How a rank holds a tensor, as recorded in the manifest's saved layout."""

    rank: int
    global_offset: tuple[int, ...] | None  # box shard
    flat_offset: int | None  # flat shard
    local_shape: tuple[int, ...]

    def to_json(self) -> dict:
        out: dict = {"rank": self.rank, "local_shape": list(self.local_shape)}
        if self.flat_offset is not None:
            out["flat_offset"] = self.flat_offset
        else:
            out["global_offset"] = list(self.global_offset or ())
        return out


@dataclass(frozen=True)
class Described:
    """A validated shard: global shape, zarr dtype name, regions and layout record."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]
    held: Held


def describe(name: str, shard: ShardLike | torch.Tensor, rank: int) -> Described:
    """Validate one shard and resolve it to regions; errors name the tensor."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    if isinstance(shard, torch.Tensor):
        shard = BoxShard(shard, tuple(shard.shape))
    local = getattr(shard, "local", None)
    if not isinstance(local, torch.Tensor):
        raise TypeError(f"tensor {name!r}: shard.local must be a torch.Tensor, got {type(local)}")
    shape = tuple(int(s) for s in shard.global_shape)
    dtype = zarr_name(local.dtype, name)
    has_box, has_flat = hasattr(shard, "global_offset"), hasattr(shard, "flat_offset")
    if has_box == has_flat:
        raise TypeError(
            f"tensor {name!r}: a shard has exactly one of global_offset (box) or "
            f"flat_offset (flat run); got {type(shard).__name__}"
        )
    if has_box:
        offset = tuple(int(o) for o in shard.global_offset)
        box = Box(offset, tuple(local.shape))
        if len(offset) != len(shape) or local.dim() != len(shape):
            raise ValueError(
                f"tensor {name!r}: global_shape {shape}, global_offset {offset} and "
                f"local shape {tuple(local.shape)} must have the same number of dimensions"
            )
        if any(o < 0 or e > s for o, e, s in zip(offset, box.end, shape, strict=True)):
            raise ValueError(
                f"tensor {name!r}: local box at {offset} of shape {tuple(local.shape)} "
                f"lies outside global_shape {shape}"
            )
        regions = (Region(box, local),)
        held = Held(rank, offset, None, tuple(local.shape))
    else:
        start = int(shard.flat_offset)
        if local.dim() != 1 or (local.numel() > 1 and local.stride(0) != 1):
            raise ValueError(
                f"tensor {name!r}: a flat shard's local tensor must be 1-D with stride 1, "
                f"got shape {tuple(local.shape)} strides {local.stride()}"
            )
        stop = start + local.numel()
        if start < 0 or stop > math.prod(shape):
            raise ValueError(
                f"tensor {name!r}: flat run [{start}, {stop}) lies outside the "
                f"{math.prod(shape)} elements of global_shape {shape}"
            )
        regions_list = []
        pos = 0
        for box in flat_run_boxes(shape, start, stop):
            regions_list.append(Region(box, local[pos : pos + box.volume].view(box.shape)))
            pos += box.volume
        regions = tuple(regions_list)
        held = Held(rank, None, start, tuple(local.shape))
    return Described(name, shape, dtype, regions, held)


def describe_all(
    tensors: Mapping[str, ShardLike | torch.Tensor], rank: int
) -> dict[str, Described]:
    return {name: describe(name, shard, rank) for name, shard in tensors.items()}


BoxReader = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


def fill_from(targets: Mapping[str, ShardLike | torch.Tensor], read: BoxReader) -> None:
    """Fill each target's ``local`` in place from another store of the logical tensors.

    ``read(name, offset, shape)`` returns that box of logical tensor ``name`` (any dtype:
    it is cast on copy). A box shard asks for its box; a flat shard for the at most
    ``2 * ndim - 1`` boxes of its run, so only what the targets hold is ever read.
    """
    for name, shard in targets.items():
        for region in describe(name, shard, rank=0).regions:
            data = read(name, region.box.offset, region.box.shape)
            if tuple(data.shape) != region.box.shape:
                raise ValueError(f"tensor {name!r}: the box at {region.box.offset} of shape "
                                 f"{region.box.shape} was read with shape {tuple(data.shape)}")
            with torch.no_grad():
                region.view.copy_(data)
