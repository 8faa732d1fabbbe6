"""GPU tests: NVSHMEM rowwise == all-to-all bit for bit, no host sync, CUDA graph replay,
overflow, kernels, launches per direction, the two-stream pipeline of ``run_experts``,
interleaved microbatches.

Run on two GPUs with nvshmem4py installed:
    tools/from_source.sh python3 -m pytest -p moe_testing.pytest_plugin \
        packages/moe-ep-transport/tests/test_gpu.py -m "gpu or multigpu"
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import (  # noqa: E402
    BytesCodec,
    check_partial_kernels,
    check_plan_kernels,
    check_plan_with_the_count_exchange,
    forward_backward,
)
from moe_ep_transport import EPConfig, EPDispatcher, EPOverflowError, make_transport, ops  # noqa: E402

E, K, D, T = 64, 8, 1024, 2048


def _warm_up_on_a_side_stream(fn: Callable[[], object]) -> None:
    """Run ``fn`` once on a side stream, as CUDA graph capture wants it warmed up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _replays_to(run: Callable[[], list[torch.Tensor]], want: list[torch.Tensor], scope: Callable = nullcontext,
                replays: int = 2) -> bool:
    """``run`` (warmed up on a side stream) captured in a CUDA graph inside ``scope()``
    replays ``replays`` times to ``want``, its outputs zeroed before each replay."""
    _warm_up_on_a_side_stream(run)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), scope():
        got = run()
    ok = True
    for _ in range(replays):
        for y in got:
            y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ok &= all(torch.equal(y, w) for y, w in zip(got, want, strict=True))
    del graph
    return ok


