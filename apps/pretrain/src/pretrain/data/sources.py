"""Where sequences come from: a token stream cut into windows, or synthetic tokens.

A source is indexable: sequence ``i`` is a fixed function of ``i`` (no iterator
state), which is what lets any rank read any slice of any global batch and a
run resume from its step number alone.

- Token streams (token files, the embedded corpus) are cut into consecutive
  windows of ``seq_len + 1`` tokens overlapping by one (the last input's target
  is the next window's first token): sequence ``i`` is
  ``tokens[i*seq_len : i*seq_len + seq_len + 1]``, crossing file boundaries.
- The embedded corpus is this interpreter's standard-library source read as
  bytes (vocab 256): no download, and every machine with Python has it.
- Synthetic tokens (throughput benchmarks) are uniform ids; sequence ``i`` comes
  from a generator seeded by ``(seed, i)``, so the stream is endless and free.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from pretrain.data.files import DataError, TokenArrays, check_token_ids, open_token_files

STDLIB = "stdlib"  # data.path of the embedded corpus
SYNTHETIC = "synthetic"  # data.path of synthetic tokens
STDLIB_NAME = "<stdlib corpus>"
SYNTHETIC_SEQUENCES = 1 << 62  # synthetic data never wraps around an epoch


class SequenceSource(Protocol):
    """Sequences of ``seq_len + 1`` token ids, addressed by index in ``[0, n_sequences)``."""

    n_sequences: int
    seq_len: int

    def read(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), seq_len + 1]`` int64 token ids."""
        ...


def python_files(root: str | Path, skip: Callable[[str], bool]) -> list[Path]:
    """The ``.py`` files under ``root`` in sorted path order (files of a folder, then its
    subfolders), not walking into a subfolder whose name ``skip`` accepts."""
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if not skip(d))
        files += [Path(directory, n) for n in sorted(names) if n.endswith(".py")]
    return files


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files (installed packages pruned, not walked)."""
    return python_files(sysconfig.get_paths()["stdlib"],
                        lambda d: d in ("site-packages", "dist-packages"))


def stdlib_tokens() -> TokenArrays:
    """All standard-library sources joined by newlines, as byte tokens."""
    files = stdlib_sources()
    if not files:
        raise DataError(
            f"no standard-library sources under {sysconfig.get_paths()['stdlib']}; "
            "set data.path to a token directory instead"
        )
    blob = b"\n".join(p.read_bytes() for p in files)
    return TokenArrays([np.frombuffer(blob, dtype=np.uint8)], [STDLIB_NAME])


class StreamSequences:
    """Consecutive overlapping windows of a token stream made of several arrays."""

    def __init__(self, tokens: TokenArrays, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        lengths = np.array([a.shape[0] for a in tokens.arrays], dtype=np.int64)
        self._ends = np.cumsum(lengths)
        self._starts = self._ends - lengths
        self.n_sequences = (tokens.n_tokens - 1) // seq_len
        if self.n_sequences < 1:
            raise DataError(
                f"the data has {tokens.n_tokens} tokens, fewer than one sequence of "
                f"train.seq_len + 1 = {seq_len + 1}"
            )

    def read(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, i in enumerate(ids):
            self._copy_window(int(i) * self.seq_len, out[row])
        return out

    def _copy_window(self, start: int, out: np.ndarray) -> None:
        filled = 0
        f = int(np.searchsorted(self._ends, start, side="right"))
        while filled < out.shape[0]:
            offset = start + filled - int(self._starts[f])
            piece = self.tokens.arrays[f][offset:offset + out.shape[0] - filled]
            out[filled:filled + piece.shape[0]] = piece
            filled += piece.shape[0]
            f += 1


class SyntheticSequences:
    """Uniform random token ids; sequence ``i`` depends only on ``(seed, i)``."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.n_sequences = SYNTHETIC_SEQUENCES

    def read(self, ids: np.ndarray) -> np.ndarray:
        rows = [np.random.default_rng([self.seed, int(i)]).integers(0, self.vocab_size,
                                                                    self.seq_len + 1)
                for i in ids]
        return np.stack(rows).astype(np.int64, copy=False)


def open_source(path: str, seq_len: int, vocab_size: int, seed: int,
                verify: bool | None = None) -> SequenceSource:
    """The source named by ``data.path``: ``stdlib``, ``synthetic`` or a token directory/file
    (``verify``: see ``open_token_files``)."""
    if path == SYNTHETIC:
        return SyntheticSequences(vocab_size, seq_len, seed)
    if path == STDLIB:
        tokens = stdlib_tokens()
        check_token_ids(tokens.arrays[0], vocab_size, STDLIB_NAME)
    else:
        tokens = open_token_files(path, vocab_size, verify)
    return StreamSequences(tokens, seq_len)
