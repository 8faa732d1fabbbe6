"""Microbatches' forwards interleaved at the transport: one's tokens travel while another computes.

In an unsplit expert-parallel step every transport call is exposed: a layer's expert
GEMMs wait for its dispatch, and the next layer waits for its combine. With two
microbatches in flight, one's dispatch and combine can move tokens while the other's
attention, router and expert GEMMs run. :meth:`MicrobatchInterleave.run` runs the
forwards it is given (whole model forwards with their losses) as coroutines of one
thread and hands control from one to the next each time an ``EPDispatcher`` with this
interleave has issued a dispatch or a combine (:meth:`MicrobatchInterleave.transport_call`).
Two microbatches A and B then issue, per MoE layer::

    A: attention, router, dispatch | B: attention, router, dispatch |
    A: experts, combine            | B: experts, combine            | A: next layer ...

The transport calls go to the device's communication stream (``pipeline.comm_stream``:
the highest priority, or a green context's SMs), everything else to the caller's compute stream, with events
handing tensors across: the compute stream runs ``A.attention, B.attention, A.experts,
B.experts, A.next layer, ...`` while the communication stream runs ``A.dispatch,
B.dispatch, A.combine, B.combine, ...``, so each transport call runs under the other
microbatch's compute. A stream waits for the other only where it reads its result,
and that wait is issued after the hand-off: the other microbatch's work, issued in
between, does not queue behind it.

Backward: one backward over the microbatches' losses (``torch.autograd.backward``
of the list). Autograd runs each backward op on the stream its forward op ran on and
takes ready ops highest sequence number first; one thread means one sequence counter,
so the backward interleaves the microbatches in the reverse of the forward's order,
each microbatch's transport backward under the other's GEMMs (the mechanism of
:mod:`moe_ep_transport.pipeline`'s chunks). Every rank runs the same forwards and the
same backward graph, so the transport calls interleave identically on every rank, as
the rowwise transport's serialised phases need.

Memory: a tensor made on one stream and read on the other is recorded on the reader's
stream (``Tensor.record_stream``), as in the pipeline. Two microbatches' activations
are alive at once.

What each microbatch computes is exactly what it computes alone: the calls and their
inputs are the same, only their order across microbatches changes. The gradients are
sums over the microbatches, added in the backward's order instead of microbatch by
microbatch (the same terms, another order).

Why coroutines (``greenlet``): the model calls dispatch and combine deep inside its
forward, and handing control to another microbatch there, without the model knowing,
needs a coroutine that suspends a whole call stack. Threads could, but autograd's
sequence numbers, grad mode and autocast state are per thread; greenlets share the one
thread. The price is the contract on the forwards: nothing thread-local may be held
across a transport call that the other forward must not see (activation recompute
holds such state; a ``torch.cuda.stream`` context around the model would too).

On CPU there are no streams: the same calls run in the interleaved order, one after
another (what the CPU tests check against microbatches run one at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from moe_ep_transport.pipeline import _Streams

R = TypeVar("R")


class MicrobatchInterleave:
    """Runs forwards interleaved at their transport calls (module docstring).

    Shared by the dispatchers of every MoE layer of a model part: a forward's calls
    hand control to the next forward whichever layer makes them. ``comm_sms``: the
    communication stream's SMs (a CUDA green context, as ``EPConfig.comm_sms`` for the
    chunked pipeline); ``None``: every SM, at the highest priority.
    """

    def __init__(self, comm_sms: int | None = None) -> None:
        if comm_sms is not None and comm_sms < 1:
            raise ValueError(f"MicrobatchInterleave: comm_sms must be a positive count, got {comm_sms}")
        self.comm_sms = comm_sms
        self._turns: list[Any] = []  # the greenlets of the running forwards, in turn order
        self._scheduler: Any = None  # the greenlet that runs them (the caller of run)

    @property
    def interleaving(self) -> bool:
        """Whether the caller is one of the forwards of a running :meth:`run`."""
        if self._scheduler is None:
            return False
        from greenlet import getcurrent

        return getcurrent() in self._turns

    def run(self, forwards: Sequence[Callable[[], R]]) -> list[R]:
        """Each forward's result, in order. The forwards take turns: each runs until its next
        transport call is issued, then the next live one continues; a forward's error is
        raised here once the others are stopped."""
        from greenlet import GreenletExit, getcurrent, greenlet

        if self._scheduler is not None:
            raise RuntimeError("MicrobatchInterleave.run: already running (a forward may not start another run)")
        results: list[Any] = [None] * len(forwards)

        def turn(index: int, forward: Callable[[], R]) -> Callable[[], None]:
            def body() -> None:
                results[index] = forward()
            return body

        self._scheduler = getcurrent()
        self._turns = [greenlet(turn(i, f), parent=self._scheduler) for i, f in enumerate(forwards)]
        try:
            while not all(g.dead for g in self._turns):
                for g in self._turns:
                    if not g.dead:
                        g.switch()  # returns at its next hand-off or when it ends
        except BaseException:
            for g in self._turns:
                if not g.dead:
                    g.throw(GreenletExit)  # unwind its stack (its context managers exit)
            raise
        finally:
            self._scheduler, self._turns = None, []
        return results

    def hand_off(self) -> None:
        """Let the other forwards run until their next transport call (no-op outside :meth:`run`)."""
        if self.interleaving:
            self._scheduler.switch()

    def transport_call(
        self, call: Callable[[], R], inputs: Sequence[torch.Tensor], outputs: Callable[[R], Sequence[torch.Tensor]],
    ) -> R:
        """``call()`` (a dispatch or a combine) on the communication stream, then the hand-off.

        ``inputs``: the tensors ``call`` reads that the compute stream made; ``outputs``
        picks from the result the tensors the compute stream will read. The compute stream
        waits for the call's work only when this forward resumes, so the work the other
        forwards issue meanwhile does not wait for it. Outside :meth:`run`, ``call()`` as is.
        """
        if not self.interleaving:
            return call()
        streams = _Streams(inputs[0].device, self.comm_sms)
        streams.used_on("comm", *inputs)
        streams.comm_after_compute()
        with streams.on_comm():
            result = call()
            done = streams.mark("comm")
        streams.used_on("compute", *outputs(result))
        self.hand_off()
        streams.wait("compute", done)
        return result
