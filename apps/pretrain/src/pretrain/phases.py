"""Optional step-time breakdown: marks at the trainer's phase boundaries.

The trainer calls ``mark(name)`` where a phase starts (``forward``, ``backward``,
``grad_sync``, ``optimizer``, ``weight_rebuild``, ``stats``) and ``mark(None)`` at
the end of the step's device work; a phase lasts until the next mark. On CUDA a
mark records an event on the current stream, so the timer adds no host
synchronisation: ``collect()`` reads the events after the step's one
synchronisation point (the end-of-step read of the logged values). On CPU a mark
reads the wall clock. Phases that repeat (one forward per microbatch) add up. Marks
made while a CUDA graph is being captured are dropped: the replayed microbatches
(``train.cuda_graphs``) are one phase, ``graph``.

Collectives run on their own streams: ``grad_sync`` is the time the compute
stream waits in ``finish_grad_sync`` for reductions not hidden behind the last
backward, which is the part a step actually pays.

On CUDA a mark also reads the host clock, so ``collect`` can say how far ahead of
the device the host was at each mark (``min_host_lead_s``): the device time from
the first mark minus the host time from it. The first mark follows the previous
step's synchronisation, when the device has nothing queued, so the first phase
(the first microbatch's forward) always waits for its launches; the minimum is
taken over the marks after it. A lead that falls to about zero there means the
device waited for launches in the steady state: the step is host-bound.
"""

from __future__ import annotations

import time
from itertools import pairwise

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # (phase, CUDA event or None, host clock) per mark
        self._marks: list[tuple[str | None, torch.cuda.Event | None, float]] = []
        self.min_host_lead_s: float | None = None  # of the marks last collected; CUDA only

    def mark(self, phase: str | None) -> None:
        """``phase`` starts now (``None``: the step's device work ends)."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return  # recording a CUDA graph: its replay is timed as one phase (``graph``)
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((phase, event, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last ``collect``; call after the step synchronised.

        Also sets ``min_host_lead_s`` for these marks (module docstring)."""
        marks, self._marks = self._marks, []
        if self.cuda and len(marks) > 2:
            _, first, host0 = marks[0]
            self.min_host_lead_s = min(first.elapsed_time(event) / 1e3 - (host - host0)
                                       for _, event, host in marks[2:])
        out: dict[str, float] = {}
        for (phase, start, start_host), (_, end, end_host) in pairwise(marks):
            if phase is None:
                continue
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end_host - start_host
            out[phase] = out.get(phase, 0.0) + seconds
        return out
