"""Dispatch and combine overlapped with the expert GEMMs: a chunked two-stream pipeline.

Shape legend: T tokens on this rank, D width, k top-k, n chunks.

``run_pipelined`` splits a layer's tokens into ``n`` chunks (``torch.tensor_split``:
sizes differ by at most one, empty chunks when ``T < n``; every rank makes the same
``n`` calls whatever its ``T``, as the transport's collectives need) and issues, on the
host, in this order::

    D0; for c in 0..n-1: D(c+1), C(c-1), X(c); then C(n-1)

``D`` (dispatch) and ``C`` (combine) go to one communication stream per device, created
at the highest priority, ``X`` (the chunk's expert GEMMs) to the caller's stream (the
compute stream), with events handing the rows across: ``X(c)`` waits for ``D(c)``,
``C(c)`` for ``X(c)``. While chunk ``c``'s GEMMs run, chunk ``c + 1``'s dispatch and
chunk ``c - 1``'s combine move tokens. Two chunks:

| | communication stream | compute stream |
|---|---|---|
| forward | ``D0``, ``D1``, (after ``X0``) ``C0``, (after ``X1``) ``C1`` | (after ``D0``) ``X0``, (after ``D1``) ``X1`` |
| backward | ``C1'``, ``C0'``, (after ``X1'``) ``D1'``, (after ``X0'``) ``D0'`` | (after ``C1'``) ``X1'``, (after ``C0'``) ``X0'`` |

The backward needs no code of its own: autograd runs each backward op on the stream
its forward op ran on (the stream current when the ``autograd.Function`` was applied),
makes a consumer wait for a gradient made on another stream, and records that
gradient on the consumer's stream for the caching allocator. Its engine takes ready
ops highest sequence number first, so the order above (``C1'``, ``X1'``, ``C0'``,
``X0'``, ``D1'``, ``D0'`` on the host) follows from the forward's issue order:
``C0'`` runs under ``X1'``, ``D1'`` under ``X0'``. All transport phases of a device run
on its one communication stream, in the same order on every rank (the backward's
order is the engine's, a function of the graph, the same on every rank): the rowwise
transport's barriers and alternating slabs need its phases serialised.

Memory: a tensor made on one stream and read on the other is recorded on the reader's
stream (``Tensor.record_stream``), so the allocator does not hand its memory out
while the reader may still use it, also when autograd frees a saved tensor after the
backward read it: the dispatched rows and offsets (made on the communication stream,
read and saved by the expert GEMMs), the expert outputs (saved by combine), the
inputs and weights (read by dispatch, the weights saved by combine), each chunk's
output (concatenated on the compute stream). The forward starts with the
communication stream waiting for the compute stream and ends with the reverse, so it
is a fork and join: a CUDA graph captures it as it captures one stream.

What each chunk computes is the unsplit layer's, token by token: combine sums a
token's ``k`` contributions in the same FP32 order whichever tokens share its call, so
where the experts compute each row alone (the Triton grouped GEMM: a row's dot products
run over ``K`` in the same blocks whatever rows surround it) ``y``, the inputs' and the
routing weights' gradients are bit for bit the unsplit ones; a CPU BLAS matmul picks its
kernel by the row count and moves the last bits. The expert weights' gradients are
sums over the chunks' rows, added chunk by chunk (autograd, or one merged
weight-gradient launch over the chunks' rows into a gradient sink: moe_model's
``MergingSink``): the same terms in another order. Routing
counts and the load-balancing losses are the router's, before dispatch: unchanged.
Drops: each chunk is a call with its own capacity (``EPConfig.max_tokens`` is the
chunk's bound, so the layer's rows and buffers stay those of one unsplit call), so
with a capacity factor the slots dropped are decided per chunk, which can drop other
slots than the unsplit call would; dropless layers drop nothing either way.

The SM split between the streams is the hardware's: the put and receive kernels'
grids are sized by their rows, the persistent grouped GEMM launches one program per
SM, and the block scheduler gives free SMs to the waiting blocks of the higher-priority
stream first. A persistent program holds its SM until its kernel ends, so while a
persistent GEMM runs, the communication stream's kernels find no free SM unless the
GEMMs leave some (torch's SM carveout, ``torch._C._set_sm_carveout_experimental``, which
cuBLAS, ``torch._grouped_mm`` and moe_model's persistent GEMM honour); copies by the copy
engines (``EPConfig.copy_engine``) need none. ``EPConfig.comm_sms`` bounds the
communication stream to that many SMs (a CUDA green context: its kernels run on a fixed
SM partition, the GEMMs keep every SM), the knob to sweep with ``tools/bench_ep_overlap.py``.

On CPU there are no streams: the same calls run in the same order, one after another
(what the CPU tests check against the unsplit layer and one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moe_ep_transport.dispatcher import EPDispatcher, EPHandle

ExpertsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows[C,D], offsets[L]) -> rows_out[C,D]

_HIGHEST_PRIORITY = -(2**15)  # torch.cuda.Stream maps a priority past the range to the highest


@dataclass
class PipelinedHandle:
    """The handles of one pipelined call, one per chunk in token order."""

    chunks: list[EPHandle]


_comm_streams: dict[tuple[int, int | None], torch.cuda.Stream] = {}
_green_contexts: list[object] = []  # alive as long as the process: their streams are cached


def comm_stream(device: torch.device, comm_sms: int | None) -> torch.cuda.Stream:
    """The device's communication stream (one per device and SM bound, made once): the
    highest priority, or, with ``comm_sms``, a stream of a green context of that many SMs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, comm_sms)
    if key not in _comm_streams:
        if comm_sms is None:
            _comm_streams[key] = torch.cuda.Stream(index, priority=_HIGHEST_PRIORITY)
        else:
            from torch.cuda.green_contexts import GreenContext

            if not hasattr(GreenContext, "Stream"):
                raise RuntimeError(f"EPConfig.comm_sms needs a torch whose green contexts make "
                                   f"streams (GreenContext.Stream); torch {torch.__version__} has none")
            context = GreenContext.create(num_sms=comm_sms, device_id=index)  # older torch: create only
            _green_contexts.append(context)
            _comm_streams[key] = context.Stream()
    return _comm_streams[key]


