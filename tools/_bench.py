"""What every benchmark under ``tools/`` shares: one CUDA-event timer and the matmul ceiling.

A tool runs as a script (``python3 tools/<name>.py``), so this directory is first on
``sys.path`` and ``import _bench`` finds this module. Otherwise tools import the packages'
and the app's API, not each other (one exception: ``bench_train_step``'s ``fsdp2`` method
runs the trainer of ``fsdp2_baseline``, the baseline tool).

- ``time_ms(fn)``: device milliseconds per call, CUDA events around ``iters`` back-to-back
  calls after ``warmup`` calls, the median of ``reps`` such batches. ``host_ahead``: a
  sleep kernel first, so the host launches while the device is busy, as in a training step
  (whose host runs tens of ms ahead): the device time then holds no launch waits.
- ``matmul_ceiling_tflops(device)``: an 8192^3 BF16 matmul's TFLOP/s measured now, the
  hardware ceiling of the run (machines of one kind differ by a few percent).
- ``max_over_ranks(values, device)``: each value's maximum over the ranks (the slowest
  rank's time, the largest peak).
- ``device_and_host_ms(fn, iters, warmup)``: for distributed benchmarks, one batch of
  calls timed by CUDA events and by the host clock, each the slowest rank's.
- ``init_nccl()``: this rank's GPU, the launch's NCCL process group joined.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MATMUL_N = 8192
SLEEP_CYCLES = int(4e8)  # GPU cycles ahead of a timed loop: longer than its launches take


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10, reps: int = 5,
            host_ahead: bool = False) -> float:
    """Median over ``reps`` of the mean device time of ``iters`` back-to-back calls (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if host_ahead:
            torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def matmul_ceiling_tflops(device: torch.device) -> float | None:
    """Dense BF16 matmul TFLOP/s measured now (the hardware ceiling of this run); CUDA only."""
    if device.type != "cuda":
        return None
    a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, warmup=3, iters=20, reps=1)
    return 2 * MATMUL_N**3 / (ms / 1e3) / 1e12


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (the slowest rank's time, the largest peak)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def device_and_host_ms(fn: Callable[[], object], iters: int, warmup: int, host_ahead: bool = False,
                       sleep_cycles: int = SLEEP_CYCLES) -> tuple[float, float]:
    """(device ms, host ms) per call: the rank's mean of one batch, then the maximum over ranks.

    With ``host_ahead`` the device time holds no launch waits and the host time is the
    launch cost alone (the host issues while the device still sleeps)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    if host_ahead:
        torch.cuda._sleep(sleep_cycles)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / iters, host_ms], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return float(ms[0]), float(ms[1])


def init_nccl() -> torch.device:
    """This rank's GPU, with the NCCL process group of the launch joined."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    return device
