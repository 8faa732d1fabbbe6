"""Text to token ids for ``prepare-data``: bytes or a Hugging Face tokenizer, one chunk at a time.

The reader (``pretrain.data.inputs``) cuts the corpus into ``Chunk``s; ``Encoder.encode``
turns one into the token ids it contributes (every finished document followed by the
end-of-text id) and the offsets, within those ids, where its documents start. A chunk
needs nothing from its neighbours, so chunks can be encoded by any number of worker
processes and written in input order: the output does not depend on the number of
workers.

This module is what a worker process imports: numpy, ``json`` and ``tokenizers``
only (no torch, no pyarrow), so workers start quickly and stay small. A chunk's texts
go to the tokenizer in one ``encode_batch_fast`` call (no character offsets: 1.6x
``encode``'s speed on one core). A worker process is one core: ``init_worker`` turns
off the tokenizer library's own thread pool there (its ``TOKENIZERS_PARALLELISM``),
which would otherwise start a thread per core in every worker. Encoding in the
calling process (one worker) leaves that process's environment alone.

End of text: without a tokenizer the ids are the bytes and the end-of-text id is
256 (``BYTES_EOS_ID``), so byte data has a vocabulary of 257. With a tokenizer it
is the first of ``EOS_TOKENS`` that the tokenizer declares as a special token,
unless ``--eos-id`` names one.

Plain-text documents arrive in blocks cut after a newline. A tokenizer that marks a
text's start (a prepended ``▁`` or space, as Llama- and Mistral-style ones do) gets
each later block of a document behind a newline whose ids are then dropped, so the
ids of a block are those it has inside the whole document (checked for every block).
A tokenizer therefore never sees a merge across a line break, which is how the
common BPE pre-tokenizers split text anyway.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pretrain.data.files import DataError, dtype_for_vocab

BYTES_VOCAB = 256
BYTES_EOS_ID = 256  # the end-of-text id of byte data: one past the bytes
# special tokens that end a text, in order of preference (GPT-2/Qwen/Mixtral..., Llama 3,
# SentencePiece models, Gemma, chat models)
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]",
              "<|im_end|>", "<|eot_id|>", "<|end|>")

ChunkKind = Literal["text", "jsonl", "rows"]


@dataclass(frozen=True)
class Chunk:
    """Consecutive input of one file, encoded as a unit.

    - ``text``: ``items`` is one block (``bytes``) of a plain-text document; ``start`` is
      its byte offset in the file; ``opens``/``closes``: it is the document's first/last.
    - ``jsonl``: ``items`` are raw lines (``bytes``), each one document (blank lines are
      skipped); ``start`` is the line number of the first.
    - ``rows``: ``items`` are a parquet column's values, each one document; ``start`` is
      the row number of the first (from 1).
    """

    file: str
    kind: ChunkKind
    items: list[Any]
    start: int
    opens: bool = True
    closes: bool = True
    input_bytes: int = 0  # bytes of the input file this chunk accounts for (progress)


@dataclass(frozen=True)
class EncodedChunk:
    ids: np.ndarray  # the chunk's ids in the token files' dtype, end-of-text ids included
    starts: np.ndarray  # int64 offsets into ``ids`` where the chunk's documents start


@dataclass(frozen=True)
class EncoderSpec:
    """What a worker needs to build its ``Encoder`` (small and picklable)."""

    tokenizer: str | None  # a tokenizers JSON file; None: bytes
    eos_id: int
    vocab_size: int
    text_field: str

    @property
    def dtype(self) -> str:
        return dtype_for_vocab(self.vocab_size)


def _load_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer  # only prepare-data needs it

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises a bare Exception on a bad file
        raise DataError(f"{path}: not a tokenizers JSON file: {e}") from None


def make_spec(tokenizer: Path | None, eos_id: int | None, text_field: str) -> EncoderSpec:
    """Check the tokenizer and the end-of-text id; the spec every encoder is built from."""
    if tokenizer is None:
        if eos_id is not None and eos_id < 0:
            raise DataError(f"--eos-id must be >= 0, got {eos_id}")
        eos = BYTES_EOS_ID if eos_id is None else eos_id
        return EncoderSpec(None, eos, max(BYTES_VOCAB, eos + 1), text_field)
    if not tokenizer.is_file():
        raise DataError(f"--tokenizer {str(tokenizer)!r} is not a file")
    tok = _load_tokenizer(tokenizer)
    # the largest id + 1, not the entry count: a vocabulary's ids may have gaps
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
    if eos_id is None:
        special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        found = [special[name] for name in EOS_TOKENS if name in special]
        if not found:
            raise DataError(
                f"{tokenizer}: no end-of-text token among its special tokens (looked for "
                f"{', '.join(EOS_TOKENS)}); name its id with --eos-id")
        eos_id = found[0]
    elif not 0 <= eos_id < vocab_size:
        raise DataError(f"--eos-id {eos_id} is not an id of {tokenizer} (vocabulary of {vocab_size})")
    return EncoderSpec(str(tokenizer), eos_id, vocab_size, text_field)


class Encoder:
    """Encodes chunks per ``EncoderSpec`` (one per process)."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.dtype = np.dtype(spec.dtype).newbyteorder("<")
        self._tokenizer = None if spec.tokenizer is None else _load_tokenizer(Path(spec.tokenizer))
        self._lead: list[int] = []
        if self._tokenizer is not None:
            # Where the tokenizer marks a text's start ("x" alone differs from "x" after a
            # newline), a block after the first is encoded behind a newline whose ids are
            # then dropped: the block's ids as they are inside the document.
            newline, after_newline, alone = self._ids(["\n", "\nx", "x"])
            self._lead = newline if after_newline != newline + alone else []

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def _documents(self, texts: list[str]) -> list[np.ndarray]:
        """Whole documents' ids (JSONL lines' or parquet rows' texts)."""
        if self._tokenizer is None:
            return [np.frombuffer(t.encode("utf-8", "surrogatepass"), dtype=np.uint8) for t in texts]
        return [np.asarray(ids, dtype=np.int64) for ids in self._ids(texts)]

    def _block(self, chunk: Chunk) -> np.ndarray:
        """A plain-text block's ids (``chunk.kind == "text"``)."""
        block = chunk.items[0]
        if self._tokenizer is None:
            return np.frombuffer(block, dtype=np.uint8)
        try:
            text = block.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{chunk.file}: not UTF-8 text at byte {chunk.start + e.start}; "
                            "omit --tokenizer to tokenize it as bytes") from None
        if chunk.opens or not self._lead:
            return np.asarray(self._ids([text])[0], dtype=np.int64)
        ids = self._ids(["\n" + text])[0]
        if ids[:len(self._lead)] != self._lead:
            raise DataError(
                f"{chunk.file}: {self.spec.tokenizer} tokenizes a newline differently before "
                f"{text[:20]!r} (byte {chunk.start}); the file cannot be tokenized in blocks "
                "without changing its ids")
        return np.asarray(ids[len(self._lead):], dtype=np.int64)

    def _texts(self, chunk: Chunk) -> list[tuple[int, str]]:
        """(line or row number, text) of each document of a ``jsonl`` or ``rows`` chunk."""
        field = self.spec.text_field
        if chunk.kind == "rows":
            for offset, value in enumerate(chunk.items):
                if not isinstance(value, str):
                    raise DataError(f"{chunk.file}: row {chunk.start + offset}: column {field!r} "
                                    f"is {'null' if value is None else type(value).__name__}, not text")
            return list(enumerate(chunk.items, chunk.start))
        texts = []
        for line_no, line in enumerate(chunk.items, chunk.start):
            if not line.strip():
                continue
            where = f"{chunk.file}:{line_no}"
            try:
                record = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
                raise DataError(f"{where}: not a JSON line: {e}") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a JSON line must hold an object, got {type(record).__name__}")
            if field not in record:
                raise DataError(f"{where}: no {field!r} field (--text-field); the line has "
                                f"{', '.join(map(repr, list(record)[:5])) or 'no fields'}")
            if not isinstance(record[field], str):
                raise DataError(f"{where}: field {field!r} is {type(record[field]).__name__}, not a string")
            texts.append((line_no, record[field]))
        return texts

    def encode(self, chunk: Chunk) -> EncodedChunk:
        """The chunk's ids (each closed document followed by the end-of-text id) and where
        its documents start."""
        if chunk.kind == "text":
            pieces = [self._block(chunk)]
            ends = [chunk.closes]
            opens = [chunk.opens]
        else:
            pieces = self._documents([text for _, text in self._texts(chunk)])
            ends = opens = [True] * len(pieces)
        eos = np.array([self.spec.eos_id], dtype=np.int64)
        parts, starts, length = [], [], 0
        for ids, opened, closed in zip(pieces, opens, ends, strict=True):
            if opened:
                starts.append(length)
            parts.append(ids)
            length += ids.shape[0]
            if closed:
                parts.append(eos)
                length += 1
        out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if out.size and int(out.max()) >= self.spec.vocab_size:  # astype would wrap it
            raise DataError(f"{chunk.file}: token id {int(out.max())} is outside the vocabulary "
                            f"of {self.spec.vocab_size}")
        return EncodedChunk(out.astype(self.dtype), np.asarray(starts, dtype=np.int64))


_WORKER_ENCODER: Encoder | None = None


def init_worker(spec: EncoderSpec) -> None:
    """Worker-process initialiser: build the encoder once; one core per worker (module
    docstring); Ctrl-C is the parent's to handle."""
    import os
    import signal

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(spec)


def encode_in_worker(chunk: Chunk) -> EncodedChunk:
    assert _WORKER_ENCODER is not None, "init_worker did not run"
    return _WORKER_ENCODER.encode(chunk)
