"""Routing plan and fair overflow: single process, every rank's plan computed side by side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from moe_ep_transport import ops
from moe_ep_transport.config import EPConfig
from moe_ep_transport.overflow import dropped_window
from moe_ep_transport.plan import plan_routes

sys.path.insert(0, str(Path(__file__).parent))


def _plans(expert_ids: list[torch.Tensor], n_experts: int, top_k: int, capacity: int, salt: int = 0):
    """The plan of every simulated rank, from the same count matrix."""
    flat = [e.reshape(-1) for e in expert_ids]
    slots = [ops.rank_slots(f, n_experts) for f in flat]
    counts_ME = torch.stack([s.counts_E for s in slots])
    return [
        plan_routes(f, s, counts_ME, rank=r, top_k=top_k, capacity=capacity, salt=salt)
        for r, (f, s) in enumerate(zip(flat, slots, strict=True))
    ]


def _reference_layout(expert_ids: list[torch.Tensor], n_experts: int):
    """Dropless receive layout by plain loops: per rank, (local expert, source, slot order)."""
    M = len(expert_ids)
    L = n_experts // M
    layout = {r: [] for r in range(M)}  # r -> list of (source, slot)
    for r in range(M):
        for e in range(L):
            for s in range(M):
                for i, g in enumerate(expert_ids[s].reshape(-1).tolist()):
                    if g == r * L + e:
                        layout[r].append((s, i))
    return layout


def _routing(M: int, T: list[int], E: int, k: int, gen: torch.Generator, skew: float = 0.0):
    out = []
    for s in range(M):
        logits = torch.randn(T[s], E, generator=gen) + skew * torch.linspace(3, 0, E)
        out.append(torch.topk(logits, k, dim=1).indices)
    return out


@pytest.mark.parametrize("M,T", [(2, [7, 5]), (4, [6, 0, 9, 3])])
def test_dropless_layout_matches_loops(M: int, T: list[int]) -> None:
    E, k = 8, 2
    gen = torch.Generator().manual_seed(M)
    ids = _routing(M, T, E, k, gen)
    capacity = EPConfig(E, k, max(T), 4, capacity_factor=None).rank_capacity(M)
    plans = _plans(ids, E, k, capacity)
    layout = _reference_layout(ids, E)
    L = E // M
    for s in range(M):
        flat = ids[s].reshape(-1)
        for i, g in enumerate(flat.tolist()):
            r = g // L
            assert plans[s].dst_rank_N[i] == r
            assert layout[r][int(plans[s].dst_row_N[i])] == (s, i)
    for r in range(M):
        n = len(layout[r])
        assert int(plans[r].group_offsets_L[-1]) == n
        expect_src = [s for s, _ in layout[r]] + [-1] * (capacity - n)
        assert plans[r].row_src_C.tolist() == expect_src
        sizes = torch.diff(plans[r].group_offsets_L, prepend=torch.zeros(1, dtype=torch.int32))
        for e in range(L):
            assert int(sizes[e]) == sum(int((i == r * L + e).sum()) for i in ids)


def test_overflow_is_proportional_and_within_capacity() -> None:
    M, E, k, T = 4, 16, 4, 32
    gen = torch.Generator().manual_seed(3)
    ids = _routing(M, [T] * M, E, k, gen, skew=2.0)
    capacity = EPConfig(E, k, T, 4, capacity_factor=1.0).rank_capacity(M)
    plans = _plans(ids, E, k, capacity)
    counts, kept = plans[0].counts_ME, plans[0].kept_ME
    L = E // M
    assert (kept <= counts).all()
    for r in range(M):
        c = counts[:, r * L : (r + 1) * L]
        need = int(c.sum())
        got = kept[:, r * L : (r + 1) * L]
        if need <= capacity:
            assert torch.equal(got, c)
        else:
            assert int(got.sum()) == capacity
            exact = c.double() * capacity / need
            assert ((got.double() - exact).abs() < 1).all()
    assert int(plans[0].dropped_M.sum()) > 0  # the skew does overflow
    # Every destination row is used once, and the kept rows of each rank fill [0, n).
    for r in range(M):
        rows = [
            int(p.dst_row_N[i]) for p in plans for i in range(p.dst_rank_N.numel()) if p.dst_rank_N[i] == r
        ]
        assert sorted(rows) == list(range(int(kept[:, r * L : (r + 1) * L].sum())))
    # Within a (source, expert) cell the kept rows keep the source's slot order.
    for s, p in enumerate(plans):
        for g in range(E):
            slots = (ids[s].reshape(-1) == g) & p.valid_N
            rows = p.dst_row_N[slots]
            assert torch.equal(rows, torch.sort(rows).values)


def test_dropped_window_counts_preceding_drops() -> None:
    for c in range(1, 7):
        for drop in range(c + 1):
            for start in range(c):
                q = torch.arange(c)
                full = torch.full((c,), c)
                dropped, preceding = dropped_window(q, full, torch.full((c,), drop), torch.full((c,), start))
                expect = [((i - start) % c) < drop for i in range(c)]
                assert dropped.tolist() == expect
                assert preceding.tolist() == [sum(expect[:i]) for i in range(c)]


def test_drops_are_fair_across_experts_sources_and_positions() -> None:
    """Over many calls, every expert, source rank and slot position loses rows at the same rate.

    Destination rank 0 is always overloaded (its experts are preferred); the rates
    must not depend on expert id, source rank or position, which truncating an
    expert-major buffer would (it always drops the highest expert and source).
    """
    M, E, k, T = 4, 8, 2, 16
    L = E // M
    capacity = EPConfig(E, k, T, 4, capacity_factor=1.0).rank_capacity(M)
    gen = torch.Generator().manual_seed(0)
    kept_g = torch.zeros(L)
    asked_g = torch.zeros(L)
    kept_s = torch.zeros(M)
    asked_s = torch.zeros(M)
    kept_pos = torch.zeros(T)
    asked_pos = torch.zeros(T)
    for _ in range(300):
        ids = []
        for _s in range(M):
            logits = torch.randn(T, E, generator=gen)
            logits[:, :L] += 1.5  # rank 0's experts are popular
            ids.append(torch.topk(logits, k, dim=1).indices)
        plans = _plans(ids, E, k, capacity)
        for s, p in enumerate(plans):
            flat = ids[s].reshape(-1)
            to0 = flat < L
            valid = p.valid_N.float()
            kept_g.index_add_(0, flat[to0], valid[to0])
            asked_g.index_add_(0, flat[to0], torch.ones(int(to0.sum())))
            kept_s[s] += valid[to0].sum()
            asked_s[s] += to0.sum()
            # position = rank of the slot among its cell (token order), folded to T buckets
            tok = torch.arange(flat.numel()) // k
            kept_pos.index_add_(0, tok[to0], valid[to0])
            asked_pos.index_add_(0, tok[to0], torch.ones(int(to0.sum())))
    rate_g, rate_s, rate_pos = kept_g / asked_g, kept_s / asked_s, kept_pos / asked_pos
    overall = float(kept_g.sum() / asked_g.sum())
    assert overall < 0.9  # the test overloads rank 0
    assert (rate_g - overall).abs().max() < 0.02
    assert (rate_s - overall).abs().max() < 0.02
    assert (rate_pos - overall).abs().max() < 0.05


def test_dropless_capacity_never_drops() -> None:
    M, E, k, T = 4, 8, 2, 5
    cfg = EPConfig(E, k, T, 4, capacity_factor=None)
    ids = [torch.zeros(T, k, dtype=torch.int64) + torch.arange(k) for _ in range(M)]  # all to rank 0
    plans = _plans(ids, E, k, cfg.rank_capacity(M))
    assert all(bool(p.valid_N.all()) for p in plans)
    assert int(plans[0].group_offsets_L[-1]) == M * T * k == cfg.rank_capacity(M)


def test_config_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="top_k"):
        EPConfig(4, 5, 8, 16)
    with pytest.raises(ValueError, match="overflow"):
        EPConfig(4, 2, 8, 16, overflow="truncate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="divisible"):
        EPConfig(6, 2, 8, 16).local_experts(4)


def test_bytes_per_row_reports_the_codec_width() -> None:
    from _oracle import BytesCodec
    from moe_ep_transport import EPDispatcher, bytes_per_row

    class _Group:  # a transport stand-in: only the group shape is read
        rank, world_size = 1, 2

    cfg = EPConfig(8, 2, 16, 48)
    plain = EPDispatcher(cfg, _Group())  # type: ignore[arg-type]
    coded = EPDispatcher(cfg, _Group(), codec=BytesCodec())  # type: ignore[arg-type]
    assert plain.bytes_per_row(torch.float32) == 48 * 4 == bytes_per_row(48, torch.float32)
    assert coded.bytes_per_row(torch.float32) == 96 == bytes_per_row(48, torch.float32, BytesCodec())
    assert (plain.expert_start, plain.n_local, plain.capacity) == (4, 4, 40)


def test_combine_site_auto_rule() -> None:
    D = 2048
    cfg = EPConfig(64, 8, 1024, D)
    # Top-8 over two ranks: ~4 experts per rank reached, FP32 partials are half of 4 BF16 rows.
    assert cfg.sums_at_destination(2, 2 * D, 4 * D)
    assert not cfg.sums_at_destination(4, 2 * D, 4 * D)  # ~2.2 rows per rank: 0.9 of the bytes
    assert not cfg.sums_at_destination(8, 2 * D, 4 * D)  # ~1.5: more bytes than the rows
    assert not cfg.sums_at_destination(1, 2 * D, 4 * D)  # nothing travels
    assert not cfg.sums_at_destination(2, 8 * D, 8 * D)  # FP64 partials: the GPU kernels sum in FP32
    assert not EPConfig(64, 2, 1024, D).sums_at_destination(2, 2 * D, 4 * D)  # top-2: ~1.3 per rank
    assert EPConfig(64, 2, 1024, D, combine="destination").sums_at_destination(8, 2 * D, 8 * D)
    assert not EPConfig(64, 8, 1024, D, combine="source").sums_at_destination(2, 2 * D, 4 * D)
    with pytest.raises(ValueError, match="EPConfig.combine"):
        EPConfig(64, 8, 1024, D, combine="sideways")
