"""The chunked pipeline (``EPDispatcher.run_experts`` with ``EPConfig.overlap_chunks > 1``) on gloo.

Oracles: the unsplit EP call (``overlap_chunks=1``, itself checked to be dispatch ->
experts -> combine exactly) and one process holding every expert and every rank's tokens
(``_oracle.oracle``). Each chunk's tokens are combined alone and the toy experts here
compute each row alone (``tanh`` of an elementwise product summed over a fixed axis: a
CPU BLAS matmul picks its kernel by the row count, which changes the last bits of a
row), so the output and the gradients of the inputs and the routing weights must equal
the unsplit call's bit for bit; the expert weights' gradient is a sum over the
chunks (autograd accumulates the chunks' uses of the weights), the same terms in another
order, so it is compared within ``n * eps`` relative for ``n`` = 50 terms of size ~1 (a
sum's reordering moves it by at most ``n - 1`` roundings: 1e-13 in FP64, 4e-6 in FP32). On CPU the chunks run one after another in the
pipeline's issue order: what is checked here is the chunking, its calls' order over the
ranks and the handle; the two CUDA streams are checked on GPUs (``test_gpu.py``).
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
from _oracle import all_gather_objects, assert_close, make_data, oracle  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, EPHandle, PipelinedHandle, make_transport  # noqa: E402

E, K, D = 8, 2, 16
WEIGHT_GRAD_TOL = {torch.float64: 1e-13, torch.float32: 4e-6}  # see the module docstring


def experts(rows_CD: torch.Tensor, offsets_L: torch.Tensor, W_LDD: torch.Tensor) -> torch.Tensor:
    """``_oracle.experts`` (``tanh(rows @ W_e)`` per segment, padding 0), each row computed alone."""
    pieces, start = [], 0
    for e, end in enumerate(offsets_L.tolist()):
        pieces.append(torch.tanh((rows_CD[start:end, :, None] * W_LDD[e]).sum(1)))
        start = end
    pieces.append(rows_CD[start:] * 0)
    return torch.cat(pieces)


def _run(dispatcher: EPDispatcher, data, W_local: torch.Tensor, rank: int) -> dict:
    x = data.x[rank].clone().requires_grad_(True)
    w = data.w[rank].clone().requires_grad_(True)
    W = W_local.clone().requires_grad_(True)
    y, handle = dispatcher.run_experts(x, data.ids[rank], w, lambda rows, offs: experts(rows, offs, W))
    (y * data.g[rank]).sum().backward()
    chunks = handle.chunks if isinstance(handle, PipelinedHandle) else [handle]
    keep = torch.cat([h.plan.valid_N.view(-1, K) for h in chunks])
    stats = dispatcher.telemetry.pop()
    return dict(y=y.detach(), dx=x.grad, dw=w.grad, dW=W.grad, keep=keep, handle=handle,
                dropped=dispatcher.dropped_per_expert(handle), calls=len(chunks),
                tokens_per_expert=stats["tokens_per_expert"])


def _pipeline_matches_unsplit(tokens: list[int], chunk_counts: list[int], capacity_factor: float | None,
                              dtype: torch.dtype) -> dict:
    rank, M = dist.get_rank(), dist.get_world_size()
    L = E // M
    data = make_data(tokens, E, K, D, dtype, seed=21, skew=1.5)
    W_local = data.W[rank * L : (rank + 1) * L]
    T_max = max(tokens)
    summary = {}
    def dispatcher(backend: str, combine: str, chunks: int) -> EPDispatcher:
        # max_tokens bounds a chunk: the layer's rows and buffers stay one unsplit call's
        cfg = EPConfig(E, K, math.ceil(T_max / chunks), D, capacity_factor=capacity_factor,
                       combine=combine, overlap_chunks=chunks)
        return EPDispatcher(cfg, make_transport(backend, cfg, dtype=dtype), seed=3)

    for backend, combine in (("all_to_all", "source"), ("rowwise", "source"), ("rowwise", "destination")):
        # overlap_chunks=1 is dispatch -> experts -> combine, the same calls
        unsplit_dispatcher = dispatcher(backend, combine, 1)
        unsplit = _run(unsplit_dispatcher, data, W_local, rank)
        assert isinstance(unsplit["handle"], EPHandle)
        W = W_local.clone().requires_grad_(True)
        x, w = data.x[rank].clone().requires_grad_(True), data.w[rank].clone().requires_grad_(True)
        rows, offsets, handle = unsplit_dispatcher.dispatch(x, data.ids[rank], w)
        y = unsplit_dispatcher.combine(experts(rows, offsets, W), w, handle)
        (y * data.g[rank]).sum().backward()
        for key, got in (("y", y.detach()), ("dx", x.grad), ("dw", w.grad), ("dW", W.grad)):
            assert torch.equal(unsplit[key], got), (backend, key)

        for chunks in chunk_counts:
            where = f"{backend}, combine at the {combine}, {chunks} chunks"
            got = _run(dispatcher(backend, combine, chunks), data, W_local, rank)
            assert isinstance(got["handle"], PipelinedHandle) and got["calls"] == chunks, where
            assert torch.equal(got["tokens_per_expert"], unsplit["tokens_per_expert"]), where
            ys, dxs, dws, dW = oracle(data, all_gather_objects(got["keep"]))
            tol = 1e-12 if dtype == torch.float64 else 1e-5
            assert_close(got["y"], ys[rank], tol, f"{where}: y against one process")
            assert_close(got["dx"], dxs[rank], tol, f"{where}: grad x against one process")
            assert_close(got["dw"], dws[rank], tol, f"{where}: grad weights against one process")
            assert_close(got["dW"], dW[rank * L : (rank + 1) * L], tol, f"{where}: grad experts")
            n_dropped = int(got["dropped"].sum())
            assert n_dropped == int((~got["keep"]).sum()), where  # the handle reports every chunk's drops
            summary[backend, combine, chunks] = n_dropped
            if capacity_factor is None:
                for key in ("y", "dx", "dw"):
                    assert torch.equal(got[key], unsplit[key]), (where, key)
                assert_close(got["dW"], unsplit["dW"], WEIGHT_GRAD_TOL[dtype], f"{where}: grad experts vs unsplit")
    return summary


@pytest.mark.multiprocess
def test_two_ranks_pipeline_equals_unsplit_and_one_process() -> None:
    # 11 and 7 tokens: 2 and 3 chunks do not divide them, 8 chunks leave rank 1 an empty one.
    run_distributed(_pipeline_matches_unsplit, 2, [11, 7], [2, 3, 8], None, torch.float64, timeout=150)


@pytest.mark.multiprocess
def test_two_ranks_pipeline_fp32_bit_identical() -> None:
    run_distributed(_pipeline_matches_unsplit, 2, [24, 19], [4], None, torch.float32, timeout=120)


@pytest.mark.multiprocess
def test_pipeline_with_drops_reports_each_chunks_drops() -> None:
    # Skewed routing at capacity factor 1 overflows: each chunk drops against its own capacity,
    # and the one-process oracle with the chunks' drops applied agrees.
    out = run_distributed(_pipeline_matches_unsplit, 2, [16, 12], [2], 1.0, torch.float64, timeout=120)
    assert sum(out[0].values()) + sum(out[1].values()) > 0


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_ranks_pipeline_equals_unsplit_and_one_process() -> None:
    # Rank 1 has no token at all: its chunks are all empty, its calls still happen.
    run_distributed(_pipeline_matches_unsplit, 4, [9, 0, 13, 4], [3], None, torch.float64, timeout=200)


def test_overlap_config_is_checked() -> None:
    for kwargs, match in (({"overlap_chunks": 0}, "overlap_chunks"),
                          ({"overlap_chunks": 1, "comm_sms": 8}, "comm_sms"),
                          ({"overlap_chunks": 2, "comm_sms": 0}, "comm_sms")):
        with pytest.raises(ValueError, match=match):
            EPConfig(E, K, 4, D, **kwargs)


def _too_many_tokens() -> str:
    cfg = EPConfig(E, K, 4, D, overlap_chunks=2)
    dispatcher = EPDispatcher(cfg, make_transport("all_to_all", cfg))
    try:
        dispatcher.run_experts(torch.zeros(9, D), torch.zeros(9, K, dtype=torch.int64), torch.ones(9, K),
                               lambda rows, offsets: rows)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiprocess
def test_more_tokens_than_the_chunks_hold_is_refused() -> None:
    (message,) = run_distributed(_too_many_tokens, 1, timeout=60)
    assert "9 tokens" in message and "overlap_chunks" in message and "max_tokens=4" in message


def _backward_order(chunks: int) -> list[str]:
    """The order autograd runs the pipeline's backward ops in (one rank)."""
    from moe_ep_transport import dispatcher as dispatcher_module

    log: list[str] = []
    originals = {}
    for name, function in (("D", dispatcher_module._Dispatch), ("C", dispatcher_module._Combine)):
        originals[function] = function.backward

        def logged(ctx, *grads, _backward=function.backward, _name=name):
            log.append(f"{_name}{ctx.route.chunk}'")
            return _backward(ctx, *grads)

        function.backward = staticmethod(logged)

    class Experts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, chunk):
            ctx.chunk = chunk
            return rows * 2

        @staticmethod
        def backward(ctx, grad):
            log.append(f"X{ctx.chunk}'")
            return grad * 2, None

    try:
        cfg = EPConfig(E, K, 4, D, capacity_factor=None, overlap_chunks=chunks)
        dispatcher = EPDispatcher(cfg, make_transport("all_to_all", cfg))
        T = 4 * chunks
        x = torch.randn(T, D, requires_grad=True)
        calls = iter(range(chunks))
        open_route = dispatcher.transport.open_route
        opened = iter(range(chunks))

        def tagged(plan):
            route = open_route(plan)
            route.chunk = next(opened)
            return route

        dispatcher.transport.open_route = tagged
        y, _ = dispatcher.run_experts(x, torch.randint(0, E, (T, K)), torch.rand(T, K, requires_grad=True),
                                      lambda rows, offsets: Experts.apply(rows, next(calls)))
        y.sum().backward()
    finally:
        for function, backward in originals.items():
            function.backward = backward
    return log


@pytest.mark.multiprocess
def test_the_backward_runs_in_the_pipelines_order() -> None:
    """Autograd takes ready ops highest sequence number first, so the forward's issue order
    makes each chunk's combine backward run before the previous chunk's expert backward is
    needed and each dispatch backward after its chunk's experts (the schedule the two
    streams overlap; on CUDA each op runs on its forward op's stream)."""
    two, four = run_distributed(_backward_order_both, 1, timeout=60)[0]
    assert two == ["C1'", "X1'", "C0'", "X0'", "D1'", "D0'"]
    assert four == ["C3'", "X3'", "C2'", "X2'", "C1'", "D3'", "X1'", "C0'", "D2'", "X0'", "D1'", "D0'"]


def _backward_order_both() -> tuple[list[str], list[str]]:
    return _backward_order(2), _backward_order(4)
