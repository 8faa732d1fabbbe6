"""Stop requests: SIGTERM or SIGINT sets a flag that the loop reads at step boundaries.

A handler that only sets a flag is safe at any point of a step (it never runs
collective or CUDA work inside a signal frame). The ranks must agree before
anyone stops, or the ranks that did not get the signal would wait forever in the
next step's collectives: the trainer adds the flag to the one all-reduce each
step already makes (``pretrain.moe_stats``), so agreeing costs nothing. The run
then finishes its step, saves a checkpoint and exits 0.

SIGINT (Ctrl-C) is a stop request like SIGTERM, not a ``KeyboardInterrupt``: an
exception raised wherever the main thread happens to be would lose the step and the
checkpoint. A second signal aborts at once: the first restores the operating
system's default action for both, so the second ends the process in the kernel even
while it waits inside a collective or a kernel launch, where no Python handler
would run. The checkpoints already committed stay complete (a save in flight is
left as a partial directory that resuming ignores).
"""

from __future__ import annotations

import os
import signal
from types import FrameType, TracebackType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager installing the handler; restores the previous one on exit.

    ``announce``: write one line to stderr when the first signal arrives (what happens
    now, and that a second one aborts); one rank per host is enough.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 announce: bool = True) -> None:
        self.signals, self.announce = signals, announce
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        for sig in self.signals:  # the next one aborts, wherever the process is
            signal.signal(sig, signal.SIG_DFL)
        if self.announce:  # os.write: a signal frame must not re-enter a buffered stream
            os.write(2, (f"pretrain: received {self.received.name}: stopping after the current "
                         f"step and saving a checkpoint; {self.received.name} again aborts at "
                         "once without saving\n").encode())

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
