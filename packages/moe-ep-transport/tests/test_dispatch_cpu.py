"""Dispatch/combine on gloo: both backends against the local oracle and against each other.

The rowwise backend runs its real algorithm (count exchange through peer memory,
device-side destination planning, puts, capacity handling) over emulated peer
memory; only the put itself is emulated.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import BytesCodec, all_gather_objects, assert_close, experts, make_data, oracle  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, EPOverflowError, make_transport  # noqa: E402

E, K, D = 8, 2, 16


def _run(dispatcher: EPDispatcher, data, W_local: torch.Tensor, rank: int, stage: bool = False):
    x = data.x[rank].clone().requires_grad_(True)
    w = data.w[rank].clone().requires_grad_(True)
    W_local = W_local.clone().requires_grad_(True)
    # With ``stage`` the weights travel with the tokens (combine then gets the same tensor).
    rows, offsets, handle = dispatcher.dispatch(x, data.ids[rank], w if stage else None)
    assert offsets.stride() == (1,)  # what grouped GEMMs require, also for one local expert
    y = dispatcher.combine(experts(rows, offsets, W_local), w, handle)
    (y * data.g[rank]).sum().backward()
    return dict(rows=rows.detach(), offsets=offsets, y=y.detach(), dx=x.grad, dw=w.grad,
                dW=W_local.grad, keep=handle.plan.valid_N.view(-1, K), plan=handle.plan)


def _check_against_oracle_and_each_other(tokens: list[int], capacity_factor, banned,
                                         n_experts: int = E) -> dict:
    # Both combine sites: the sum at the source and the partial sums at the destinations.
    out = {}
    for combine in ("source", "destination"):
        out[combine] = _check_combine_site(tokens, capacity_factor, banned, n_experts, combine)
    assert out["source"]["dropped"] == out["destination"]["dropped"]
    return out["destination"]


def _check_combine_site(tokens: list[int], capacity_factor, banned, n_experts: int, combine: str) -> dict:
    rank, M = dist.get_rank(), dist.get_world_size()
    L = n_experts // M
    cfg = EPConfig(n_experts, K, max(tokens), D, capacity_factor=capacity_factor, combine=combine)
    results = {}
    # FP64: each backend against the oracle, tightly.
    data = make_data(tokens, n_experts, K, D, torch.float64, seed=11, banned=banned, skew=1.0)
    W_local = data.W[rank * L : (rank + 1) * L]
    token_inbox = None
    for backend in ("all_to_all", "rowwise"):
        transport = make_transport(backend, cfg, dtype=torch.float64)
        if backend == "rowwise":
            token_inbox = transport.sends_tokens_once
        got = _run(EPDispatcher(cfg, transport), data, W_local, rank)
        keep = all_gather_objects(got["keep"])
        ys, dxs, dws, dW = oracle(data, keep)
        where = f"{backend}, combine at the {combine}"
        assert_close(got["y"], ys[rank], 1e-12, f"{where}: y")
        assert_close(got["dx"], dxs[rank], 1e-12, f"{where}: grad x")
        assert_close(got["dw"], dws[rank], 1e-12, f"{where}: grad weights")
        assert_close(got["dW"], dW[rank * L : (rank + 1) * L], 1e-12, f"{where}: grad experts")
        results[backend] = got
    a, b = results["all_to_all"], results["rowwise"]
    assert torch.equal(a["keep"], b["keep"])
    # BF16 with a codec: the two backends agree bit for bit, and neither the codec nor
    # sending the weights along with the tokens changes anything.
    data16 = make_data(tokens, n_experts, K, D, torch.bfloat16, seed=12, banned=banned, skew=1.0)
    W16 = data16.W[rank * L : (rank + 1) * L]
    runs = []
    for backend, codec, stage in (("all_to_all", None, False), ("rowwise", None, False),
                                  ("rowwise", BytesCodec(), False), ("all_to_all", None, True),
                                  ("rowwise", None, True), ("rowwise", BytesCodec(), True)):
        transport = make_transport(backend, cfg, dtype=torch.bfloat16, codec=codec)
        runs.append(_run(EPDispatcher(cfg, transport, codec=codec), data16, W16, rank, stage))
    for other in runs[1:]:
        for key in ("rows", "offsets", "y", "dx", "dw", "dW"):
            assert torch.equal(runs[0][key], other[key]), (combine, key)
    plan = a["plan"]
    return dict(
        dropped=int(plan.dropped_M.sum()),
        received=int(a["offsets"][-1]),
        offsets=a["offsets"].tolist(),
        token_inbox=token_inbox,
        padding_zero=all(bool((r["rows"][int(r["offsets"][-1]) :] == 0).all()) for r in (a, b, *runs)),
    )


@pytest.mark.multiprocess
def test_two_ranks_dropless_match_oracle() -> None:
    # Experts 4..7 live on rank 1 and get no token: rank 1 receives nothing.
    out = run_distributed(_check_against_oracle_and_each_other, 2, [12, 9], None, (4, 5, 6, 7), timeout=120)
    assert out[1]["received"] == 0 and out[0]["received"] == (12 + 9) * K
    assert all(o["dropped"] == 0 and o["padding_zero"] for o in out)
    assert all(o["token_inbox"] for o in out)  # the rowwise dispatch sent tokens once per rank


@pytest.mark.multiprocess
def test_one_expert_per_rank_matches_oracle() -> None:
    # EP degree = number of experts: each rank holds a single expert.
    out = run_distributed(_check_against_oracle_and_each_other, 2, [6, 5], None, (), 2, timeout=120)
    assert [o["received"] for o in out] == [o["offsets"][-1] for o in out]
    assert sum(o["received"] for o in out) == (6 + 5) * K


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("capacity_factor", [1.0, None])
def test_four_ranks_match_oracle(capacity_factor: float | None) -> None:
    # Rank 2 sends nothing, experts 2 and 3 (rank 1) get nothing, skewed routing overflows
    # rank 0 at capacity factor 1. Dropless, the rowwise transport sends each token once per
    # rank (its token inbox of 4 x 10 rows fits the slab); at factor 1 it does not (4 > 1 x K)
    # and rows travel one per slot: both ways are checked.
    out = run_distributed(
        _check_against_oracle_and_each_other, 4, [10, 7, 0, 9], capacity_factor, (2, 3), timeout=150
    )
    assert out[1]["received"] == 0
    assert all(o["padding_zero"] for o in out)
    assert all(o["token_inbox"] == (capacity_factor is None) for o in out)
    if capacity_factor is not None:
        assert out[0]["dropped"] > 0  # the test exercises the fair drop
    else:
        assert all(o["dropped"] == 0 for o in out)


def _overflow_error_and_telemetry() -> list:
    rank, M = dist.get_rank(), dist.get_world_size()
    tokens = [8] * M
    data = make_data(tokens, E, K, D, torch.float32, seed=5, skew=3.0)
    report = []
    for policy in ("error", "drop"):
        cfg = EPConfig(E, K, 8, D, capacity_factor=1.0, overflow=policy)
        dispatcher = EPDispatcher(cfg, make_transport("rowwise", cfg, dtype=torch.float32))
        try:
            rows, offsets, handle = dispatcher.dispatch(data.x[rank], data.ids[rank])
        except EPOverflowError as e:
            report.append(str(e))
            continue
        stats = dispatcher.telemetry.pop()
        counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in data.ids])
        assert torch.equal(stats["tokens_per_expert"], counts.sum(0))
        assert torch.equal(stats["rows_per_rank"], counts.sum(0).view(M, E // M).sum(1))
        assert torch.equal(stats["dropped_rows"], handle.plan.dropped_M)
        assert int(offsets[-1]) <= dispatcher.capacity
        # Each rank reports the drops of the slots it routed: summed over the ranks,
        # every dropped slot counts once.
        mine = dispatcher.dropped_per_expert(handle)
        assert mine.shape == (E,) and bool((mine >= 0).all())
        total = mine.clone()
        dist.all_reduce(total)
        assert int(total.sum()) == int(stats["dropped_rows"].sum())
        report.append((int(stats["dropped_rows"].sum()), float(stats["load_imbalance"]),
                       float(stats["drop_rate"])))
    return report


@pytest.mark.multiprocess
def test_overflow_error_raises_on_every_rank_and_drop_reports() -> None:
    out = run_distributed(_overflow_error_and_telemetry, 2, timeout=90)
    for error, (dropped, imbalance, rate) in out:
        assert "capacity" in error
        assert dropped > 0 and imbalance > 1.0 and 0 < rate < 1
    assert out[0][1] == out[1][1]  # telemetry is global: the same on every rank


def _bad_inputs() -> None:
    cfg = EPConfig(E, K, 4, D)
    dispatcher = EPDispatcher(cfg, make_transport("all_to_all", cfg))
    x = torch.zeros(4, D)
    for bad_x, bad_ids, match in (
        (torch.zeros(5, D), torch.zeros(5, K, dtype=torch.int64), "max_tokens"),
        (torch.zeros(4, D + 1), torch.zeros(4, K, dtype=torch.int64), "d_model"),
        (x, torch.zeros(4, K + 1, dtype=torch.int64), "expert_ids"),
        (x, torch.zeros(4, K), "integer"),
    ):
        with pytest.raises(ValueError, match=match):
            dispatcher.dispatch(bad_x, bad_ids)
    # A transport's send never reads past its source rows, on either backend.
    for backend in ("all_to_all", "rowwise"):
        d = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.float32))
        _, _, handle = d.dispatch(x, torch.zeros(4, K, dtype=torch.int64))
        for bad_src, per_src in ((torch.zeros(3, D), K), (x, 0), (torch.zeros(4 * K - 1, D), 1)):
            with pytest.raises(ValueError, match="per_src"):
                d.transport.send(handle.route, bad_src, per_src)
    # The rowwise token inbox holds max_tokens rows per source: more would overlap the next.
    dropless = EPConfig(E, K, 4, D, capacity_factor=None)
    d = EPDispatcher(dropless, make_transport("rowwise", dropless, dtype=torch.float32))
    _, _, handle = d.dispatch(x, torch.zeros(4, K, dtype=torch.int64))
    assert d.transport.sends_tokens_once
    with pytest.raises(ValueError, match="max_tokens"):
        d.transport.send(handle.route, torch.zeros(5, D), K)
    # Rows wider than the rowwise transport was built for (FP32 rows, make_transport's
    # default BF16): the error names the argument that sizes it.
    d = EPDispatcher(cfg, make_transport("rowwise", cfg))
    wanted = r"a row send needs .* bytes .*make_transport\(\.\.\., dtype=x\.dtype\)"
    with pytest.raises(ValueError, match=wanted):
        d.dispatch(x, torch.zeros(4, K, dtype=torch.int64))
    d = EPDispatcher(cfg, make_transport("rowwise", cfg, dtype=x.dtype))
    rows, _, handle = d.dispatch(x, torch.zeros(4, K, dtype=torch.int64))
    assert rows.dtype == torch.float32


def _weights_given_to_dispatch_then_changed() -> list[bool]:
    rank = dist.get_rank()
    cfg = EPConfig(E, K, 8, D, capacity_factor=None, combine="destination")
    data = make_data([8, 8], E, K, D, torch.bfloat16, seed=9, skew=1.0)
    x, ids, W16 = data.x[rank], data.ids[rank], data.W[rank * (E // 2) : (rank + 1) * (E // 2)]
    ok = []
    with torch.no_grad():
        d = EPDispatcher(cfg, make_transport("rowwise", cfg, dtype=torch.bfloat16))
        rows, offsets, handle = d.dispatch(x, ids)
        want = d.combine(experts(rows, offsets, W16), data.w[rank] * 0.5, handle)
        for change in ("in place", "another tensor"):
            w = data.w[rank].clone()
            rows, offsets, handle = d.dispatch(x, ids, w)
            if change == "in place":
                w.mul_(0.5)  # after dispatch: the weights it carried are stale
                got = d.combine(experts(rows, offsets, W16), w, handle)
            else:
                got = d.combine(experts(rows, offsets, W16), w * 0.5, handle)
            ok.append(torch.equal(got, want))
        with pytest.raises(ValueError, match="weights must be"):
            d.dispatch(x, ids, data.w[rank][:, :1])
    return ok


@pytest.mark.multiprocess
def test_weights_given_to_dispatch_are_not_used_once_stale() -> None:
    assert run_distributed(_weights_given_to_dispatch_then_changed, 2, timeout=60) == [[True, True]] * 2


@pytest.mark.multiprocess
def test_bad_inputs_name_the_field() -> None:
    run_distributed(_bad_inputs, 2, timeout=60)


class _NoCountExchange:
    """A one-rank transport that fails the test when dispatch reaches the count exchange."""

    rank, world_size = 0, 1

    def plan_routes(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("dispatch ran the count exchange (a collective) before rejecting its inputs")


def test_misshaped_weights_are_rejected_before_the_count_exchange_and_telemetry() -> None:
    dispatcher = EPDispatcher(EPConfig(E, K, 4, D), _NoCountExchange())
    with pytest.raises(ValueError, match=r"weights must be \[T, k\] = \(4, 2\), got \(4, 1\)"):
        dispatcher.dispatch(torch.zeros(4, D), torch.zeros(4, K, dtype=torch.int64), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="weights is on meta, x on cpu"):
        dispatcher.dispatch(torch.zeros(4, D), torch.zeros(4, K, dtype=torch.int64), torch.zeros(4, K, device="meta"))
    with pytest.raises(ValueError, match="weights must be a floating-point tensor, got torch.int64"):
        dispatcher.dispatch(torch.zeros(4, D), torch.zeros(4, K, dtype=torch.int64), torch.zeros(4, K, dtype=torch.int64))
    assert dispatcher.telemetry.calls == 0 and dispatcher.telemetry.pop() == {}