class _Streams:
    """Where the pipeline's two kinds of work go; on CPU every method is a no-op."""

    def __init__(self, device: torch.device, comm_sms: int | None) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.comm = comm_stream(device, comm_sms)

    def on_comm(self) -> torch.cuda.StreamContext | _NoStream:
        return torch.cuda.stream(self.comm) if self.cuda else _NoStream()

    def comm_after_compute(self) -> None:
        if self.cuda:
            self.comm.wait_stream(self.compute)

    def compute_after_comm(self) -> None:
        if self.cuda:
            self.compute.wait_stream(self.comm)

    def mark(self, stream_name: str) -> torch.cuda.Event | None:
        """An event after the work issued so far on ``stream_name`` ("comm" or "compute")."""
        return getattr(self, stream_name).record_event() if self.cuda else None

    def wait(self, stream_name: str, event: torch.cuda.Event | None) -> None:
        if event is not None:
            getattr(self, stream_name).wait_event(event)

    def used_on(self, stream_name: str, *tensors: torch.Tensor) -> None:
        """``tensors`` (made on the other stream) are read on ``stream_name``."""
        if self.cuda:
            for t in tensors:
                t.record_stream(getattr(self, stream_name))


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_pipelined(
    dispatcher: EPDispatcher, x_TD: torch.Tensor, expert_ids_Tk: torch.Tensor, weights_Tk: torch.Tensor,
    experts: ExpertsFn, chunks: int,
) -> tuple[torch.Tensor, PipelinedHandle]:
    """``combine(experts(dispatch(x)))`` over ``chunks`` token chunks, pipelined (module docstring)."""
    T, max_tokens = x_TD.shape[0], dispatcher.cfg.max_tokens
    if T > chunks * max_tokens:
        raise ValueError(
            f"x has {T} tokens; {chunks} chunks (EPConfig.overlap_chunks) of at most "
            f"EPConfig.max_tokens={max_tokens} tokens hold {chunks * max_tokens}"
        )
    streams = _Streams(x_TD.device, dispatcher.cfg.comm_sms)
    xs = x_TD.tensor_split(chunks)
    ids = expert_ids_Tk.tensor_split(chunks)
    ws = weights_Tk.tensor_split(chunks)  # the same views go to dispatch and combine (staging)
    streams.used_on("comm", x_TD, expert_ids_Tk, weights_Tk)
    streams.comm_after_compute()
    sent: list[tuple[torch.Tensor, torch.Tensor, EPHandle]] = []
    arrived: list[torch.cuda.Event | None] = []
    outs: list[torch.Tensor] = []
    done: list[torch.cuda.Event | None] = []
    ys: list[torch.Tensor] = []

    def dispatch(c: int) -> None:
        with streams.on_comm():
            rows, offsets, handle = dispatcher.dispatch(xs[c], ids[c], ws[c])
            arrived.append(streams.mark("comm"))
        streams.used_on("compute", rows, offsets)
        sent.append((rows, offsets, handle))

    def combine(c: int) -> None:
        with streams.on_comm():
            streams.wait("comm", done[c])
            y = dispatcher.combine(outs[c], ws[c], sent[c][2])
        streams.used_on("compute", y)
        ys.append(y)

    dispatch(0)
    for c in range(chunks):
        if c + 1 < chunks:
            dispatch(c + 1)
        if c > 0:
            combine(c - 1)
        streams.wait("compute", arrived[c])
        rows, offsets, _ = sent[c]
        out = experts(rows, offsets)
        streams.used_on("comm", out)
        outs.append(out)
        done.append(streams.mark("compute"))
    combine(chunks - 1)
    streams.compute_after_comm()
    return torch.cat(ys), PipelinedHandle([handle for _, _, handle in sent])
