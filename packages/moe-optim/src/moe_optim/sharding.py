"""Per-tensor sharding of FP32 main weights and optimizer states over a replica group.

Each eligible tensor is flattened and cut into ``G`` equal contiguous shards;
rank ``r`` of the group owns shard ``r``. The mapping is local to one tensor, so
update, weight rebuild and checkpoint offsets stay direct. Tensors that are small
or whose element count ``G`` does not divide stay replicated: every rank of the
group updates the whole tensor identically.

An FP32 parameter is its own main weight: the main is a view of (this rank's part
of) the parameter, not a copy, so an FP32 model keeps 4 bytes per parameter for its
weights instead of 8 (as ``torch.optim`` updates FP32 parameters in place). A write
to such a parameter is a write to its main weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe_optim.protocols import Placement


def is_sharded(numel: int, group_size: int, min_shard_numel: int) -> bool:
    """The rule moe_ddp applies too (a contract of docs/ARCHITECTURE.md, GradSource)."""
    return group_size > 1 and numel % group_size == 0 and numel >= min_shard_numel


@dataclass
class TensorLayout:
    """One parameter as seen by this rank: its group, its shard and its place globally."""

    name: str
    param: nn.Parameter
    group: dist.ProcessGroup | None
    group_size: int
    rank: int  # in the replica group
    sharded: bool
    placement: Placement

    @classmethod
    def build(
        cls,
        name: str,
        param: nn.Parameter,
        group: dist.ProcessGroup | None,
        min_shard_numel: int,
        placement: Placement | None,
    ) -> TensorLayout:
        size, rank = 1, 0
        if group is not None:
            rank = dist.get_rank(group)
            if rank < 0:
                raise ValueError(f"replica group of parameter {name!r} does not contain this rank")
            size = dist.get_world_size(group)
        if not param.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous; its compute weight is rebuilt in place")
        placement = placement or Placement(tuple(param.shape))
        _check_placement(name, tuple(param.shape), placement)
        sharded = is_sharded(param.numel(), size, min_shard_numel)
        return cls(name, param, group, size, rank, sharded, placement)

    @property
    def local_numel(self) -> int:
        """Elements of the FP32 main weight this rank keeps."""
        return self.param.numel() // self.group_size if self.sharded else self.param.numel()

    @property
    def start(self) -> int:
        """Where this rank's part starts in the parameter's own flattening."""
        return self.rank * self.local_numel if self.sharded else 0

    @property
    def flat_offset(self) -> int:
        """Where this rank's part starts in the *logical* tensor's flattening."""
        row = math.prod(self.param.shape[1:]) if self.param.ndim else 1
        return self.placement.dim0_offset * row + self.start

    def check_source_sharding(self, source_sharded: bool, min_shard_numel: int) -> None:
        """Refuse a tensor the gradient source reduces only shard-wise but this layout keeps
        whole: the other shards' gradients would be this rank's local ones (wrong norm,
        diverging replicas). The reverse is sound: a shard of a fully reduced gradient."""
        if source_sharded and not self.sharded:
            raise ValueError(
                f"parameter {self.name!r} ({self.param.numel()} elements, replica group of "
                f"{self.group_size}): the gradient source reduce-scatters its main grad (so its "
                f"min_shard_numel is at most {self.param.numel()}), but the optimizer keeps it "
                f"replicated (OptimConfig.min_shard_numel={min_shard_numel}); set the same "
                "min_shard_numel on both (e.g. DDPConfig.min_shard_numel)"
            )

    def local_grad(self, main_grad: torch.Tensor) -> torch.Tensor:
        """This rank's part of a main grad, as a 1-D view."""
        if main_grad.dtype != torch.float32:
            raise ValueError(f"main grad of {self.name!r} is {main_grad.dtype}, expected torch.float32")
        if main_grad.numel() != self.param.numel():
            raise ValueError(
                f"main grad of {self.name!r} has {main_grad.numel()} elements, "
                f"the parameter {self.param.numel()}"
            )
        if self.sharded:
            return main_grad.reshape(self.group_size, -1)[self.rank]
        if main_grad.shape != self.param.shape:
            raise ValueError(
                f"main grad of {self.name!r} has shape {tuple(main_grad.shape)}, a sharded layout, "
                "but the optimizer keeps this tensor replicated: min_shard_numel differs between "
                "the gradient source and the optimizer"
            )
        return main_grad.reshape(-1)

    @property
    def main_is_param(self) -> bool:
        """Whether the FP32 main weight is (this rank's part of) the parameter itself."""
        return self.param.dtype == torch.float32

    def initial_main(self) -> torch.Tensor:
        """This rank's FP32 main weight: a view of an FP32 parameter (``main_is_param``), else
        a copy of the parameter's values."""
        part = self.param.detach().view(-1)[self.start : self.start + self.local_numel]
        return part if self.main_is_param else part.to(torch.float32).clone()


def _check_placement(name: str, shape: tuple[int, ...], placement: Placement) -> None:
    glob = tuple(placement.global_shape)
    ok = len(glob) == len(shape) and (
        not shape
        or (glob[1:] == shape[1:] and 0 <= placement.dim0_offset
            and placement.dim0_offset + shape[0] <= glob[0])
    )
    if not ok or (not shape and placement.dim0_offset):
        raise ValueError(
            f"placement of {name!r} (global shape {glob}, dim-0 offset {placement.dim0_offset}) "
            f"cannot hold its local shape {shape} as a dim-0 slice"
        )
