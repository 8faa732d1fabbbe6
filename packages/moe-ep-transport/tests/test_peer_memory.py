"""The deduplicating put's addressing (``peer_memory.inbox_targets``) as properties."""

from __future__ import annotations

import torch
from moe_ep_transport.peer_memory import inbox_targets


def test_each_token_travels_once_per_other_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    T, k, M, me, stride = 300, 8, 4, 1, 512
    dst_rank = torch.randint(-1, M, (T * k,), generator=gen)  # -1: dropped slots
    dst_row = torch.randint(0, 10_000, (T * k,), generator=gen)
    rank, row = inbox_targets(dst_rank, dst_row, k, me, stride)
    token = torch.arange(T * k) // k
    remote = (dst_rank >= 0) & (dst_rank != me)
    # Local and dropped slots keep their addressing.
    assert torch.equal(rank[~remote], dst_rank[~remote]) and torch.equal(row[~remote], dst_row[~remote])
    # Every (token, other rank) pair is stored exactly once, into the sender's inbox part.
    stored = remote & (rank >= 0)
    pairs = set(zip(token[stored].tolist(), rank[stored].tolist(), strict=True))
    assert len(pairs) == int(stored.sum())
    assert pairs == set(zip(token[remote].tolist(), dst_rank[remote].tolist(), strict=True))
    assert torch.equal(row[remote], me * stride + token[remote])
    # ... by the token's first slot bound there.
    for i in torch.nonzero(stored).flatten().tolist():
        first = (token == token[i]) & (dst_rank == dst_rank[i])
        assert int(torch.nonzero(first)[0]) == i
    # With top-8 over 4 ranks the stores fall well below one per slot.
    assert int(stored.sum()) < 0.6 * int(remote.sum())
