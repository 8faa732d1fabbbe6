"""Stop requests: SIGTERM sets a flag that the loop reads at step boundaries.

A handler that only sets a flag is safe at any point of a step (it never runs
collective or CUDA work inside a signal frame). The ranks must agree before
anyone stops, or the ranks that did not get the signal would wait forever in the
next step's collectives: the trainer adds the flag to the one all-reduce each
step already makes (``pretrain.moe_stats``), so agreeing costs nothing.
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType


class StopRequest:
    """Context manager installing the handler; restores the previous one on exit."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)

    def __enter__(self) -> StopRequest:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def describe(self) -> str:
        if self.received is None:
            return "another rank received a stop signal"
        return f"received {self.received.name}"

    @property
    def requested(self) -> bool:
        """This process received a stop signal."""
        return self.received is not None
