"""Tensorstore arrays of a checkpoint: zarr v3 arrays of each tensor's global shape.

Two key-value layouts, chosen per checkpoint and recorded in its manifest:

- ``"file"``: plain zarr v3 under ``<checkpoint>/arrays/<tensor>/``, one file per
  chunk. Each logical tensor is one array that all ranks write into (rank 0
  creates it), readable by any zarr v3 reader.
- ``"ocdbt"``: chunks packed into a few large data files of an OCDBT database,
  one database per writing rank under ``<checkpoint>/ocdbt/rank<r>/``. Each holds
  the tensor as an array of its global shape in which only that rank's pieces
  are present; the manifest records each piece's writer. Per-rank databases
  because uncoordinated writers sharing one database serialise on its manifest
  (measured: see the README) and a coordinator server is one more service to run.

Keys are relative to the checkpoint directory, so a checkpoint can be renamed (the
atomic commit does) or moved. One ``ts.Context`` per save or load: it is what
lets all arrays of a rank share one OCDBT writer instead of racing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import tensorstore as ts

from moe_ckpt.errors import CheckpointError

KvStoreKind = Literal["ocdbt", "file"]
KVSTORE_KINDS: tuple[str, ...] = ("ocdbt", "file")


def per_writer(kvstore: str) -> bool:
    """Whether each writing rank has its own copy of every array it writes into."""
    return kvstore == "ocdbt"


@dataclass(frozen=True)
class StorageOptions:
    kvstore: KvStoreKind = "ocdbt"  # "ocdbt": few large files; "file": one file per chunk
    target_chunk_bytes: int = 64 << 20  # upper bound of a zarr chunk
    min_chunk_bytes: int = 1 << 20  # below this, chunks stop aligning to shard boundaries

    def __post_init__(self) -> None:
        if self.kvstore not in KVSTORE_KINDS:
            raise ValueError(
                f"StorageOptions.kvstore must be one of {KVSTORE_KINDS}, got {self.kvstore!r}"
            )
        if self.target_chunk_bytes < 1 or self.min_chunk_bytes < 0:
            raise ValueError("StorageOptions: target_chunk_bytes >= 1 and min_chunk_bytes >= 0")


NAME_MAX = 255  # bytes in one file name on the common Linux file systems (ext4, xfs)


def array_key(name: str, kvstore: str | None = None) -> str:
    """A storage key for a tensor name: percent-encoded, so any name maps to one path part.

    With ``kvstore="file"`` that part is a directory name, which the file system caps
    at ``NAME_MAX`` bytes; ``ocdbt`` keys live inside its own files and have no cap.
    """
    key = quote(name, safe="")
    if key in (".", ".."):
        raise ValueError(f"tensor name {name!r} cannot be stored (reserved path name)")
    if kvstore == "file" and len(key) > NAME_MAX:
        raise ValueError(
            f"tensor name {name[:60]!r}... is {len(key)} bytes percent-encoded, over the "
            f"{NAME_MAX} of a file name: the 'file' layout cannot store it; use "
            "StorageOptions(kvstore='ocdbt') or a shorter name"
        )
    return key


def check_key(name: str, key: str) -> str:
    """``key`` read from a manifest, if it is one path part inside the checkpoint (as
    ``array_key`` makes them); an absolute path, ``..`` or a separator could read or
    write outside it."""
    if key in ("", ".", "..") or "/" in key or "\\" in key or "\0" in key:
        raise CheckpointError(
            f"tensor {name!r}: storage key {key!r} is not a name inside the checkpoint "
            "(an absolute path, '..' or a separator); the manifest cannot be trusted"
        )
    return key


def _spec(checkpoint_dir: Path, kvstore: str, key: str, writer: int) -> dict:
    root = Path(checkpoint_dir).absolute()
    if kvstore == "ocdbt":
        base = {"driver": "file", "path": f"{root / 'ocdbt' / f'rank{writer}'}/"}
        kv = {"driver": "ocdbt", "base": base, "path": f"{key}/"}
    else:
        kv = {"driver": "file", "path": f"{root / 'arrays' / key}/"}
    return {"driver": "zarr3", "kvstore": kv}


def new_context() -> ts.Context:
    return ts.Context()


def create_array(
    ctx: ts.Context,
    checkpoint_dir: Path,
    kvstore: str,
    key: str,
    shape: tuple[int, ...],
    dtype: str,
    chunk_shape: tuple[int, ...],
    writer: int,
) -> ts.Future:
    """Create an array (``writer`` picks the database of a per-writer layout)."""
    return ts.open(
        _spec(checkpoint_dir, kvstore, key, writer),
        create=True,
        dtype=ts.dtype(dtype),
        shape=list(shape),
        chunk_layout=ts.ChunkLayout(chunk_shape=list(chunk_shape)),
        context=ctx,
    )


def open_array(
    ctx: ts.Context, checkpoint_dir: Path, kvstore: str, key: str, writer: int
) -> ts.Future:
    return ts.open(_spec(checkpoint_dir, kvstore, key, writer), open=True, context=ctx)
