"""The device mesh: PP x DP, with expert parallelism folded inside DP.

Rank order puts PP outermost and EP-MP innermost::

    rank = pp_rank * dp + dp_rank,    dp_rank = ep_dp_rank * ep + ep_mp_rank

so a DP group is a contiguous block of ranks and an EP-MP group (the ranks that
exchange tokens every MoE layer) is the most tightly packed: on a node of 8 GPUs
with ep <= 8 the token all-to-all never leaves NVLink.

Two meshes over the same ranks give the groups: ``(pp, dp)`` for the dense
parameters' replica group and the pipeline, ``(pp, ep_dp, ep_mp)`` for the
experts. Both are public ``DeviceMesh`` constructions (no private flattening),
so the code reads the same on every torch release we support.

Every parameter has exactly one replica group: dense ones the DP group, routed
experts the EP-DP group. ``replica_group`` encodes that rule for the wiring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pretrain.config import Layout


@dataclass(frozen=True)
class ParallelMesh:
    layout: Layout
    rank: int
    pp_rank: int
    dp_rank: int
    ep_mp_rank: int  # which expert shard this rank holds
    ep_dp_rank: int  # which copy of that shard
    dense_mesh: DeviceMesh  # dims ("pp", "dp")
    expert_mesh: DeviceMesh  # dims ("pp", "ep_dp", "ep_mp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """Ranks holding the other pipeline stages of this rank's model replica."""
        return self.dense_mesh.get_group("pp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Replica group of dense parameters; also the group losses and stats reduce over."""
        return self.dense_mesh.get_group("dp")

    @property
    def ep_mp_group(self) -> dist.ProcessGroup:
        """Ranks holding different expert shards of the same layers: tokens travel here."""
        return self.expert_mesh.get_group("ep_mp")

    @property
    def ep_dp_group(self) -> dist.ProcessGroup:
        """Replica group of this rank's routed experts."""
        return self.expert_mesh.get_group("ep_dp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def logging_rank(self) -> int:
        """Global rank that prints and writes metrics: the last PP stage's DP rank 0."""
        return (self.layout.pp - 1) * self.layout.dp

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank

    def replica_group(self, is_expert: bool) -> dist.ProcessGroup:
        """The group a parameter's gradient is reduced over and its optimizer state sharded."""
        return self.ep_dp_group if is_expert else self.dp_group

    def expert_range(self, n_experts: int) -> range:
        """Global ids of the routed experts this rank holds (a contiguous block)."""
        per_rank = n_experts // self.layout.ep
        return range(self.ep_mp_rank * per_rank, (self.ep_mp_rank + 1) * per_rank)


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    """Create the meshes and their process groups; every rank must call it (collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks, the process group has {world}")
    dense = init_device_mesh(device_type, (layout.pp, layout.dp), mesh_dim_names=("pp", "dp"))
    ranks = torch.arange(world).reshape(layout.pp, layout.ep_dp, layout.ep)
    expert = DeviceMesh(device_type, ranks, mesh_dim_names=("pp", "ep_dp", "ep_mp"))
    pp_rank, dp_rank = divmod(rank, layout.dp)
    ep_dp_rank, ep_mp_rank = divmod(dp_rank, layout.ep)
    return ParallelMesh(layout, rank, pp_rank, dp_rank, ep_mp_rank, ep_dp_rank, dense, expert)
