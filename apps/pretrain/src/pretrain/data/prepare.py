"""``pretrain prepare-data``: a corpus to a token directory.

    inputs (files, directories, globs)  -> pretrain.data.inputs: files in order, read as chunks
    chunks                              -> pretrain.data.encode: ids + document starts, on
                                           ``workers`` processes, results taken in input order
    encoded chunks                      -> pretrain.data.writer: shards, document index, SHA-256
    the directory                       -> pretrain.data.output: marker while writing, sidecar
                                           last, everything removed on failure or a signal

Memory is bounded: at most ``IN_FLIGHT_PER_WORKER`` chunks per worker (about 1 MiB of
text each) are read ahead of the writer, whatever the corpus size. The bytes written
do not depend on ``workers``: chunks are cut by the reader alone, encoded
independently, and written in the order they were read.

SIGTERM (and Ctrl-C) stop the run between two statements of the main process: the
worker pool is shut down, the unfinished output removed, and ``Interrupted`` raised
(exit status 128 + the signal number, one line).
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.data.encode import (
    Chunk,
    EncodedChunk,
    Encoder,
    EncoderSpec,
    encode_in_worker,
    init_worker,
    make_spec,
)
from pretrain.data.files import DataError
from pretrain.data.inputs import expand_inputs, read_chunks
from pretrain.data.output import OutputDir
from pretrain.data.progress import Progress
from pretrain.data.writer import TokenWriter
from pretrain.errors import PretrainError

IN_FLIGHT_PER_WORKER = 2  # chunks submitted ahead per worker process
SHARD_TOKENS = 1 << 28  # tokens per part-NNNNN.bin


class Interrupted(PretrainError):
    """``prepare-data`` stopped by a signal; its exit status is 128 + the signal number."""

    def __init__(self, signum: int, directory: Path) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; removed the unfinished "
                         f"output in {directory}")
        self.exit_status = 128 + signum


@dataclass(frozen=True)
class PreparedData:
    directory: Path
    dtype: str
    vocab_size: int
    n_tokens: int
    files: list[dict[str, Any]]
    eos_id: int
    n_documents: int
    n_inputs: int
    replaced: str | None  # the earlier unfinished run whose output was replaced, if any


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _encoded_in_order(chunks: Iterator[Chunk], spec: EncoderSpec,
                      workers: int) -> Iterator[tuple[Chunk, EncodedChunk]]:
    """Each chunk with its encoding, in input order; ``workers`` > 1 encodes on that many
    processes with at most ``IN_FLIGHT_PER_WORKER * workers`` chunks read ahead."""
    if workers == 1:
        encoder = Encoder(spec)
        for chunk in chunks:
            yield chunk, encoder.encode(chunk)
        return
    # spawn: workers import only what encoding needs (a fork would copy this process,
    # threads and all)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=init_worker, initargs=(spec,))
    pending: deque[tuple[Chunk, Future[EncodedChunk]]] = deque()
    try:
        for chunk in chunks:
            # the worker needs the items; the writer only the chunk's bookkeeping
            pending.append((Chunk(chunk.file, chunk.kind, [], chunk.start, input_bytes=chunk.input_bytes),
                            pool.submit(encode_in_worker, chunk)))
            if len(pending) >= IN_FLIGHT_PER_WORKER * workers:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def _signals_raise(directory: Path) -> Iterator[None]:
    """SIGTERM and SIGINT raise ``Interrupted`` in the main thread while the body runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):  # the cleanup is not interrupted again
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum, directory)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def prepare_data(inputs: Sequence[str | Path], out: Path, tokenizer: Path | None = None, *,
                 text_field: str = "text", eos_id: int | None = None, workers: int = 1,
                 shard_tokens: int = SHARD_TOKENS, progress: bool = False) -> PreparedData:
    """Tokenize ``inputs`` (files, directories, globs; in order) into the token directory ``out``.

    ``tokenizer``: a Hugging Face ``tokenizers`` JSON file (default: bytes, end of text 256);
    ``eos_id``: the end-of-text id (default: the tokenizer's own, found among its special
    tokens); ``progress``: report progress on stderr.
    """
    if workers < 1:
        raise DataError(f"--workers must be >= 1, got {workers}")
    files = expand_inputs(inputs)
    spec = make_spec(tokenizer, eos_id, text_field)
    with _signals_raise(out):
        directory = OutputDir(out)
        bar = Progress(sum(f.size for f in files), progress)
        chunks = read_chunks(files, text_field, cut_at_newline=tokenizer is not None)
        encoded = _encoded_in_order(chunks, spec, workers)
        writer = None
        try:
            if tokenizer is None:
                record = {"name": "bytes"}
            else:
                copy, data = directory.keep_tokenizer(tokenizer)
                record = {"name": tokenizer.name, "file": copy.name,
                          "sha256": hashlib.sha256(data).hexdigest()}
            writer = TokenWriter(directory, spec.dtype, shard_tokens)
            for chunk, ids in encoded:
                writer.write(ids)
                bar.update(chunk.input_bytes)
            written = writer.close()
            if writer.n_documents == 0:
                raise DataError("the inputs hold no documents")
            bar.close(finished=True)
            directory.commit({"dtype": spec.dtype, "vocab_size": spec.vocab_size,
                              "eos_id": spec.eos_id, **written, "tokenizer": record})
        except BaseException:
            bar.close(finished=False)
            encoded.close()  # stops the workers
            chunks.close()  # closes the input file being read
            if writer is not None:
                writer.abort()
            directory.discard()
            raise
    return PreparedData(out, spec.dtype, spec.vocab_size, writer.n_tokens, written["files"],
                        spec.eos_id, writer.n_documents, len(files), directory.replaced)
