"""Token shards and the document index of a token directory, written in order with checksums.

Ids go to ``part-NNNNN.bin`` files of at most ``shard_tokens`` tokens; the token offset
of each document's start (in the stream of all shards) goes to ``documents.u64``. Each
file's SHA-256 is computed from the bytes as they are written (no second read), for
``tokens.json``.
"""

from __future__ import annotations

import hashlib
from typing import Any, BinaryIO

import numpy as np

from pretrain.data.encode import EncodedChunk
from pretrain.data.files import DOCUMENTS_FILE
from pretrain.data.output import OutputDir


class _HashedFile:
    def __init__(self, out: OutputDir, name: str) -> None:
        self.name = name
        self.file: BinaryIO = out.create(name).open("wb")
        self.sha256 = hashlib.sha256()

    def write(self, data: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        self.file.write(view)
        self.sha256.update(view)

    def close(self) -> None:
        self.file.close()


class TokenWriter:
    def __init__(self, out: OutputDir, dtype: str, shard_tokens: int) -> None:
        self.out, self.shard_tokens = out, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.files: list[dict[str, Any]] = []
        self.n_tokens = self.n_documents = 0
        self._shard: _HashedFile | None = None
        self._documents = _HashedFile(out, DOCUMENTS_FILE)

    def write(self, chunk: EncodedChunk) -> None:
        self._documents.write((chunk.starts + self.n_tokens).astype("<u8"))
        self.n_documents += chunk.starts.shape[0]
        ids = chunk.ids.astype(self.dtype, copy=False)
        self.n_tokens += ids.shape[0]
        while ids.size:
            if self._shard is None or self.files[-1]["tokens"] == self.shard_tokens:
                self._next_shard()
            room = self.shard_tokens - self.files[-1]["tokens"]
            self._shard.write(ids[:room])
            self.files[-1]["tokens"] += min(room, ids.size)
            ids = ids[room:]

    def _next_shard(self) -> None:
        self._finish_shard()
        self._shard = _HashedFile(self.out, f"part-{len(self.files):05d}.bin")
        self.files.append({"name": self._shard.name, "tokens": 0})

    def _finish_shard(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self.files[-1]["sha256"] = self._shard.sha256.hexdigest()
            self._shard = None

    def close(self) -> dict[str, Any]:
        """Close every file; the sidecar's ``files`` and ``documents`` entries."""
        self._finish_shard()
        self._documents.close()
        return {"files": self.files,
                "documents": {"file": DOCUMENTS_FILE, "count": self.n_documents,
                              "sha256": self._documents.sha256.hexdigest()}}

    def abort(self) -> None:
        """Close the files after a failure (a failed write's buffered bytes may fail again on
        close: the file is closed regardless, and ``OutputDir.discard`` removes it)."""
        for handle in (self._shard, self._documents):
            if handle is not None:
                try:
                    handle.close()
                except OSError:
                    pass
