"""Progress of ``prepare-data`` in input bytes: a tqdm bar on a terminal, plain lines otherwise.

A redrawn bar in a log file is one endless line of carriage returns, so when stderr is
not a terminal the same numbers (tqdm's own formatting: done, total, elapsed, ETA,
MB/s) are printed as a line every ``PLAIN_EVERY_S`` seconds and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

PLAIN_EVERY_S = 30.0
_FORMAT = "{desc}: {percentage:3.0f}% {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"


class Progress:
    def __init__(self, total_bytes: int, enabled: bool, stream: TextIO | None = None) -> None:
        from tqdm import tqdm

        self.stream = stream or sys.stderr
        self.total, self.done, self.enabled = total_bytes, 0, enabled
        self.started = self._last_line = time.monotonic()
        self._format_meter = tqdm.format_meter
        self._bar = None
        if enabled and self.stream.isatty():
            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="prepare-data",
                             file=self.stream, dynamic_ncols=True)

    def update(self, n_bytes: int) -> None:
        self.done += n_bytes
        if self._bar is not None:
            self._bar.update(n_bytes)
        elif self.enabled and time.monotonic() - self._last_line >= PLAIN_EVERY_S:
            self._line()

    def _line(self) -> None:
        self._last_line = time.monotonic()
        text = self._format_meter(self.done, self.total, self._last_line - self.started,
                                  prefix="prepare-data", unit="B", unit_scale=True,
                                  bar_format=_FORMAT)
        print(text, file=self.stream, flush=True)

    def close(self, finished: bool) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and finished:
            self._line()
