"""Training data: token streams and a deterministic batch order.

The embedded default corpus is the running interpreter's own standard-library
source (found through ``sysconfig``), read as bytes: it needs no download and
every machine with Python has it. Token ids are bytes (vocab 256).

Batches are windows of ``seq_len + 1`` tokens at offsets drawn from a generator
seeded by (seed, step), so the global batch of a step does not depend on how many
ranks read it or how it is split into microbatches.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_sources() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
    return sorted(files)


def load_stdlib_bytes() -> torch.Tensor:
    """All standard-library ``.py`` files, concatenated, as uint8 tokens."""
    files = stdlib_sources()
    if not files:
        raise FileNotFoundError(
            f"no standard-library sources under {sysconfig.get_paths()['stdlib']}; "
            "set data.path to a token file instead"
        )
    blob = b"\n".join(p.read_bytes() for p in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class TokenStream:
    """Random windows of a 1-D token tensor, deterministic in (seed, step)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int) -> None:
        if tokens.numel() < seq_len + 2:
            raise ValueError(
                f"the corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len + 1}"
            )
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed

    def global_batch(self, step: int, n_sequences: int) -> torch.Tensor:
        """[n_sequences, seq_len + 1] int64 windows for optimizer step ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (n_sequences,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.tokens[idx].long()
