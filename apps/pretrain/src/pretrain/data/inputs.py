"""The corpus of ``prepare-data``: input arguments to files, files to chunks of documents.

Arguments are taken in the order given; each is a file, a directory (every file under
it, recursively, in sorted path order; names starting with ``.`` are skipped) or a
glob (``corpus/**/*.jsonl.gz``, matches sorted). A file's format comes from its name:

- ``*.jsonl``, ``*.jsonl.gz``: one document per line, the text in a field
  (``--text-field``, default ``text``); blank lines are skipped.
- ``*.parquet``: one document per row, the text in the column of that name, read in
  row batches with pyarrow.
- anything else: plain text, the whole file one document, read in blocks.

Other compressed files (``.gz``, ``.zst``, ``.bz2``, ``.xz``, ``.zip`` not after
``.jsonl``) are refused rather than tokenized as bytes. Reading streams: at most one
block, line batch or row batch of a file is held at a time, so memory does not grow
with the corpus. Every error names the file and, where there is one, the line or row.
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from pretrain.data.encode import Chunk
from pretrain.data.files import DataError

BLOCK_BYTES = 1 << 20  # plain text read per chunk (cut after the last newline with a tokenizer)
CHUNK_BYTES = 1 << 20  # JSONL lines / parquet text gathered per chunk
MAX_LINE_BYTES = 1 << 26  # a plain-text line longer than this cannot be cut into blocks
PARQUET_BATCH_ROWS = 1024  # rows read from a parquet file at a time
COMPRESSED = (".gz", ".zst", ".zstd", ".bz2", ".xz", ".zip", ".lz4", ".7z")

Format = Literal["text", "jsonl", "jsonl.gz", "parquet"]


@dataclass(frozen=True)
class InputFile:
    path: Path
    format: Format
    size: int  # bytes on disk (progress)


def file_format(path: Path) -> Format:
    name = path.name.lower()
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".jsonl.gz"):
        return "jsonl.gz"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(COMPRESSED):
        raise DataError(f"{path}: compressed files other than .jsonl.gz are not read; "
                        "decompress it, or store its text as .jsonl.gz")
    return "text"


def _under(directory: Path) -> list[Path]:
    """Every file under ``directory``, recursively, sorted by path; hidden names skipped."""
    found = []
    for root, dirs, names in os.walk(directory, onerror=_walk_error, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root, n) for n in names if not n.startswith(".")]
    return sorted(found)


def _walk_error(error: OSError) -> None:
    raise DataError(f"{error.filename}: cannot list: {error.strerror or error}")


def expand_inputs(arguments: Sequence[str | Path]) -> list[InputFile]:
    """The input files named by files, directories and globs, in order (duplicates kept once)."""
    if not arguments:
        raise DataError("no inputs given")
    paths: list[Path] = []
    for argument in arguments:
        text, path = str(argument), Path(argument)
        if path.is_dir():
            found = _under(path)
            if not found:
                raise DataError(f"input directory {text!r} holds no files")
        elif path.exists() or os.path.lexists(path):
            found = [path]
        elif glob.has_magic(text):
            found = []
            for match in sorted(glob.glob(text, recursive=True)):
                found += _under(Path(match)) if Path(match).is_dir() else [Path(match)]
            if not found:
                raise DataError(f"input {text!r} matches no files")
        else:
            raise DataError(f"input {text!r} does not exist")
        paths += found
    seen, files = set(), []
    for path in paths:
        key = os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
        if not path.is_file():
            raise DataError(f"input {str(path)!r} is not a file")
        files.append(InputFile(path, file_format(path), size))
    return files


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None


def _text_chunks(file: InputFile, cut_at_newline: bool) -> Iterator[Chunk]:
    """One document in blocks; with ``cut_at_newline`` each block ends after a newline (or
    at the end of the file), so a tokenizer sees whole lines."""
    name, offset, carry = str(file.path), 0, b""
    with _open(file.path) as f:
        while True:
            try:
                block = f.read(BLOCK_BYTES)
            except OSError as e:
                raise DataError(f"{name}: cannot read at byte {offset + len(carry)}: "
                                f"{e.strerror or e}") from None
            data = carry + block
            if not block:  # the end of the file: the document's last block (maybe empty)
                yield Chunk(name, "text", [data], offset, opens=offset == 0, closes=True,
                            input_bytes=len(data))
                return
            cut = data.rfind(b"\n") + 1 if cut_at_newline else len(data)
            if not cut:
                if len(data) > MAX_LINE_BYTES:
                    raise DataError(f"{name}: a line longer than {MAX_LINE_BYTES >> 20} MiB at "
                                    f"byte {offset}; plain text is tokenized in blocks cut "
                                    "after a newline")
                carry = data
                continue
            carry = data[cut:]
            yield Chunk(name, "text", [data[:cut]], offset, opens=offset == 0, closes=False,
                        input_bytes=cut)
            offset += cut


def _jsonl_chunks(file: InputFile) -> Iterator[Chunk]:
    """Raw lines in chunks of about ``CHUNK_BYTES`` (the workers parse them)."""
    name = str(file.path)
    raw = _open(file.path)
    stream: Any = gzip.GzipFile(fileobj=raw, mode="rb") if file.format == "jsonl.gz" else raw
    lines: list[bytes] = []
    first, line_no, size, accounted = 1, 0, 0, 0
    try:
        with raw, stream:
            while True:
                try:
                    line = stream.readline()
                except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
                    what = "corrupt gzip data" if file.format == "jsonl.gz" else "cannot read"
                    raise DataError(f"{name}:{line_no + 1}: {what}: {e}") from None
                if line:
                    line_no += 1
                    lines.append(line)
                    size += len(line)
                if lines and (size >= CHUNK_BYTES or not line):
                    position = raw.tell() if line else file.size
                    yield Chunk(name, "jsonl", lines, first, input_bytes=position - accounted)
                    accounted, first, lines, size = position, line_no + 1, [], 0
                if not line:
                    return
    except OSError as e:  # closing a truncated gzip stream
        raise DataError(f"{name}:{line_no}: corrupt gzip data: {e}") from None


def _parquet_chunks(file: InputFile, field: str) -> Iterator[Chunk]:
    """A column's values in chunks of about ``CHUNK_BYTES``, read ``PARQUET_BATCH_ROWS`` rows
    at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(file.path)
    try:
        parquet = pq.ParquetFile(file.path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{name}: not a readable parquet file: {e}") from None
    schema = parquet.schema_arrow
    if schema.get_field_index(field) < 0:
        columns = ", ".join(repr(c) for c in schema.names[:8]) or "none"
        raise DataError(f"{name}: no column {field!r} (--text-field); its columns: {columns}")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        raise DataError(f"{name}: column {field!r} holds {kind}, not text")
    total_rows = max(parquet.metadata.num_rows, 1)
    values: list[str | None] = []
    first, row, size, accounted = 1, 0, 0, 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                values.append(value)
                size += len(value) if isinstance(value, str) else 0
                if size >= CHUNK_BYTES:
                    position = file.size * row // total_rows
                    yield Chunk(name, "rows", values, first, input_bytes=position - accounted)
                    accounted, first, values, size = position, row + 1, [], 0
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{name}: row {row + 1}: cannot read: {e}") from None
    if values:
        yield Chunk(name, "rows", values, first, input_bytes=file.size - accounted)


def read_chunks(files: Sequence[InputFile], text_field: str, cut_at_newline: bool) -> Iterator[Chunk]:
    """Every document of ``files``, in order, as chunks for ``Encoder.encode``."""
    for file in files:
        if file.format == "text":
            yield from _text_chunks(file, cut_at_newline)
        elif file.format == "parquet":
            yield from _parquet_chunks(file, text_field)
        else:
            yield from _jsonl_chunks(file)