def _experts(rows_CD: torch.Tensor, scale_L: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """A sync-free toy expert: each row scaled by its expert's weight (searchsorted on offsets)."""
    rows_idx = torch.arange(rows_CD.shape[0], device=rows_CD.device, dtype=torch.int32)
    expert = torch.searchsorted(offsets_L, rows_idx, right=True).clamp(max=scale_L.numel() - 1)
    return torch.tanh(rows_CD * scale_L.index_select(0, expert).unsqueeze(1))


def _step(dispatcher: EPDispatcher, x, ids, w, g, scale, stage: bool = True):
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    rows, offsets, handle = dispatcher.dispatch(x, ids, w if stage else None)  # as the MoE layer does
    y = dispatcher.combine(_experts(rows, scale, offsets), w, handle)
    (y.float() * g).sum().backward()
    return dict(rows=rows.detach(), offsets=offsets, y=y.detach(), dx=x.grad, dw=w.grad,
                dropped=handle.plan.dropped_M)


def _inputs(rank: int, skew: float, device):
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    logits = torch.randn(T, E, generator=gen) + skew * torch.linspace(3, 0, E)
    top = torch.topk(logits, K, dim=1)
    w = torch.softmax(top.values, dim=1)
    g = torch.randn(T, D, generator=gen)
    scale = torch.linspace(0.5, 1.5, E // dist.get_world_size()).to(torch.bfloat16)  # keeps rows BF16
    return [t.to(device) for t in (x, top.indices, w, g, scale)]


def _rowwise_equals_all_to_all() -> list:
    from moe_ep_transport import nvshmem_memory

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    report = []
    for capacity_factor, skew, codec, combine, copy_engine in (
        (None, 0.0, None, "auto", False), (1.0, 2.0, None, "auto", False), (1.25, 1.0, BytesCodec(), "auto", False),
        (1.0, 2.0, None, "source", False), (1.25, 1.0, BytesCodec(), "source", False),
        (1.0, 2.0, None, "auto", True), (1.25, 1.0, BytesCodec(), "source", True),
    ):  # "auto" sums at the destination here (top-8 over two ranks); copy_engine: the blocks by copy engines
        cfg = EPConfig(E, K, T, D, capacity_factor=capacity_factor, combine=combine, copy_engine=copy_engine)
        inputs = _inputs(rank, skew, device)
        a2a = make_transport("all_to_all", cfg)
        rowwise = make_transport("rowwise", cfg, device=device, codec=codec)
        want = _step(EPDispatcher(cfg, a2a, codec=codec), *inputs, stage=False)
        for stage in (True, False):  # twice: the second call reuses the other slab parity
            got = _step(EPDispatcher(cfg, rowwise, codec=codec), *inputs, stage=stage)
            for key, value in want.items():
                assert torch.equal(got[key], value), (capacity_factor, combine, copy_engine, key)
        rowwise.close()
        report.append(int(want["dropped"].sum()))
    nvshmem_memory.finalize()
    return report


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_rowwise_equals_all_to_all_bit_for_bit() -> None:
    out = run_distributed(_rowwise_equals_all_to_all, 2, backend="nccl", timeout=300)
    assert out[0][0] == 0 and out[0][1] > 0 and out[0][3] > 0  # dropless, then a skew that overflows


def _no_host_sync() -> bool:
    from moe_ep_transport import nvshmem_memory

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    ok = True
    for combine, copy_engine in (("destination", False), ("source", False), ("destination", True)):
        cfg = EPConfig(E, K, T, D, capacity_factor=1.25, combine=combine, copy_engine=copy_engine)
        transport = make_transport("rowwise", cfg, device=device)
        dispatcher = EPDispatcher(cfg, transport)
        inputs = _inputs(rank, 1.0, device)
        _step(dispatcher, *inputs)  # warm-up: Triton compiles, caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                _step(dispatcher, *inputs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        stats = dispatcher.telemetry.pop()
        transport.close()
        ok &= int(stats["tokens_per_expert"].sum()) == 4 * 2 * T * K
    nvshmem_memory.finalize()
    return ok


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_rowwise_dispatch_combine_backward_without_host_sync() -> None:
    assert run_distributed(_no_host_sync, 2, backend="nccl", timeout=300) == [True, True]


def _graph_replay() -> bool:
    """Two dispatch+combine calls captured in a CUDA graph replay to the eager result, with the
    put kernel's stores and with the copy engines' blocks (memcpy nodes in the graph)."""
    from moe_ep_transport import nvshmem_memory

    # both on every rank (a rank that skipped one would leave its peer in a barrier)
    ok = [_replays_like_eager(copy_engine=False), _replays_like_eager(copy_engine=True)]
    nvshmem_memory.finalize()
    return all(ok)


def _replays_like_eager(copy_engine: bool) -> bool:
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = EPConfig(E, K, T, D, capacity_factor=1.0, copy_engine=copy_engine)
    transport = make_transport("rowwise", cfg, device=device)
    dispatcher = EPDispatcher(cfg, transport)
    x, ids, w, _, _ = _inputs(dist.get_rank(), 2.0, device)  # a skew that overflows: drops inside the graph

    def step() -> torch.Tensor:
        with torch.no_grad():
            rows, _, handle = dispatcher.dispatch(x, ids, w)
            return dispatcher.combine(rows, w, handle)

    want = step()
    # an even number of slab phases: replays alternate like eager calls
    ok = _replays_to(lambda: [step(), step()], [want, want], replays=3)
    transport.close()
    return ok


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_rowwise_dispatch_combine_replays_from_a_cuda_graph() -> None:
    assert run_distributed(_graph_replay, 2, backend="nccl", timeout=300) == [True, True]


def _pipelined(dispatcher: EPDispatcher, x, ids, w, g, scale) -> dict:
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    y, _ = dispatcher.run_experts(x, ids, w, lambda rows, offsets: _experts(rows, scale, offsets))
    (y.float() * g).sum().backward()
    return dict(y=y.detach(), dx=x.grad, dw=w.grad)


# The transport's moves a backward can run (combine's backward at the destinations is
# send_grads, which on the kernel path puts without calling send).
_TRANSPORT_MOVES = ("send", "send_grads", "gather_sum", "reduce_back", "send_back")


def _backward_streams(dispatcher: EPDispatcher, inputs: list) -> tuple[set, set]:
    """The CUDA streams the transport's and the experts' backward ops ran on (each should be
    its forward op's: the communication stream, the caller's)."""
    x, ids, w, g, scale = inputs
    transport, seen_transport, seen_experts = dispatcher.transport, set(), set()
    for name in _TRANSPORT_MOVES:
        method = getattr(transport, name)

        def logged(*args, _method=method, **kwargs):
            seen_transport.add(torch.cuda.current_stream().cuda_stream)
            return _method(*args, **kwargs)

        setattr(transport, name, logged)

    class Experts(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, offsets):
            return _experts(rows, scale, offsets)

        @staticmethod
        def backward(ctx, grad):  # only its stream matters here, not its value
            seen_experts.add(torch.cuda.current_stream().cuda_stream)
            return grad, None

    x = x.clone().requires_grad_(True)
    y, _ = dispatcher.run_experts(x, ids, w, Experts.apply)
    seen_transport.clear()  # the forward's calls
    (y.float() * g).sum().backward()
    for name in _TRANSPORT_MOVES:
        delattr(transport, name)
    return seen_transport, seen_experts


def _forward_replays(dispatcher: EPDispatcher, inputs: list, want_y: torch.Tensor) -> bool:
    """``run_experts``' forward captured in a CUDA graph (inside ``replayable()``) replays to ``want_y``."""
    x, ids, w, _, scale = inputs

    def forward() -> list[torch.Tensor]:
        with torch.no_grad():
            return [dispatcher.run_experts(x, ids, w, lambda rows, offsets: _experts(rows, scale, offsets))[0]]

    return _replays_to(forward, [want_y], dispatcher.transport.replayable)


def _pipeline_equals_unsplit(cases: list[tuple[int, int | None]]) -> list:
    """``run_experts`` in each ``(chunks, comm_sms)`` of ``cases`` equals the unsplit call bit
    for bit, forward and backward (the toy expert computes each row alone); warmed up, it
    runs without a host synchronisation; its forward replays from a CUDA graph (the two
    streams fork from and join the captured one); its backward runs the transport on the
    communication stream and the experts on the caller's (autograd's stream rule)."""
    from moe_ep_transport import nvshmem_memory

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    inputs = _inputs(rank, 1.0, device)
    unsplit_cfg = EPConfig(E, K, T, D, capacity_factor=None)
    transport = make_transport("rowwise", unsplit_cfg, device=device)
    want = _pipelined(EPDispatcher(unsplit_cfg, transport), *inputs)
    transport.close()
    report = []
    for chunks, comm_sms in cases:
        cfg = EPConfig(E, K, math.ceil(T / chunks), D, capacity_factor=None, overlap_chunks=chunks,
                       comm_sms=comm_sms)
        transport = make_transport("rowwise", cfg, device=device)
        dispatcher = EPDispatcher(cfg, transport)
        got = _pipelined(dispatcher, *inputs)
        same = all(torch.equal(got[key], want[key]) for key in want)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _pipelined(dispatcher, *inputs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replayed = _forward_replays(dispatcher, inputs, want["y"])
        transport_streams, experts_streams = _backward_streams(dispatcher, inputs)
        from moe_ep_transport.pipeline import comm_stream

        same &= transport_streams == {comm_stream(device, comm_sms).cuda_stream}
        same &= experts_streams == {torch.cuda.current_stream().cuda_stream}
        transport.close()
        report.append((chunks, comm_sms, same, replayed))
    nvshmem_memory.finalize()
    return report


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
@pytest.mark.parametrize("cases", [[(2, None), (3, None)], [(2, 16)]], ids=["streams", "green-context"])
def test_pipelined_run_experts_equals_unsplit_bit_for_bit(cases) -> None:
    # 3 chunks do not divide T; (2, 16): the communication stream bounded to 16 SMs
    for report in run_distributed(_pipeline_equals_unsplit, 2, cases, backend="nccl", timeout=300):
        for chunks, comm_sms, same, replayed in report:
            assert same, (chunks, comm_sms, "eager forward and backward, the backward's streams")
            assert replayed, (chunks, comm_sms, "forward replayed from a CUDA graph")


def _two_layers(dispatchers: list[EPDispatcher], x, ids, w, scale) -> torch.Tensor:
    """Two MoE layers of the toy expert with a residual (the second routes as the first)."""
    h = x
    for dispatcher in dispatchers:
        rows, offsets, handle = dispatcher.dispatch(h, ids, w)
        h = h + dispatcher.combine(_experts(rows, scale, offsets), w, handle)
    return h


def _interleave_equals_one_at_a_time(comm_sms: int | None) -> list:
    """Two microbatches through two EP layers, interleaved (``MicrobatchInterleave``) and one
    at a time: each microbatch's output and input gradient bit for bit; warmed up, no host
    synchronisation; the forward's transport calls on the communication stream; the
    interleaved forward replays from a CUDA graph."""
    from moe_ep_transport import MicrobatchInterleave, nvshmem_memory
    from moe_ep_transport.pipeline import comm_stream

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    batches = [_inputs(rank, 1.0, device), _inputs(rank + 2, 1.0, device)]
    cfg = EPConfig(E, K, T, D, capacity_factor=None)
    transport = make_transport("rowwise", cfg, device=device)
    interleave = MicrobatchInterleave(comm_sms)
    layers = [EPDispatcher(cfg, transport, seed=i, interleave=interleave) for i in range(2)]

    def run(interleaved: bool) -> list[dict]:
        xs = [b[0].clone().requires_grad_(True) for b in batches]

        def loss(i: int):
            _, ids, w, g, scale = batches[i]
            return lambda: (_two_layers(layers, xs[i], ids, w, scale).float() * g).sum()

        losses = forward_backward([loss(0), loss(1)], interleave if interleaved else None)
        return [dict(loss=losses[i].detach(), dx=xs[i].grad) for i in range(2)]

    want, got = run(False), run(True)
    same = all(torch.equal(got[i][k], want[i][k]) for i in range(2) for k in want[i])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    def forward() -> list[torch.Tensor]:
        with torch.no_grad():
            return interleave.run([lambda i=i: _two_layers(layers, batches[i][0], *batches[i][1:3],
                                                           batches[i][4]) for i in range(2)])

    streams: set[int] = set()
    send = transport.send
    transport.send = lambda *a, **kw: streams.add(torch.cuda.current_stream().cuda_stream) or send(*a, **kw)
    want_y = forward()
    del transport.send
    on_comm = streams == {comm_stream(device, comm_sms).cuda_stream}
    replayed = _replays_to(forward, want_y, transport.replayable)
    transport.close()
    nvshmem_memory.finalize()
    return [same, on_comm, replayed]


def _check_interleave(ranks: int, comm_sms: int | None) -> None:
    for same, on_comm, replayed in run_distributed(_interleave_equals_one_at_a_time, ranks, comm_sms,
                                                   backend="nccl", timeout=300):
        assert same, "eager forward and backward, each microbatch against it alone"
        assert on_comm, "the transport's calls on the communication stream"
        assert replayed, "the interleaved forward replayed from a CUDA graph"


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
@pytest.mark.parametrize("comm_sms", [None, 16], ids=["streams", "green-context"])
def test_interleaved_microbatches_equal_one_at_a_time_bit_for_bit(comm_sms) -> None:
    _check_interleave(2, comm_sms)


@pytest.mark.multiprocess
@pytest.mark.gpu
def test_interleaved_microbatches_on_an_ep_group_of_one_gpu() -> None:
    """The same on one GPU: every row stays on the rank, but the plan, put, barrier and
    receive kernels run on the communication stream as on two (what one GPU can check)."""
    _check_interleave(1, None)


def _overflow_error() -> list:
    from moe_ep_transport import nvshmem_memory

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = EPConfig(E, K, T, D, capacity_factor=1.0, overflow="error")
    transport = make_transport("rowwise", cfg, device=device)
    x, ids, w, g, scale = _inputs(rank, 3.0, device)
    try:
        EPDispatcher(cfg, transport).dispatch(x, ids)
        raised = ""
    except EPOverflowError as e:
        raised = str(e)
    # The transport is still usable after the error (nothing moved): a dropless-sized call works.
    ok_ids = (torch.arange(T * K, device=device).view(T, K) * 7) % E
    rows, offsets, handle = EPDispatcher(cfg, transport).dispatch(x, ok_ids)
    transport.close()
    nvshmem_memory.finalize()
    return [raised, int(handle.plan.dropped_M.sum())]


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_overflow_error_policy_raises_on_both_ranks() -> None:
    out = run_distributed(_overflow_error, 2, backend="nccl", timeout=300)
    for raised, dropped in out:
        assert "capacity" in raised and dropped == 0


def _device_work_per_direction(combine: str) -> dict[str, list[str]]:
    """Every device operation (kernel, copy, fill) the profiler records in each direction
    of ``_launch_counter``'s training step, on an NVSHMEM EP group of one GPU; warmed up.
    Backward directions run as two backward calls, combine's output gradient fed to
    dispatch's by hand, so that each is recorded alone."""
    from moe_ep_transport import nvshmem_memory
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = EPConfig(E, K, T, D, capacity_factor=1.0, combine=combine)
    transport = make_transport("rowwise", cfg, device=device)
    dispatcher = EPDispatcher(cfg, transport)
    x, ids, w, g, _ = _inputs(dist.get_rank(), 1.0, device)
    g = g.to(x.dtype)
    found: dict[str, list[str]] = {}

    def recorded(direction: str, fn: Callable[[], object]):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        found[direction] = sorted(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        return out

    def training() -> None:  # as the MoE layer calls them: the weights are given to dispatch too
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        rows, _, handle = recorded("dispatch", lambda: dispatcher.dispatch(xg, ids, wg))
        rows_in = rows.detach().requires_grad_(True)
        y = recorded("combine", lambda: dispatcher.combine(rows_in, wg, handle))
        recorded("combine_backward", lambda: y.backward(g))
        recorded("dispatch_backward", lambda: rows.backward(rows_in.grad))
        recorded("no_grad", no_grad)

    @torch.no_grad()
    def no_grad() -> torch.Tensor:
        rows, _, handle = dispatcher.dispatch(x, ids, w)
        return dispatcher.combine(rows, w, handle)

    training()
    found.clear()
    training()
    transport.close()
    nvshmem_memory.finalize()
    return found


@pytest.mark.multiprocess
@pytest.mark.gpu
@pytest.mark.parametrize("combine", ["source", "destination"])
def test_launches_per_direction_on_nvshmem(combine: str) -> None:
    """The launch counts ``test_launch_count`` pins on the rank threads, less the cell plan's
    launch, which runs in the block scan's last program where barriers pass inside kernels:
    counted as device work under the profiler, so aten ops and copies count too."""
    from _launch_counter import KERNELS_WITH_BARRIERS_IN_KERNELS

    [found] = run_distributed(_device_work_per_direction, 1, combine, backend="nccl", timeout=300)
    for direction, want in KERNELS_WITH_BARRIERS_IN_KERNELS[combine].items():
        assert len(found[direction]) == want, (combine, direction, found[direction])


@pytest.mark.gpu
def test_triton_kernels_equal_torch_reference_on_cuda() -> None:
    gen = torch.Generator().manual_seed(0)
    n_tok, k, width, me = 3000, 8, 2048, 1
    inbox = torch.randn(n_tok * k, width, generator=gen).to(torch.bfloat16).cuda()
    local = torch.randn(5000, width, generator=gen).to(torch.bfloat16).cuda()
    rank = torch.randint(-1, 3, (n_tok * k,), generator=gen).cuda()
    row = torch.randint(0, 5000, (n_tok * k,), generator=gen).cuda()
    w = torch.rand(n_tok * k, generator=gen).cuda()
    y, rows = ops.topk_gather_sum(inbox, local, rank, row, me, w, k, torch.bfloat16, True)
    y_ref, rows_ref = ops.topk_gather_sum_reference(inbox, local, rank, row, me, w, k, torch.bfloat16, True)
    assert torch.equal(y, y_ref) and torch.equal(rows, rows_ref)
    out = torch.randint(0, 100, (4000, 1024), dtype=torch.int32, generator=gen).cuda()
    inbox = torch.randint(0, 100, (4000, 1024), dtype=torch.int32, generator=gen).cuda()
    row_src = torch.randint(-1, 3, (4000,), generator=gen).cuda()
    origin_in = torch.randint(0, 1 << 40, (4000,), generator=gen).cuda()
    want, want_origin = out.clone(), torch.zeros_like(origin_in)
    ops.finish_receive_reference(want, inbox, row_src, 1, origin_in, want_origin)
    origin = torch.zeros_like(origin_in)
    ops.finish_receive(out, inbox, row_src, 1, origin_in, origin)
    assert torch.equal(out, want) and torch.equal(origin, want_origin)
    # The token inbox of a deduplicating put: 3 ranks x 500 tokens, origins are slot indices.
    origin_in = torch.randint(0, 500 * k, (4000,), generator=gen).cuda()
    want = out.clone()
    ops.finish_receive_reference(want, inbox, row_src, 1, origin_in, None, k, 500)
    ops.finish_receive(out, inbox, row_src, 1, origin_in, None, k, 500)
    assert torch.equal(out, want)
    # Combine's backward: scaled rows bit for bit, weight gradients within FP32 rounding.
    g = torch.randn(n_tok, width, generator=gen).cuda()
    rows = torch.randn(n_tok * k, width, generator=gen).to(torch.bfloat16).cuda()
    scaled, grad_w = ops.combine_grads(g, w, rows, torch.bfloat16, True)
    want_scaled, want_w = ops.combine_grads_reference(g, w, rows, torch.bfloat16, True)
    assert torch.equal(scaled, want_scaled)
    torch.testing.assert_close(grad_w, want_w, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
def test_plan_kernels_equal_torch_reference_on_cuda() -> None:
    check_plan_kernels("cuda")


@pytest.mark.gpu
def test_plan_with_the_count_exchange_equals_torch_reference_on_cuda() -> None:
    check_plan_with_the_count_exchange("cuda")


@pytest.mark.gpu
def test_destination_sum_kernels_equal_torch_reference_on_cuda() -> None:
    check_partial_kernels("cuda", torch.bfloat16)


@pytest.mark.gpu
def test_copy_engine_copies_are_stream_ordered_and_replay_from_a_cuda_graph() -> None:
    """``_copy_engine.copy_to`` (``cuMemcpyDtoDAsync`` to a raw address) on one GPU: after a
    kernel that writes its source on a side stream (the copy waits for it), into a row
    offset of a larger buffer (nothing around it touched), and captured into a CUDA graph
    whose replays copy what the source holds then."""
    from moe_ep_transport._copy_engine import copy_to

    side = torch.cuda.Stream()
    src = torch.empty(4096, 2048, dtype=torch.bfloat16, device="cuda")
    dst = torch.zeros(3 * 4096, 2048, dtype=torch.bfloat16, device="cuda")
    at = dst.data_ptr() + 4096 * 2048 * 2  # rows 4096.. of dst
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the copy must wait for the fill behind it
        src.fill_(3.0)
        copy_to(at, src)
    side.synchronize()
    assert bool((dst[4096:8192] == 3.0).all()) and not dst[:4096].any() and not dst[8192:].any()

    dst.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_to(at, src)
    for value in (5.0, -1.0):
        src.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert bool((dst[4096:8192] == value).all()) and not dst[:4096].any() and not dst[8192:].any()
