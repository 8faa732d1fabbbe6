"""Microbatches interleaved at the transport (``MicrobatchInterleave``) on gloo.

Oracle: the same microbatches run one at a time, each with its own backward. A toy
two-layer model (a dense mix standing in for attention, then dispatch -> experts ->
combine, residual) runs two microbatches of different sizes; interleaved, each
microbatch's calls are the same calls with the same inputs, so its output and its
input's gradient equal the one-at-a-time run's bit for bit. The shared weights'
gradients are sums over the two microbatches, added in the backward's order: compared
within ``n * eps`` relative (module docstring of ``test_pipeline_cpu``). The transport
calls are logged to check that they do interleave (A's dispatch, B's dispatch, A's
combine, B's combine per layer). On CPU there are no streams: the CUDA streams and the
overlap are checked on GPUs.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import assert_close, experts, forward_backward  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, MicrobatchInterleave, make_transport  # noqa: E402

E, K, D, LAYERS = 8, 2, 16, 2


# --- the scheduler alone ---------------------------------------------------------


def test_forwards_take_turns_at_each_hand_off_and_a_finished_one_drops_out() -> None:
    interleave = MicrobatchInterleave()
    log: list[str] = []

    def forward(name: str, calls: int) -> object:
        def run() -> str:
            for i in range(calls):
                log.append(f"{name}{i}")
                assert interleave.interleaving
                interleave.hand_off()
            log.append(f"{name} done")
            return name.lower()
        return run

    assert interleave.run([forward("A", 3), forward("B", 1), forward("C", 2)]) == ["a", "b", "c"]
    assert log == ["A0", "B0", "C0", "A1", "B done", "C1", "A2", "C done", "A done"]
    assert not interleave.interleaving
    interleave.hand_off()  # outside run: nothing happens


def test_an_error_stops_the_other_forwards_and_is_raised() -> None:
    interleave = MicrobatchInterleave()
    unwound: list[str] = []

    def steady() -> None:
        try:
            while True:
                interleave.hand_off()
        finally:
            unwound.append("steady")

    def failing() -> None:
        interleave.hand_off()
        raise ValueError("microbatch B failed")

    with pytest.raises(ValueError, match="microbatch B failed"):
        interleave.run([steady, failing])
    assert unwound == ["steady"] and not interleave.interleaving
    assert interleave.run([lambda: 1]) == [1]  # usable again


def test_a_forward_cannot_start_another_run() -> None:
    interleave = MicrobatchInterleave()
    with pytest.raises(RuntimeError, match="already running"):
        interleave.run([lambda: interleave.run([lambda: 0])])


def test_chunked_pipelining_inside_an_interleave_is_refused() -> None:
    (message,) = run_distributed(_chunks_in_interleave, 1, timeout=60)
    assert "overlap_chunks=2" in message and "interleave" in message


def _chunks_in_interleave() -> str:
    cfg = EPConfig(E, K, 8, D, overlap_chunks=2)
    interleave = MicrobatchInterleave()
    dispatcher = EPDispatcher(cfg, make_transport("all_to_all", cfg), interleave=interleave)
    x, ids, w = torch.zeros(4, D), torch.zeros(4, K, dtype=torch.int64), torch.ones(4, K)
    try:
        interleave.run([lambda: dispatcher.run_experts(x, ids, w, lambda rows, offsets: rows)])
    except ValueError as e:
        return str(e)
    return "no error"


# --- interleaved EP microbatches against one at a time ------------------------------


def _model_data(tokens: list[list[int]], dtype: torch.dtype, seed: int) -> dict:
    """Identical on every rank: per rank, per microbatch, tokens ``x`` and output weights ``g``;
    the shared weights: per layer a dense mix ``P``, a router ``R`` and the experts ``W``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(
        x=[[randn(T, D) for T in mine] for mine in tokens],
        g=[[randn(T, D) for T in mine] for mine in tokens],
        P=randn(LAYERS, D, D, scale=1 / math.sqrt(D)),
        R=randn(LAYERS, D, E),
        W=randn(LAYERS, E, D, D, scale=1 / math.sqrt(D)),
    )


