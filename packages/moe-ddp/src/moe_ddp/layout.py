"""Bucket layout: where each parameter's gradient lives inside the flat buckets.

Pure planning (no tensors, no process groups), so the layout rules can be tested
and read on their own.

- Buckets are formed per (replica group, device, collective); grad storage and
  communication dtypes are fixed per ``MultiGroupDDP``, so they complete the key.
- Parameters are visited in *reverse* registration order, the order in which
  backward usually produces their gradients, and buckets are ordered by the
  position of the last parameter they received: that is when backward usually
  completes them. The order is a function of the parameter list alone, hence
  identical on every rank that holds the same parameters.
- ``all_reduce`` and ``none`` buckets are plain concatenations. A
  ``reduce_scatter`` bucket is laid out *owner-major*: the buffer is ``G`` equal
  regions, region ``r`` holds shard ``r`` of every member tensor, so one
  ``reduce_scatter_tensor`` leaves each rank its own shard of every tensor in one
  contiguous piece.
- Offsets are aligned to ``ALIGN_NUMEL`` elements (64 bytes in FP32) so that the
  per-parameter views start on vectorisable addresses.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Collective = Literal["all_reduce", "reduce_scatter", "none"]

ALIGN_NUMEL = 16


def is_sharded(numel: int, group_size: int, min_shard_numel: int) -> bool:
    """The per-tensor sharding rule shared with the distributed optimizer.

    A tensor is split into ``group_size`` equal contiguous pieces of its row-major
    flattening iff its element count divides evenly and is large enough to be
    worth a collective slot (docs/ARCHITECTURE.md, GradSource).
    """
    return group_size > 1 and numel % group_size == 0 and numel >= min_shard_numel


def _aligned(n: int) -> int:
    return -(-n // ALIGN_NUMEL) * ALIGN_NUMEL


@dataclass(frozen=True)
class ParamEntry:
    """One trainable parameter, as the planner sees it."""

    numel: int
    group_key: Hashable  # identity of (replica group, device); None-like keys are allowed
    group_size: int  # 1 for parameters that are not replicated
    collective: Collective


@dataclass
class BucketSpec:
    """A planned bucket: its members and the flat FP32 buffer they share.

    ``offsets[i]`` is where member ``params[i]`` starts: in the whole buffer for
    ``all_reduce``/``none``, inside each rank's region for ``reduce_scatter``.
    """

    group_key: Hashable
    group_size: int
    collective: Collective
    params: list[int] = field(default_factory=list)  # indices into the entry list
    offsets: list[int] = field(default_factory=list)
    region_numel: int = 0  # per-rank region (reduce_scatter) or whole buffer (others)
    last_position: int = -1  # visit position of the last member added

    @property
    def numel(self) -> int:
        """Elements of the whole flat buffer."""
        if self.collective == "reduce_scatter":
            return self.group_size * self.region_numel
        return self.region_numel

    def piece_numel(self, entry: ParamEntry) -> int:
        """Elements a member occupies in one region (its shard, or all of it)."""
        if self.collective == "reduce_scatter":
            return entry.numel // self.group_size
        return entry.numel

    def numel_with(self, entry: ParamEntry) -> int:
        grown = _aligned(self.region_numel) + self.piece_numel(entry)
        return grown * (self.group_size if self.collective == "reduce_scatter" else 1)

    def add(self, index: int, entry: ParamEntry, position: int) -> None:
        offset = _aligned(self.region_numel)
        self.params.append(index)
        self.offsets.append(offset)
        self.region_numel = offset + self.piece_numel(entry)
        self.last_position = position

    def finalize(self) -> None:
        # Whole regions stay aligned, so region r starts aligned for every r.
        self.region_numel = _aligned(self.region_numel)


def plan_buckets(entries: Sequence[ParamEntry], cap_numel: int) -> list[BucketSpec]:
    """Group ``entries`` (in registration order) into buckets of at most ``cap_numel``.

    A single tensor larger than the cap gets a bucket of its own. Returns the
    buckets in launch order.
    """
    if cap_numel <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_numel} elements")
    open_buckets: dict[tuple[Hashable, Collective], BucketSpec] = {}
    done: list[BucketSpec] = []
    for position, index in enumerate(reversed(range(len(entries)))):
        entry = entries[index]
        key = (entry.group_key, entry.collective)
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.params and bucket.numel_with(entry) > cap_numel:
            done.append(bucket)
            bucket = None
        if bucket is None:
            bucket = BucketSpec(entry.group_key, entry.group_size, entry.collective)
            open_buckets[key] = bucket
        bucket.add(index, entry, position)
    done.extend(open_buckets.values())
    done.sort(key=lambda b: b.last_position)
    for bucket in done:
        bucket.finalize()
    return done
