"""Loading: any box or flat run of any stored tensor, verified, into the caller's tensors.

Loading needs no collectives: each rank reads the manifest and the pieces that
intersect its targets. Every piece is checked against its CRC-32 and every target
element must be covered by stored pieces, so a load either fills all targets with
verified data or raises. A piece that lands whole in one CPU target is read
straight into the target's memory and verified there, so after an error the
targets hold unverified bytes: discard them.

Reads run ahead of verification by up to ``max_inflight_bytes`` so tensorstore
keeps the disk busy while pieces are hashed and copied by a thread pool.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from moe_ckpt import storage
from moe_ckpt.boxes import Box
from moe_ckpt.directory import is_partial_name
from moe_ckpt.dtypes import from_numpy, itemsize, to_numpy, torch_dtype
from moe_ckpt.errors import (
    CheckpointError,
    ChecksumError,
    IncompleteCheckpointError,
    MissingTensorError,
    TensorMismatchError,
)
from moe_ckpt.host import crc32
from moe_ckpt.manifest import Manifest, PieceRecord, TensorRecord, read_manifest
from moe_ckpt.shards import Described, Region, ShardLike, describe
from moe_ckpt.tree import StateTree, fill_values, flatten


@dataclass
class _PieceRead:
    record: TensorRecord
    piece: PieceRecord
    targets: list[tuple[Region, Box]]  # (target region, its intersection with the piece)

    def direct_target(self) -> np.ndarray | None:
        """The target memory itself when the whole piece goes to one CPU region.

        Reading straight into it saves a copy; the checksum is then verified in
        place (after an error, targets hold unverified bytes: see the module notes).
        """
        if len(self.targets) != 1:
            return None
        region, inter = self.targets[0]
        if inter != self.piece.box or region.view.device.type != "cpu":
            return None
        return to_numpy(region.view.detach()[inter.slices(region.box)])


def open_checkpoint(checkpoint_dir: str | os.PathLike) -> Manifest:
    """The manifest of a committed checkpoint; refuses partial directories."""
    path = Path(checkpoint_dir)
    if is_partial_name(path.name):
        raise IncompleteCheckpointError(f"{path} is a partial (uncommitted) checkpoint")
    if not path.is_dir():
        raise IncompleteCheckpointError(f"{path} is not a checkpoint directory")
    return read_manifest(path)


def _check_target(manifest: Manifest, d: Described, path: Path) -> TensorRecord:
    rec = manifest.tensors.get(d.name)
    if rec is None:
        known = ", ".join(sorted(manifest.tensors)[:8])
        raise MissingTensorError(
            f"tensor {d.name!r} is not in checkpoint {path} ({len(manifest.tensors)} tensors: {known}...)"
        )
    if rec.shape != d.global_shape:
        raise TensorMismatchError(
            f"tensor {d.name!r}: checkpoint {path} holds global shape {rec.shape}, "
            f"the target asks for {d.global_shape}"
        )
    if rec.dtype != d.dtype:
        raise TensorMismatchError(
            f"tensor {d.name!r}: checkpoint {path} holds {rec.dtype}, the target is {d.dtype}"
        )
    return rec


def _plan_reads(rec: TensorRecord, d: Described) -> list[_PieceRead]:
    reads: dict[int, _PieceRead] = {}
    for region in d.regions:
        covered = 0
        for i, piece in enumerate(rec.pieces):
            inter = piece.box.intersect(region.box)
            if inter is not None:
                reads.setdefault(i, _PieceRead(rec, piece, [])).targets.append((region, inter))
                covered += inter.volume
        if covered != region.box.volume:
            raise IncompleteCheckpointError(
                f"tensor {d.name!r}: stored pieces cover {covered} of the {region.box.volume} "
                f"elements of the requested box {region.box.offset}+{region.box.shape}"
            )
    return [reads[i] for i in sorted(reads)]


def _apply(read: _PieceRead, data: np.ndarray, direct: bool, where: str) -> None:
    """Verify one piece, then copy its intersections into the target views (unless read there)."""
    rec, piece = read.record, read.piece
    if crc32(data) != piece.crc32:
        raise ChecksumError(
            f"tensor {rec.name!r}: checksum mismatch in the piece at {piece.box.offset} of "
            f"shape {piece.box.shape} (written by rank {piece.rank}; array {rec.key!r} {where})"
        )
    if direct:
        return
    src = from_numpy(data, rec.dtype)
    with torch.no_grad():  # grad mode is per thread: targets may be parameters
        for region, inter in read.targets:
            region.view[inter.slices(region.box)].copy_(src[inter.slices(piece.box)])


def load(
    checkpoint_dir: str | os.PathLike,
    targets: Mapping[str, StateTree],
    *,
    max_inflight_bytes: int = 1 << 30,
) -> Manifest:
    """Fill each target's ``local`` in place from a committed checkpoint; return its manifest.

    Targets are ``ShardLike`` (a box or a flat run of the global tensor) or whole
    tensors, in nested mappings if saved so (``moe_ckpt.tree``: plain values there are
    replaced by the saved ones); the stored layout does not matter. Raises ``MissingTensorError``,
    ``TensorMismatchError`` (global shape or dtype), ``ChecksumError``,
    ``IncompleteCheckpointError`` (not committed, or data missing), each naming the
    tensor or file.
    """
    path = Path(checkpoint_dir)
    manifest = open_checkpoint(path)
    tensors, _ = flatten(targets)
    _load_into(path, manifest, tensors, max_inflight_bytes)
    fill_values(targets, manifest.values, str(path))
    return manifest


def _load_into(
    path: Path,
    manifest: Manifest,
    targets: Mapping[str, ShardLike | torch.Tensor],
    max_inflight_bytes: int,
) -> None:
    described = {name: describe(name, t, rank=0) for name, t in targets.items()}
    reads = []
    for d in described.values():
        reads += _plan_reads(_check_target(manifest, d, path), d)
    where = f"in the {manifest.kvstore} layout of {path}"
    ctx = storage.new_context()
    arrays: dict[tuple[str, int], Any] = {}
    reading: deque[tuple[_PieceRead, Any, np.ndarray | None, int]] = deque()
    applying: deque[tuple[Future, int]] = deque()
    held_bytes = 0

    def read_done() -> None:
        read, fut, direct, nbytes = reading.popleft()
        try:
            value = fut.result()
        except Exception as e:  # noqa: BLE001 - name the tensor, keep the cause
            raise CheckpointError(
                f"tensor {read.record.name!r}: reading the piece at {read.piece.box.offset} of "
                f"shape {read.piece.box.shape} (array {read.record.key!r} {where}) failed: {e}"
            ) from e
        data = value if direct is None else direct
        applying.append((pool.submit(_apply, read, data, direct is not None, where), nbytes))

    def apply_done() -> None:
        nonlocal held_bytes
        fut, nbytes = applying.popleft()
        fut.result()
        held_bytes -= nbytes

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for read in reads:
            rec = read.record
            writer = read.piece.rank if storage.per_writer(manifest.kvstore) else 0
            if (rec.name, writer) not in arrays:
                try:
                    arrays[rec.name, writer] = storage.open_array(
                        ctx, path, manifest.kvstore, rec.key, writer
                    ).result()
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(
                        f"tensor {rec.name!r}: cannot open array {rec.key!r} {where}: {e}"
                    ) from e
            nbytes = read.piece.box.volume * itemsize(rec.dtype)
            source = arrays[rec.name, writer][read.piece.box.slices()]
            direct = read.direct_target()
            if direct is None:
                fut = source.read(order="C")
            else:
                fut = ts.array(direct, copy=False, write=True).write(source)
            reading.append((read, fut, direct, nbytes))
            held_bytes += nbytes
            while held_bytes > max_inflight_bytes and len(reading) + len(applying) > 1:
                if reading and not (applying and applying[0][0].done()):
                    read_done()
                else:
                    apply_done()
        while reading:
            read_done()
        while applying:
            apply_done()


def read_tensors(
    checkpoint_dir: str | os.PathLike, names: Iterable[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole stored tensors on the CPU, verified, one at a time (export, inspection)."""
    path = Path(checkpoint_dir)
    manifest = open_checkpoint(path)
    for name in names:
        rec = manifest.tensors.get(name)
        if rec is None:
            raise MissingTensorError(f"tensor {name!r} is not in checkpoint {path}")
        out = torch.empty(rec.shape, dtype=torch_dtype(rec.dtype))
        _load_into(path, manifest, {name: out}, max_inflight_bytes=1 << 30)
        yield name, out


def read_tensor(checkpoint_dir: str | os.PathLike, name: str) -> torch.Tensor:
    """One whole stored tensor on the CPU, verified."""
    return next(read_tensors(checkpoint_dir, [name]))[1]
