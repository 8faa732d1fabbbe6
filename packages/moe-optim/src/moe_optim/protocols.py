"""The structural interfaces moe_optim consumes and produces.

``GradSource`` is declared here, by the consumer (docs/ARCHITECTURE.md); moe_ddp's
``MultiGroupDDP`` satisfies it without importing this package, and so does a
plain list of tuples (the tests use one). ``OwnedRange`` is what this package gives a
checkpoint library: it satisfies moe_ckpt's ``ShardLike`` (the ``flat_offset``
form) structurally.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn


class GradSource(Protocol):
    """Yields ``(name, param, main_grad_fp32, replica_group)`` per trainable parameter.

    ``replica_group`` is the process group the parameter is replicated over
    (``None``: not replicated). For a tensor sharded over its group of size ``G``
    (see ``is_sharded``) only ``main_grad.reshape(G, -1)[r]`` must be valid on
    rank ``r``; every other ``main_grad`` has the parameter's shape and holds the
    fully reduced gradient. The tensors must stay the same objects across steps
    (they are views of persistent buckets) and be reduced before ``step()``.

    Two optional members let the optimizer check that contract instead of trusting it
    (a plain list of tuples has neither; moe_ddp's ``MultiGroupDDP`` has both):

    - ``synced: bool``: whether every main grad is reduced and complete now.
      ``update()`` / ``step()`` raise while it is false: a step on gradients still in
      flight or local makes the replicas diverge silently.
    - ``grad_is_sharded(param) -> bool``: whether only this rank's shard of ``param``'s
      main grad is reduced. The shape cannot tell (a ``[G, numel/G]`` parameter looks
      like its owner-major main grad); construction raises where the optimizer would
      keep such a tensor replicated (``min_shard_numel`` differs between the two).
    """

    def __iter__(
        self,
    ) -> Iterator[tuple[str, nn.Parameter, torch.Tensor, dist.ProcessGroup | None]]: ...


@dataclass(frozen=True)
class Placement:
    """Where a rank's parameter sits in its logical (global) tensor.

    Expert parallelism gives a rank a dim-0 slice of the stacked expert tensors;
    ``dim0_offset`` is the slice's start. Dense parameters: the full shape, 0.
    """

    global_shape: tuple[int, ...]
    dim0_offset: int = 0


@dataclass
class OwnedRange:
    """The contiguous range of a logical tensor's row-major flattening this rank's optimizer owns.

    ``local`` is 1-D and is the live optimizer tensor (loading fills it in place);
    ``flat_offset`` is where it starts in the flattened ``global_shape``.
    Replicas of the same region (EP-DP copies, replicated small tensors) describe
    identical regions; a checkpoint writer keeps one of them.
    """

    local: torch.Tensor
    global_shape: tuple[int, ...]
    flat_offset: int
