"""The rowwise dispatch's layout is chosen by the EP group size, and never enlarges the buffers.

The token inbox (``M * T_max`` rows: grows with the group) is used while it fits in
the ``C`` receive rows every layout needs; past that, one row per slot (``C`` rows
however many ranks). Equivalence of both layouts with a single process is checked in
``test_dispatch_cpu.py`` and ``test_ep_groups_cpu.py``; this file pins the rule and
the sizes it implies.
"""

from __future__ import annotations

import math

import pytest
from moe_ep_transport.config import EPConfig
from moe_ep_transport.rowwise import slab_bytes_for

D, ROW = 256, 256 * 2  # BF16 rows


@pytest.mark.parametrize(
    ("top_k", "capacity_factor", "inbox_sizes", "per_slot_sizes"),
    [
        (8, 1.25, [2, 4, 8, 10], [1, 11, 16, 32, 64]),  # M <= cf * k = 10
        (8, 1.0, [2, 8], [1, 9, 16]),
        (2, 1.25, [2], [1, 3, 4, 8]),  # M <= 2.5
        (1, 1.25, [], [1, 2, 4]),
        (8, None, [2, 16, 64, 128], [1]),  # dropless: C = M * T * k, the inbox always fits
    ],
)
def test_layout_follows_the_group_size(top_k, capacity_factor, inbox_sizes, per_slot_sizes) -> None:
    cfg = EPConfig(n_experts=128, top_k=top_k, max_tokens=1024, d_model=D, capacity_factor=capacity_factor)
    assert [cfg.dispatch_layout(m) for m in inbox_sizes] == ["token_inbox"] * len(inbox_sizes)
    assert [cfg.dispatch_layout(m) for m in per_slot_sizes] == ["per_slot"] * len(per_slot_sizes)


def test_boundary_is_the_capacity() -> None:
    # T_max = 100, k = 8, cf = 1.25: C = 1000 rows; the inbox of M * 100 rows fits up to M = 10.
    cfg = EPConfig(n_experts=160, top_k=8, max_tokens=100, d_model=D, capacity_factor=1.25)
    assert cfg.rank_capacity(10) == 1000
    assert cfg.dispatch_layout(10) == "token_inbox"
    assert cfg.dispatch_layout(11) == "per_slot"
    # Less head-room and ten ranks no longer fit.
    tight = EPConfig(n_experts=160, top_k=8, max_tokens=100, d_model=D, capacity_factor=1.24)
    assert tight.rank_capacity(10) == 992
    assert tight.dispatch_layout(10) == "per_slot"


def _without_inbox(cfg: EPConfig, M: int) -> int:
    """The slab size every layout needs: counts, C receive rows with their metadata, the returns."""
    C = cfg.rank_capacity(M)
    align = lambda n: math.ceil(n / 256) * 256  # noqa: E731
    return align(max(M * cfg.n_experts * 4, align(C * 8) + C * ROW, cfg.max_slots * ROW))


@pytest.mark.parametrize("capacity_factor", [1.25, None])
@pytest.mark.parametrize("M", [2, 4, 8, 10, 16, 32])
def test_the_layout_never_enlarges_the_slabs(M: int, capacity_factor: float | None) -> None:
    cfg = EPConfig(n_experts=128, top_k=8, max_tokens=64, d_model=D, capacity_factor=capacity_factor,
                   combine="source")
    assert slab_bytes_for(cfg, M, ROW) == _without_inbox(cfg, M)


def test_per_slot_slabs_do_not_grow_with_the_group() -> None:
    # Past the inbox's reach a slab holds C rows at any group size; an inbox would hold M * T_max.
    cfg = EPConfig(n_experts=256, top_k=8, max_tokens=64, d_model=D, capacity_factor=1.25, combine="source")
    sizes = {M: slab_bytes_for(cfg, M, ROW) for M in (16, 32, 64)}
    assert len(set(sizes.values())) == 1
    assert all(M * cfg.max_tokens * ROW > size for M, size in sizes.items())
