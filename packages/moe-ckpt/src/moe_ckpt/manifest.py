"""The manifest: the one file that says what a checkpoint holds and how to verify it.

``manifest.json`` in the checkpoint directory records the format version, the step,
the key-value layout, and per logical tensor: storage key, global shape, dtype,
zarr chunk shape, the layout it was saved from (which rank held which box or flat
run) and one record per *piece* (a written box inside one chunk, see
``moe_ckpt.plan``) with its writer rank and the CRC-32 of its bytes in C order.
User metadata (config, data position, RNG state...) is stored as it was at the
``save`` call (``json_snapshot``), plus a per-rank list for values that differ by
rank.

The manifest is written last into the not-yet-committed directory (temp file,
fsync, rename), so a directory with a manifest under its final name is complete. It
carries the SHA-256 of its other fields (canonical JSON): an edited or damaged manifest
is refused, as is one whose step disagrees with its ``step_N`` directory name, and a
tensor's storage key must be one path part inside the checkpoint (never an absolute
path or ``..``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_ckpt.boxes import Box
from moe_ckpt.dtypes import itemsize
from moe_ckpt.errors import CheckpointError, IncompleteCheckpointError
from moe_ckpt.storage import check_key

FORMAT = "moe-ckpt"
FORMAT_VERSION = 2  # 2: the manifest carries the SHA-256 of itself; 1 (without) still loads
MANIFEST_NAME = "manifest.json"
CHECKSUM_KEY = "sha256"
_STEP_DIR_RE = re.compile(r"^step_(\d+)$")


def _checksum(obj: dict) -> str:
    """SHA-256 of the manifest's fields but the checksum itself, in a canonical JSON form."""
    fields = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PieceRecord:
    box: Box
    crc32: int
    rank: int

    def to_json(self) -> dict:
        return {**self.box.to_json(), "crc32": self.crc32, "rank": self.rank}

    @staticmethod
    def from_json(obj: dict) -> PieceRecord:
        return PieceRecord(Box.from_json(obj), int(obj["crc32"]), int(obj["rank"]))


@dataclass(frozen=True)
class TensorRecord:
    name: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    pieces: tuple[PieceRecord, ...]
    layout: tuple[dict, ...]  # one Held.to_json() per rank that held the tensor

    @property
    def nbytes(self) -> int:
        return itemsize(self.dtype) * math.prod(self.shape)

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "layout": list(self.layout),
            "pieces": [p.to_json() for p in self.pieces],
        }

    @staticmethod
    def from_json(name: str, obj: dict) -> TensorRecord:
        return TensorRecord(
            name=name,
            key=check_key(name, str(obj["key"])),
            shape=tuple(int(s) for s in obj["shape"]),
            dtype=str(obj["dtype"]),
            chunk_shape=tuple(int(s) for s in obj["chunk_shape"]),
            pieces=tuple(PieceRecord.from_json(p) for p in obj["pieces"]),
            layout=tuple(obj["layout"]),
        )


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds; returned by ``load``."""

    step: int | None
    kvstore: str
    world_size: int
    tensors: dict[str, TensorRecord]
    metadata: dict[str, Any] = field(default_factory=dict)
    rank_metadata: list[Any] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)  # non-tensor leaves (moe_ckpt.tree)

    def to_json(self) -> dict:
        obj = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "step": self.step,
            "kvstore": self.kvstore,
            "world_size": self.world_size,
            "metadata": self.metadata,
            "rank_metadata": self.rank_metadata,
            "values": self.values,
            "tensors": {name: rec.to_json() for name, rec in self.tensors.items()},
        }
        return {**obj, CHECKSUM_KEY: _checksum(obj)}

    @staticmethod
    def from_json(obj: dict, source: Path) -> Manifest:
        if obj.get("format") != FORMAT:
            raise CheckpointError(f"{source}: not a {FORMAT} manifest")
        version = obj.get("format_version")
        if version not in (1, FORMAT_VERSION):
            raise CheckpointError(
                f"{source}: format_version {version} is not supported (this is version {FORMAT_VERSION})"
            )
        if version >= 2 and obj.get(CHECKSUM_KEY) != _checksum(obj):
            raise CheckpointError(
                f"{source}: the manifest does not match its {CHECKSUM_KEY} (edited or damaged); "
                "the checkpoint cannot be trusted"
            )
        try:
            return Manifest(
                step=obj["step"],
                kvstore=str(obj["kvstore"]),
                world_size=int(obj["world_size"]),
                tensors={n: TensorRecord.from_json(n, t) for n, t in obj["tensors"].items()},
                metadata=dict(obj["metadata"]),
                rank_metadata=list(obj["rank_metadata"]),
                values=dict(obj.get("values", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: malformed manifest ({e!r})") from e


def json_snapshot(value: Any, what: str) -> Any:
    """``value`` as the manifest will record it (a JSON round trip), taken now.

    An asynchronous save writes its manifest later, in the background: a snapshot
    at the call keeps the caller's later changes (a live data position) out of it,
    and a value JSON cannot hold fails at the call, naming where it is.
    """
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{_unserialisable(value, what)} is not JSON-serialisable ({e})") from None


def _unserialisable(value: Any, path: str, ancestors: frozenset[int] = frozenset()) -> str:
    """The path (from ``path``) of the part of ``value`` that JSON cannot hold."""
    if isinstance(value, dict | list | tuple) and id(value) not in ancestors:
        inside = ancestors | {id(value)}
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not isinstance(key, str | int | float | bool | None):
                return f"{path} key {key!r}"
            try:
                json.dumps(item)
            except (TypeError, ValueError):
                return _unserialisable(item, f"{path}[{key!r}]", inside)
    return path


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write durably and atomically: temp file, fsync, rename, fsync the directory."""
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(MANIFEST_NAME + ".tmp")
    text = json.dumps(manifest.to_json(), separators=(",", ":"))
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def read_manifest(directory: Path) -> Manifest:
    path = Path(directory) / MANIFEST_NAME
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory} is not a committed checkpoint: {MANIFEST_NAME} is missing"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: unreadable manifest (not a JSON object)")
    manifest = Manifest.from_json(obj, path)
    named = _STEP_DIR_RE.match(Path(directory).name)
    if named and manifest.step != int(named.group(1)):
        raise CheckpointError(
            f"{path}: the manifest's step {manifest.step!r} disagrees with its directory "
            f"{Path(directory).name}; the checkpoint cannot be trusted"
        )
    return manifest


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
