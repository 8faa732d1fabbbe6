"""The few collectives a save needs, with and without torch.distributed.

A save exchanges small Python objects only (plans, checksums, a status), never
tensor data: every rank writes its own boxes to the shared filesystem. Each
exchange carries an error slot so that a rank that failed still takes part in
every collective and all ranks raise together instead of hanging.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist


class Collectives(Protocol):
    rank: int
    world_size: int

    def all_gather(self, obj: Any) -> list[Any]: ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's object on rank 0, None elsewhere."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's object on every rank."""
        ...


class SingleProcess:
    rank = 0
    world_size = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        return obj


class GroupCollectives:
    """Object collectives over a process group (gloo, or NCCL with the device set)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=self._root, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._root, group=self.group)
        return box[0]


def collectives_for(group: dist.ProcessGroup | None) -> Collectives:
    """``group``'s collectives; the default group when None and initialised; else one process."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return SingleProcess()
        group = dist.group.WORLD
    return GroupCollectives(group)
