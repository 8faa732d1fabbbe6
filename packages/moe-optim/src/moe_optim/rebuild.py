"""Rebuilding the compute weights from the FP32 main weights after an update.

Sharded tensors: per (replica group, compute dtype, device) the owned shards are
cast into this rank's region of a flat buffer and one in-place
``all_gather_into_tensor`` fills the other regions; each parameter is then
copied out of the ``G`` regions (owner-major, as in the gradient buckets).
Buffers are capped in size and at most two are in flight, so the transient
memory stays bounded whatever the model size. Replicated tensors are copied
from their local main weight directly, except an FP32 one, which is its main weight
(``TensorLayout.main_is_param``) and has nothing to copy. Collectives are issued in a fixed order
(the parameter order), identical on all ranks of a group.

Shape legend: G ranks in the replica group, N elements of one rank's region.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_optim.sharding import TensorLayout

_ALIGN_NUMEL = 16


@dataclass
class _Chunk:
    group: dist.ProcessGroup
    size: int
    rank: int
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)  # indices into the layout list
    offsets: list[int] = field(default_factory=list)
    region_numel: int = 0


def _aligned(n: int) -> int:
    return -(-n // _ALIGN_NUMEL) * _ALIGN_NUMEL


class WeightRebuilder:
    def __init__(self, layouts: list[TensorLayout], mains: list[torch.Tensor], cap_bytes: int) -> None:
        self._layouts, self._mains = layouts, mains
        self._replicated = [i for i, lay in enumerate(layouts)
                            if not lay.sharded and not lay.main_is_param]
        self._chunks: list[_Chunk] = []
        open_chunks: dict[tuple, _Chunk] = {}
        for i, lay in enumerate(layouts):
            if not lay.sharded:
                continue
            key = (id(lay.group), lay.param.dtype, lay.param.device)
            chunk = open_chunks.get(key)
            grown = _aligned(chunk.region_numel) + lay.local_numel if chunk else 0
            if chunk is not None and grown * lay.group_size * lay.param.element_size() > cap_bytes:
                chunk = None
            if chunk is None:
                chunk = _Chunk(lay.group, lay.group_size, lay.rank, lay.param.dtype, lay.param.device)
                open_chunks[key] = chunk
                self._chunks.append(chunk)
            offset = _aligned(chunk.region_numel)
            chunk.members.append(i)
            chunk.offsets.append(offset)
            chunk.region_numel = offset + lay.local_numel
        for chunk in self._chunks:
            chunk.region_numel = _aligned(chunk.region_numel)

    def sent_bytes(self) -> dict[tuple[int, ...], int]:
        """Bytes this rank sends per group per rebuild (ring all-gather: (G-1) regions)."""
        out: dict[tuple[int, ...], int] = {}
        for chunk in self._chunks:
            key = tuple(dist.get_process_group_ranks(chunk.group))
            nbytes = (chunk.size - 1) * chunk.region_numel * chunk.dtype.itemsize
            out[key] = out.get(key, 0) + nbytes
        return out

    @torch.no_grad()
    def run(self) -> None:
        if self._replicated:
            torch._foreach_copy_(
                [self._layouts[i].param.view(-1) for i in self._replicated],
                [self._mains[i] for i in self._replicated],
            )
        in_flight: deque[tuple[_Chunk, torch.Tensor, dist.Work]] = deque()
        for chunk in self._chunks:
            in_flight.append(self._launch(chunk))
            if len(in_flight) > 2:
                self._unpack(*in_flight.popleft())
        while in_flight:
            self._unpack(*in_flight.popleft())

    def _launch(self, chunk: _Chunk) -> tuple[_Chunk, torch.Tensor, dist.Work]:
        flat = torch.empty(chunk.size * chunk.region_numel, dtype=chunk.dtype, device=chunk.device)
        own = flat[chunk.rank * chunk.region_numel : (chunk.rank + 1) * chunk.region_numel]
        torch._foreach_copy_(
            [own[off : off + self._mains[i].numel()] for i, off in zip(chunk.members, chunk.offsets, strict=True)],
            [self._mains[i] for i in chunk.members],
        )
        work = dist.all_gather_into_tensor(flat, own, group=chunk.group, async_op=True)
        return chunk, flat, work

    def _unpack(self, chunk: _Chunk, flat: torch.Tensor, work: dist.Work) -> None:
        work.wait()
        regions_GN = flat.view(chunk.size, chunk.region_numel)
        for i, off in zip(chunk.members, chunk.offsets, strict=True):
            lay = self._layouts[i]
            lay.param.view(chunk.size, lay.local_numel).copy_(regions_GN[:, off : off + lay.local_numel])
