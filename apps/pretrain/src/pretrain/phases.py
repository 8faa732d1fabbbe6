"""Optional step-time breakdown: marks at the trainer's phase boundaries.

The trainer calls ``mark(name)`` where a phase starts (``forward``, ``backward``,
``grad_sync``, ``optimizer``, ``weight_rebuild``, ``stats``) and ``mark(None)`` at
the end of the step's device work; a phase lasts until the next mark. On CUDA a
mark records an event on the current stream, so the timer adds no host
synchronisation: ``collect()`` reads the events after the step's one
synchronisation point (the end-of-step read of the logged values). On CPU a mark
reads the wall clock. Phases that repeat (one forward per microbatch) add up.

Collectives run on their own streams: ``grad_sync`` is the time the compute
stream waits in ``finish_grad_sync`` for reductions not hidden behind the last
backward, which is the part a step actually pays.
"""

from __future__ import annotations

import time
from itertools import pairwise

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str | None, object]] = []

    def mark(self, phase: str | None) -> None:
        """``phase`` starts now (``None``: the step's device work ends)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append((phase, event))
        else:
            self._marks.append((phase, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Seconds per phase since the last ``collect``; call after the step synchronised."""
        marks, self._marks = self._marks, []
        out: dict[str, float] = {}
        for (phase, start), (_, end) in pairwise(marks):
            if phase is None:
                continue
            seconds = start.elapsed_time(end) / 1e3 if self.cuda else end - start
            out[phase] = out.get(phase, 0.0) + seconds
        return out
