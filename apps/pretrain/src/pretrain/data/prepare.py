"""``pretrain prepare-data``: text files to a token directory.

Text is tokenized with a Hugging Face ``tokenizers`` JSON file, or as raw bytes
(vocab 256) without one. Ids are written as ``uint16`` when the vocabulary fits,
else ``uint32``, into shards of at most ``shard_tokens`` tokens, and the sidecar
is written last so an interrupted run never looks complete. The input files are
concatenated in the order given, with nothing inserted between them.

Files are streamed in blocks cut after a newline, so memory stays bounded for
large inputs; a tokenizer therefore never sees a merge across a line break,
which is how the common BPE pre-tokenizers split text anyway. Each file is
tokenized as one text: a tokenizer that marks the start of a text (a prepended
``▁`` or space, as Llama- and Mistral-style ones do) gets each later block behind
the newline that ends the block before it, and those ids are dropped, so no block
boundary adds a token (checked for every block).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.data.files import (
    DTYPES,
    SIDECAR,
    TOKENIZER_FILE,
    DataError,
    dtype_for_vocab,
    write_sidecar,
)

BLOCK_BYTES = 1 << 20  # text read per block (cut after the last newline)
BATCH_BLOCKS = 16  # blocks tokenized per encode_batch call (the tokenizer parallelises them)


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    dtype: str
    vocab_size: int
    n_tokens: int
    files: list[dict[str, Any]]


def _byte_blocks(path: Path) -> Iterator[np.ndarray]:
    with path.open("rb") as f:
        while block := f.read(BLOCK_BYTES):
            yield np.frombuffer(block, dtype=np.uint8)


def _text_blocks(path: Path) -> Iterator[str]:
    """UTF-8 text in blocks that end after a newline (or at the end of the file)."""

    def decode(piece: bytes, offset: int) -> str:
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{path}: not UTF-8 text at byte {offset + e.start}; "
                "omit --tokenizer to tokenize it as bytes"
            ) from None

    carry, offset = b"", 0
    with path.open("rb") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            data = carry + block
            if not block:
                if data:
                    yield decode(data, offset)
                return
            cut = data.rfind(b"\n") + 1
            carry = data[cut:]
            if cut:
                yield decode(data[:cut], offset)
                offset += cut


class _ShardWriter:
    """Appends ids to ``part-NNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, directory: Path, dtype: str, shard_tokens: int) -> None:
        self.directory, self.dtype, self.shard_tokens = directory, DTYPES[dtype], shard_tokens
        self.files: list[dict[str, Any]] = []
        self._file = None

    def write(self, ids: np.ndarray) -> None:
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:  # astype would wrap it
            raise DataError(f"token id {int(ids.max())} does not fit the shards' {self.dtype.name}")
        ids = ids.astype(self.dtype, copy=False)
        while ids.size:
            if self._file is None or self.files[-1]["tokens"] == self.shard_tokens:
                self._open_next()
            room = self.shard_tokens - self.files[-1]["tokens"]
            self._file.write(ids[:room].tobytes())
            self.files[-1]["tokens"] += min(room, ids.size)
            ids = ids[room:]

    def _open_next(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"part-{len(self.files):05d}.bin"
        self._file = (self.directory / name).open("wb")
        self.files.append({"name": name, "tokens": 0})

    def close(self) -> list[dict[str, Any]]:
        if self._file is not None:
            self._file.close()
        return self.files


def _encode_with_tokenizer(tokenizer_path: Path) -> tuple[int, Any]:
    """The vocabulary size and a ``path -> id arrays`` function for a tokenizers JSON file."""
    from tokenizers import Tokenizer  # only prepare-data needs it

    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the library raises a bare Exception on a bad file
        raise DataError(f"{tokenizer_path}: not a tokenizers JSON file: {e}") from None

    def ids(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    # A block after the first follows a newline. Where the tokenizer marks a text's start
    # ("x" alone differs from "x" after a newline), such a block is encoded behind a
    # newline whose ids are then dropped: the block's ids as they are inside the file.
    newline, after_newline, alone = ids(["\n", "\nx", "x"])
    lead = newline if after_newline != newline + alone else []

    def encode(path: Path) -> Iterator[np.ndarray]:
        blocks = _text_blocks(path)
        first = next(blocks, None)
        if first is None:
            return
        yield np.asarray(ids([first])[0], dtype=np.int64)
        while batch := list(itertools.islice(blocks, BATCH_BLOCKS)):
            for block, block_ids in zip(batch, ids(["\n" + b if lead else b for b in batch]), strict=True):
                if block_ids[:len(lead)] != lead:
                    raise DataError(
                        f"{path}: {tokenizer_path} tokenizes a newline differently before "
                        f"{block[:20]!r}; the file cannot be tokenized in blocks without "
                        "changing its ids")
                yield np.asarray(block_ids[len(lead):], dtype=np.int64)

    # the largest id + 1, not the entry count: a vocabulary's ids may have gaps
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    return max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1), encode


def _keep_tokenizer(tokenizer: Path, out: Path, written: list[Path]) -> dict[str, str]:
    """Copy the tokenizer into ``out`` (appended to ``written``); its sidecar record."""
    data = tokenizer.read_bytes()
    copy = out / TOKENIZER_FILE
    if copy.exists() and copy.read_bytes() != data:
        raise DataError(f"{copy} exists and is not {tokenizer}; choose an empty --out directory")
    if not copy.exists():
        written.append(copy)
        copy.write_bytes(data)
    return {"name": tokenizer.name, "file": TOKENIZER_FILE, "sha256": hashlib.sha256(data).hexdigest()}


def prepare_data(inputs: Sequence[Path], out: Path, tokenizer: Path | None = None,
                 shard_tokens: int = 1 << 28) -> PreparedData:
    """Tokenize ``inputs`` (in order) into the token directory ``out``."""
    if not inputs:
        raise DataError("no input files given")
    for path in inputs:
        if not path.is_file():
            raise DataError(f"input {str(path)!r} is not a file")
    if tokenizer is not None and not tokenizer.is_file():
        raise DataError(f"--tokenizer {str(tokenizer)!r} is not a file")
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {str(out)!r} is not a directory")
    if out.is_dir() and ((out / SIDECAR).exists() or any(out.glob("*.bin"))):
        raise DataError(f"{out} already holds token files; choose an empty --out directory")
    created = [p for p in (out, *out.parents) if not p.exists()]
    sidecar_tmp = out / (SIDECAR + ".tmp")
    ours = [sidecar_tmp] if not sidecar_tmp.exists() else []  # a user's file stays
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    try:
        if tokenizer is None:
            vocab_size, encode, record = 256, _byte_blocks, {"name": "bytes"}
        else:
            vocab_size, encode = _encode_with_tokenizer(tokenizer)
            record = _keep_tokenizer(tokenizer, out, ours)
        dtype = dtype_for_vocab(vocab_size)
        writer = _ShardWriter(out, dtype, shard_tokens)
        for path in inputs:
            for ids in encode(path):
                writer.write(ids)
        files = writer.close()
        n_tokens = sum(f["tokens"] for f in files)
        if n_tokens == 0:
            raise DataError("the input files hold no tokens")
        write_sidecar(out, dtype, vocab_size, files, record)
    except BaseException:  # no half-written directory that a rerun would refuse
        if writer is not None:
            try:
                writer.close()
            except OSError:  # the failed write's bytes again (a full disk): the file is closed
                pass
            ours += [out / f["name"] for f in writer.files]
        for path in ours:
            path.unlink(missing_ok=True)
        for directory in created:  # innermost first; only what this call created
            if directory.exists() and not any(directory.iterdir()):
                directory.rmdir()
        raise
    return PreparedData(out, dtype, vocab_size, n_tokens, files)
