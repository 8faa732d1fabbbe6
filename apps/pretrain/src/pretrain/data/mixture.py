"""Mixtures of token directories (``data.sources``): weighted, deterministic, stateless.

The run's samples are cut into blocks of ``MIX_BLOCK`` (65,536) positions. Each block
holds ``q_k`` samples of source ``k``: its share of the weights times 65,536, rounded by
largest remainders (a positive weight too small for one sample per block is refused),
spread evenly over the block: source ``k``'s ``i``-th slot sits at ``(i + 1/2) / q_k`` of
the block, ties in source order. So every stretch of the stream, a global batch
included, holds the sources in proportion to their weights (within one sample each).

Sample ``g`` of the run is then slot ``g mod B`` of block ``g div B``: source ``k``'s
sample ``j = block * q_k + rank of the slot``, and ``j`` goes through source ``k``'s own
keyed permutation (``GlobalOrder``, epochs and all, keyed by the run's data seed and
``k``). Like the one-source order this is a function of ``g`` alone: any rank reads any
slice, any layout reads the same tokens, and a resumed run needs only its step. Each
source runs through its own epochs: one with a large weight for its size repeats sooner.

A mixture is itself a ``SequenceSource``: its sequence ids are the sources' ids placed
one after another (source ``k``'s id ``i`` is ``offsets[k] + i``), and
``sample_order`` gives the mixture's order instead of a permutation of that range.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pretrain.data.order import GlobalOrder
from pretrain.data.sources import SequenceSource

MIX_BLOCK = 1 << 16  # samples per block; weights are resolved to 1/MIX_BLOCK


@dataclass(frozen=True)
class MixtureComponent:
    path: str  # as the config names it
    weight: float
    source: SequenceSource


def block_quotas(weights: list[float], block: int = MIX_BLOCK) -> list[int]:
    """Samples of each source per block: its share of ``block``, largest remainders.

    The weights are checked by the config (finite, >= 0, not all zero); a positive weight
    whose share rounds to no sample is a ``ValueError``.
    """
    total = sum(weights)
    exact = [w / total * block for w in weights]
    quotas = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (quotas[k] - exact[k], k))
    for k in by_remainder[:block - sum(quotas)]:
        quotas[k] += 1
    for k, (w, q) in enumerate(zip(weights, quotas, strict=True)):
        if w > 0 and q == 0:
            raise ValueError(f"source {k}'s weight {w} is below 1/{block} of the total {total}; "
                             "it would get no samples")
    return quotas


def _source_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"pretrain-mixture:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class MixtureSequences:
    """Several sources as one ``SequenceSource`` (their ids placed one after another)."""

    def __init__(self, components: list[MixtureComponent]) -> None:
        self.components = components
        self.seq_len = components[0].source.seq_len
        sizes = np.array([c.source.n_sequences for c in components], dtype=np.int64)
        self._ends = np.cumsum(sizes)
        self.offsets = self._ends - sizes
        self.n_sequences = int(self._ends[-1])
        self.quotas = block_quotas([c.weight for c in components])

    def read(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        which = np.searchsorted(self._ends, ids, side="right")
        for k in np.unique(which):
            sel = which == k
            out[sel] = self.components[k].source.read(ids[sel] - self.offsets[k])
        return out

    def records(self) -> list[dict]:
        """What identifies each source for a resume: path, weight, number of sequences."""
        return [{"path": c.path, "weight": c.weight, "n_sequences": c.source.n_sequences}
                for c in self.components]


class MixtureOrder:
    """Mixture sequence ids of run-wide sample positions (module docstring)."""

    def __init__(self, mixture: MixtureSequences, seed: int) -> None:
        self.mixture = mixture
        self._quotas = np.array(mixture.quotas, dtype=np.int64)
        source = np.repeat(np.arange(len(self._quotas)), self._quotas)
        rank = np.concatenate([np.arange(q) for q in self._quotas])
        place = (rank + 0.5) / self._quotas[source]
        slots = np.lexsort((source, place))  # by place, ties in source order
        self._slot_source, self._slot_rank = source[slots], rank[slots]
        self._orders = [GlobalOrder(c.source.n_sequences, _source_seed(seed, k))
                        for k, c in enumerate(mixture.components)]

    def sequence_ids(self, samples: np.ndarray) -> np.ndarray:
        samples = np.asarray(samples, dtype=np.int64)
        block, slot = np.divmod(samples, MIX_BLOCK)
        source = self._slot_source[slot]
        within = block * self._quotas[source] + self._slot_rank[slot]
        out = np.empty_like(samples)
        for k in np.unique(source):
            sel = source == k
            out[sel] = self.mixture.offsets[k] + self._orders[k].sequence_ids(within[sel])
        return out


def sample_order(source: SequenceSource, seed: int) -> GlobalOrder | MixtureOrder:
    """The order of run-wide samples over ``source``: a mixture's own, else a keyed
    permutation of its sequences per epoch."""
    if isinstance(source, MixtureSequences):
        return MixtureOrder(source, seed)
    return GlobalOrder(source.n_sequences, seed)
