"""What a training run prints while it trains: one line per step with elapsed time and ETA.

On a terminal (stdout is a TTY) the steps drive a tqdm bar whose postfix holds the
step's numbers; piped into a file or another program each step is one plain line
(``step     3/300  loss ...  elapsed 0:00:02  eta 0:03:10``), which logs keep and
tests read. Notes (a saved checkpoint, a stop) go through ``write`` so that they
print above the bar instead of through it.

The ETA is the remaining steps of this process (to ``train.steps``, or
``train.stop_after`` when that comes first) times the mean step time since the
process's first step: the first step (allocation, warm-up, a CUDA graph capture)
is left out of the rate once a second step has run.

``Progress`` is a tracker (``pretrain.metrics``): ``log(record)`` once per step.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO


def step_numbers(record: Mapping[str, Any]) -> str:
    """A step's numbers (loss, LR, gradient norm, throughput, ...) as one line."""
    parts = [
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.2e}",
        f"grad_norm {record['grad_norm']:.3f}",
        f"tok/s {record['tokens_per_s']:,.0f}",
    ]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    if "mfu" in record:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    if "peak_mem_gib" in record:
        parts.append(f"mem {record['peak_mem_gib']:.1f} GiB")
    if record.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return "  ".join(parts)


def progress_line(record: Mapping[str, Any], total_steps: int) -> str:
    """A step's plain line (without the times)."""
    return f"step {record['step']:>5}/{total_steps}  {step_numbers(record)}"


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (as tqdm writes elapsed times)."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """The step lines (or bar) of one run on the logging rank.

    ``total_steps``: ``train.steps`` (shown as the denominator); ``last_step``: the
    step this process ends at (``train.stop_after`` when earlier); ``start_step``:
    the first step this process runs (after a resume, the checkpoint's step + 1);
    ``bar``: draw a tqdm bar (default: when ``stream`` is a terminal).
    """

    def __init__(self, total_steps: int, last_step: int, start_step: int = 1,
                 stream: TextIO | None = None, bar: bool | None = None) -> None:
        self.stream = stream or sys.stdout
        self.total_steps, self.last_step, self.start_step = total_steps, last_step, start_step
        self.started = time.perf_counter()
        self._first_done: float | None = None  # when this process's first step ended
        self._lock = threading.Lock()  # notes may come from the checkpoint writer's thread
        self._bar = None
        if self.stream.isatty() if bar is None else bar:
            from tqdm import tqdm

            self._bar = tqdm(total=last_step, initial=start_step - 1, file=self.stream,
                             unit="step", dynamic_ncols=True, smoothing=0.1,
                             bar_format="{n_fmt}/{total_fmt} {bar} [{elapsed}<{remaining}{postfix}]")

    def eta_s(self, step: int, now: float) -> float:
        """Seconds to ``last_step`` after ``step`` ended at ``now`` (``perf_counter``)."""
        done = step - self.start_step + 1
        if self._first_done is None or done < 2:
            per_step = (now - self.started) / max(done, 1)
        else:
            per_step = (now - self._first_done) / (done - 1)
        return per_step * max(self.last_step - step, 0)

    def log(self, record: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        step = record["step"]
        if self._first_done is None:
            self._first_done = now
        with self._lock:
            if self._bar is not None:
                self._bar.set_postfix_str(step_numbers(record), refresh=False)
                self._bar.update(1)
                return
            elapsed, eta = format_duration(now - self.started), format_duration(self.eta_s(step, now))
            print(f"{progress_line(record, self.total_steps)}  elapsed {elapsed}  eta {eta}",
                  file=self.stream, flush=True)

    def write(self, text: str) -> None:
        """A note, printed above the bar when there is one."""
        with self._lock:
            if self._bar is not None:
                self._bar.write(text, file=self.stream)
            else:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