def _forward(x: torch.Tensor, P: torch.Tensor, R: torch.Tensor, W_local: torch.Tensor,
             dispatchers: list[EPDispatcher]) -> torch.Tensor:
    h = x
    for layer, dispatcher in enumerate(dispatchers):
        a = h + torch.tanh(h @ P[layer])  # the stand-in for attention
        probs = torch.softmax(a @ R[layer], dim=1)
        w, ids = torch.topk(probs, K, dim=1)
        rows, offsets, handle = dispatcher.dispatch(a, ids, w)
        h = a + dispatcher.combine(experts(rows, offsets, W_local[layer]), w, handle)
    return h


def _interleaved_equals_one_at_a_time(tokens: list[list[int]], dtype: torch.dtype) -> list[str]:
    rank, M = dist.get_rank(), dist.get_world_size()
    L = E // M
    data = _model_data(tokens, dtype, seed=5)
    T_max = max(max(mine) for mine in tokens)
    log: list[str] = []
    for backend, combine in (("all_to_all", "source"), ("rowwise", "source"), ("rowwise", "destination")):
        where = f"{backend}, combine at the {combine}"
        cfg = EPConfig(E, K, T_max, D, capacity_factor=None, combine=combine)
        transport = make_transport(backend, cfg, dtype=dtype)
        interleave = MicrobatchInterleave()
        dispatchers = [EPDispatcher(cfg, transport, seed=layer, interleave=interleave) for layer in range(LAYERS)]
        runs = {}
        for interleaved in (False, True):
            P, R, W = (data[k].clone().requires_grad_(True) for k in ("P", "R", "W"))
            W_local = W[:, rank * L : (rank + 1) * L]
            xs = [x.clone().requires_grad_(True) for x in data["x"][rank]]
            order: list[str] = []
            for d in dispatchers:
                d.transport = _Logged(transport, order, xs)

            def forward(i: int, xs=xs, P=P, R=R, W_local=W_local, dispatchers=dispatchers):
                return lambda: (_forward(xs[i], P, R, W_local, dispatchers) * data["g"][rank][i]).sum()

            losses = forward_backward([forward(0), forward(1)], interleave if interleaved else None)
            runs[interleaved] = dict(losses=[loss.detach() for loss in losses], dx=[x.grad for x in xs],
                                     dP=P.grad, dR=R.grad, dW=W.grad, order=order)
        alone, together = runs[False], runs[True]
        for i in range(2):
            assert torch.equal(together["losses"][i], alone["losses"][i]), (where, i)
            assert torch.equal(together["dx"][i], alone["dx"][i]), (where, i)
        tol = {torch.float64: 1e-13, torch.float32: 4e-6}[dtype]
        for key in ("dP", "dR", "dW"):
            assert_close(together[key], alone[key], tol, f"{where}: {key} interleaved vs one at a time")
        forward_calls = [c for c in together["order"] if c.startswith("send")][: 2 * LAYERS]
        assert forward_calls == ["send 0", "send 1"] * LAYERS, (where, together["order"])
        assert [c for c in alone["order"] if c.startswith("send")][:2] == ["send 0", "send 0"], where
        log.append(where)
    return log


class _Logged:
    """The transport, logging which microbatch each forward token send belongs to."""

    def __init__(self, inner, order: list[str], xs: list[torch.Tensor]) -> None:
        self._inner, self._order, self._rows = inner, order, [x.shape[0] for x in xs]
        self._next = 0

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def send(self, route, src_RW, per_src, *args, **kwargs):
        if per_src > 1:  # a token dispatch (forward): which microbatch, by its token count
            self._order.append(f"send {self._which(src_RW.shape[0])}")
        return self._inner.send(route, src_RW, per_src, *args, **kwargs)

    def _which(self, rows: int) -> int:
        return self._rows.index(rows)


@pytest.mark.multiprocess
def test_two_ranks_interleaved_equals_one_at_a_time() -> None:
    # Different token counts per microbatch and per rank (the log tells the microbatches apart).
    run_distributed(_interleaved_equals_one_at_a_time, 2, [[11, 6], [7, 9]], torch.float64, timeout=150)


@pytest.mark.multiprocess
def test_two_ranks_interleaved_fp32() -> None:
    run_distributed(_interleaved_equals_one_at_a_time, 2, [[24, 19], [13, 30]], torch.float32, timeout=150)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_ranks_interleaved_equals_one_at_a_time() -> None:
    run_distributed(_interleaved_equals_one_at_a_time, 4, [[9, 5], [3, 12], [13, 4], [6, 8]], torch.float64,
                    timeout=200)
