"""Bringing sharded Muon matrices to one rank each, and their updates back.

Muon needs the whole momentum matrix, but the distributed optimizer keeps only a
flat shard of it per rank. Per replica group, each sharded Muon tensor gets an
*owner* rank (longest-processing-time assignment by Newton-Schulz cost, so the
matrix work is spread over the group). One ``all_to_all`` sends every rank's
shard of a tensor to its owner, the owner orthogonalises the assembled tensors,
and a second ``all_to_all`` returns each rank its shard of the update. Each
tensor's full matrix crosses the network twice, once in each direction, and the
result equals single-process Muon exactly (the same matrix goes through the same
iteration). Split sizes come from the static layout: no host synchronisation.

Shape legend: G ranks in the replica group, N elements a rank exchanges per peer
(the total shard size of the tensors the receiving rank owns).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def newton_schulz_cost(shape: torch.Size) -> int:
    """Relative cost of orthogonalising a ``[..., m, n]`` tensor: batch * m * n * min(m, n)."""
    rows, cols = shape[-2], shape[-1]
    return shape.numel() * min(rows, cols)


def assign_owners(costs: list[int], n_ranks: int) -> list[int]:
    """Greedy longest-processing-time assignment; ties broken by index, so deterministic."""
    load = [0] * n_ranks
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(n_ranks), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


class MuonExchange:
    """The two all-to-alls of one replica group's sharded Muon tensors."""

    def __init__(self, shapes: list[torch.Size], group: dist.ProcessGroup, size: int, rank: int) -> None:
        self.shapes = shapes
        self.group, self.size, self.rank = group, size, rank
        self.owners = assign_owners([newton_schulz_cost(s) for s in shapes], size)
        shard = [s.numel() // size for s in shapes]
        # Send order: grouped by owner rank, tensor order inside each owner.
        self.send_order = [i for r in range(size) for i in range(len(shapes)) if self.owners[i] == r]
        self.owner_numel = [sum(shard[i] for i in range(len(shapes)) if self.owners[i] == r) for r in range(size)]
        self.mine = [i for i in range(len(shapes)) if self.owners[i] == rank]
        self.my_offsets: list[int] = []
        offset = 0
        for i in self.mine:
            self.my_offsets.append(offset)
            offset += shard[i]
        self.my_numel = offset
        self._shard = shard

    def sent_bytes(self) -> int:
        """FP32 bytes this rank sends to other ranks per step (both directions)."""
        to_owners = sum(n for r, n in enumerate(self.owner_numel) if r != self.rank)
        back = (self.size - 1) * self.my_numel
        return 4 * (to_owners + back)

    def run(
        self,
        shards: list[torch.Tensor],
        orthogonalize: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    ) -> list[torch.Tensor]:
        """Own shards of the inputs -> own shards of ``orthogonalize(full tensors)``."""
        send = torch.cat([shards[i] for i in self.send_order])
        recv = send.new_empty(self.size * self.my_numel)
        dist.all_to_all_single(recv, send, [self.my_numel] * self.size, self.owner_numel, group=self.group)
        rows_GN = recv.view(self.size, self.my_numel)
        full = [
            rows_GN[:, off : off + self._shard[i]].reshape(self.shapes[i])
            for i, off in zip(self.mine, self.my_offsets, strict=True)
        ]
        back_GN = recv.new_empty(self.size, self.my_numel)
        for i, off, update in zip(self.mine, self.my_offsets, orthogonalize(full), strict=True):
            back_GN[:, off : off + self._shard[i]] = update.reshape(self.size, -1)
        result = send.new_empty(send.numel())
        dist.all_to_all_single(result, back_GN.view(-1), self.owner_numel, [self.my_numel] * self.size,
                               group=self.group)
        updates: list[torch.Tensor | None] = [None] * len(shards)
        start = 0
        for i in self.send_order:
            updates[i] = result[start : start + self._shard[i]]
            start += self._shard[i]
        return updates  # type: ignore[return-value]
