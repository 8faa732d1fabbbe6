"""Calls a CUDA graph captures run in ``transport.replayable()``: a whole number of slab rounds.

A replay reuses its capture's slabs, so a captured sequence of phases must leave the
slab counter where it started (modulo the slab count) for back-to-back replays to
alternate. Checked on two gloo ranks over emulated peer memory: the phases and the
barriers added, results unchanged, and the all-to-all transport's refusal.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import make_data  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, make_transport  # noqa: E402
from moe_ep_transport.peer_memory import N_SLABS  # noqa: E402

E, K, D, T = 8, 2, 16, 6


def _phases_and_barriers() -> dict:
    rank = dist.get_rank()
    cfg = EPConfig(E, K, T, D, capacity_factor=None, combine="source")
    data = make_data([T, T], E, K, D, torch.float32, seed=3, skew=1.0)
    x, ids, w = data.x[rank], data.ids[rank], data.w[rank]
    transport = make_transport("rowwise", cfg, dtype=torch.float32)
    barriers = []  # a barrier of its own, or one the next kernel passes (deferred)
    barrier, deferred = transport.memory.barrier, transport.memory.deferred_barrier
    transport.memory.barrier = lambda: barriers.append(transport.phase) or barrier()
    transport.memory.deferred_barrier = lambda: barriers.append(transport.phase) or deferred()
    d = EPDispatcher(cfg, transport)
    out = {}

    def step(scoped: bool) -> tuple[int, int, torch.Tensor]:
        start, seen = transport.phase, len(barriers)
        with transport.replayable() if scoped else nullcontext():
            with torch.no_grad():
                rows, offsets, handle = d.dispatch(x, ids)
                y = d.combine(rows * 2.0, w, handle)
        return transport.phase - start, len(barriers) - seen, y

    out["plain"] = step(False)
    out["scoped"] = step(True)
    with transport.replayable():  # a dispatch alone: two phases, nothing added
        with torch.no_grad():
            d.dispatch(x, ids)
    out["dispatch_only"] = transport.phase - (out["plain"][0] + out["scoped"][0])
    out["phase"] = transport.phase
    transport.close()
    return out


@pytest.mark.multiprocess
def test_replayable_rounds_the_phases_up_with_barriers() -> None:
    out = run_distributed(_phases_and_barriers, 2, timeout=120)
    for o in out:
        phases, barriers, y = o["plain"]
        assert (phases, barriers) == (3, 3)  # counts + rows, rows back: one barrier each
        scoped_phases, scoped_barriers, scoped_y = o["scoped"]
        assert scoped_phases % N_SLABS == 0 and scoped_phases == 4
        assert scoped_barriers == 4  # the data-less phase is one barrier
        assert torch.equal(scoped_y, y)
        assert o["dispatch_only"] == 2
        assert o["phase"] == 9
    assert out[0]["phase"] == out[1]["phase"]


def _all_to_all_refuses() -> str:
    cfg = EPConfig(E, K, T, D)
    transport = make_transport("all_to_all", cfg)
    with pytest.raises(RuntimeError) as e:
        with transport.replayable():
            pass
    return str(e.value)


@pytest.mark.multiprocess
def test_the_all_to_all_transport_cannot_be_replayed() -> None:
    for message in run_distributed(_all_to_all_refuses, 2, timeout=60):
        assert "split sizes on the host" in message
