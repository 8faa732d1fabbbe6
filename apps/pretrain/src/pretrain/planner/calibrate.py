"""Measure a ``Profile``'s kernel rates on the machine this runs on.

Each class is timed as the step runs it, through the model's own code where the
step has its own kernels: dense BF16 GEMMs at the step's shapes; the routed experts
(``moe_model.GroupedExperts``, forward and ``autograd.grad``) at several rows per
expert, fitted to ``rate(m) = peak * m / (m + half)`` (``1 / rate`` is linear in
``1 / m``); causal SDPA forward and backward; a device copy (memory-bound kernels);
back-to-back tiny kernels replayed from a CUDA graph (the device's gap per kernel);
the host time per launch of the app's eager train step on a small model
(``host_launch_us``). Links are not measured: they come from
``LINK_TABLE`` by device name, or the caller; the EP transport's share of its link
from a two-GPU benchmark (``transport_fit``), or ``EP_TRANSPORT_EFFICIENCY``.

On a CPU the same measurements run at tiny sizes (seconds) in FP32: a profile
for plans of CPU runs and for tests, not a stand-in for a GPU's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pretrain.planner.profile import LINK_TABLE, Link, Profile
from pretrain.planner.step_time import KERNELS_PER_BLOCK, KERNELS_PER_EDGE

# Device idle per kernel of an eager step beyond a replayed one: (60 - 26) ms over
# 28,459 kernels of bench-1gpu (docs/performance.md, the CUDA graphs A/B).
EAGER_EXTRA_GAP_US = 1.2
# The EP transport's share of NVLink where no two-GPU run is given: 0.501 (2.23 ms per
# dispatch + combine at 32k tokens, 384 MiB across the link) fitted by
# transport_fit.ep_transport_efficiency to `tools/from_source.sh python3
# tools/bench_ep_2gpu.py --skip train --out $OUT/ep.json` (tools/bench_ep_transport.py
# --graphs, balanced and Zipf routing, 512 to 65,536 tokens) on two H200s (commit 5916170,
# tools/results/ep_transport_2gpu.json); `pretrain calibrate --ep-transport FILE` fits it
# to a run of the user's own.
EP_TRANSPORT_EFFICIENCY = 0.50
# Dense BF16 datasheet peaks (the MFU denominator), by a substring of the device name.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "B300": 2250.0}
NVLINK = {"H100": "h100-nvlink4", "H200": "h200-nvlink4", "B200": "b200-nvlink5",
          "B300": "b200-nvlink5"}
DEFAULT_NETWORK = "ib-ndr-400"


@dataclass(frozen=True)
class Sizes:
    """The shapes measured: the step's on a GPU, tiny ones on a CPU."""

    tokens: int
    d_model: int
    hidden: int
    experts: int
    rows_per_expert: tuple[int, ...]
    gemm_widths: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    copy_bytes: int
    iters: int


GPU_SIZES = Sizes(tokens=8192, d_model=2048, hidden=1024, experts=64,
                  rows_per_expert=(128, 512, 2048), gemm_widths=(2048, 3072, 16384),
                  heads=16, kv_heads=4, head_dim=128, seq_len=4096, copy_bytes=2**30, iters=10)
CPU_SIZES = Sizes(tokens=256, d_model=64, hidden=64, experts=4, rows_per_expert=(16, 64),
                  gemm_widths=(64, 256), heads=4, kv_heads=2, head_dim=16, seq_len=128,
                  copy_bytes=2**22, iters=3)


class Timer:
    """Seconds per call of ``fn``: CUDA events with the host ahead, else the wall clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object], iters: int) -> float:
        for _ in range(2):
            fn()
        if self.device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        torch.cuda.synchronize(self.device)
        torch.cuda._sleep(int(2e8))  # the host gets ahead: launches do not count
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters


def dense_gemm_tflops(t: Timer, s: Sizes, dtype: torch.dtype) -> float:
    flops = seconds = 0.0
    x = torch.randn(s.tokens, s.d_model, device=t.device, dtype=dtype)
    for n in s.gemm_widths:
        w = torch.randn(s.d_model, n, device=t.device, dtype=dtype)
        seconds += t(lambda w=w: x @ w, s.iters)
        flops += 2 * s.tokens * s.d_model * n
    return flops / seconds / 1e12


def expert_gemm_rates(t: Timer, s: Sizes, dtype: torch.dtype) -> list[tuple[int, float]]:
    """(rows per expert, TFLOP/s) of the experts' forward and backward."""
    from moe_model.experts import GroupedExperts

    experts = GroupedExperts(s.experts, s.d_model, s.hidden).to(t.device, dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rates = []
    for m in s.rows_per_expert:
        rows = m * s.experts
        x = torch.randn(rows, s.d_model, device=t.device, dtype=dtype, requires_grad=True)
        offsets = torch.arange(1, s.experts + 1, device=t.device, dtype=torch.int32) * m
        g = torch.randn(rows, s.d_model, device=t.device, dtype=dtype)
        params = [x, *experts.parameters()]

        def step(x: torch.Tensor = x, offsets: torch.Tensor = offsets,
                 params: list[torch.Tensor] = params, g: torch.Tensor = g) -> None:
            torch.autograd.grad(experts(x, offsets), params, g)

        seconds = t(step, s.iters)
        rates.append((m, 3 * 2 * rows * s.d_model * 3 * s.hidden / seconds / 1e12))
    return rates


def fit_expert_rate(rates: list[tuple[int, float]]) -> tuple[float, float]:
    """(peak TFLOP/s, half rows) of ``rate = peak * m / (m + half)`` by least squares on
    ``1 / rate = 1 / peak + half / (peak * m)``; a flat or rising curve fits half = 0."""
    xs = [1 / m for m, _ in rates]
    ys = [1 / r for _, r in rates]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if slope <= 0 or intercept <= 0:
        return max(r for _, r in rates), 0.0
    return 1 / intercept, slope / intercept


def attention_tflops(t: Timer, s: Sizes, dtype: torch.dtype) -> tuple[float, float]:
    import torch.nn.functional as F

    q = torch.randn(1, s.heads, s.seq_len, s.head_dim, device=t.device, dtype=dtype,
                    requires_grad=True)
    k = torch.randn(1, s.kv_heads, s.seq_len, s.head_dim, device=t.device, dtype=dtype,
                    requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    g = torch.randn_like(fwd())
    forward = t(fwd, s.iters)
    both = t(lambda: torch.autograd.grad(fwd(), (q, k, v), g), s.iters)
    flops = 4 * s.heads * s.seq_len**2 * s.head_dim / 2
    return flops / forward / 1e12, 2.5 * flops / max(both - forward, 1e-9) / 1e12


def memory_gb_per_s(t: Timer, s: Sizes) -> float:
    x = torch.empty(s.copy_bytes // 2, device=t.device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return 2 * s.copy_bytes / t(lambda: y.copy_(x), s.iters) / 1e9


def graph_gap_us(device: torch.device, kernels: int = 2000) -> float:
    """Seconds per back-to-back tiny kernel replayed from a CUDA graph (an upper bound
    on the idle between kernels); 0 on a CPU."""
    if device.type != "cuda":
        return 0.0
    x = torch.zeros(1, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1)
    return Timer(device)(graph.replay, 5) / kernels * 1e6


# The host probe: the app's own eager train step on a model small enough that the
# device waits on the host (a few microseconds of work per kernel against tens of host
# time), at two microbatch counts, so that what a microbatch adds is the host's time.
# On a CPU, smaller still: there the host also does the compute.
HOST_PROBE_MODEL = ("model.vocab_size=1024", "model.n_layers=4", "model.n_heads=4",
                    "model.n_kv_heads=2", "model.n_experts=8", "model.top_k=2",
                    "train.micro_batch=1")
HOST_PROBE_SIZES = {"cuda": ("model.d_model=256", "model.head_dim=64", "model.expert_hidden=256",
                             "train.seq_len=256"),
                    "cpu": ("model.d_model=64", "model.head_dim=16", "model.expert_hidden=64",
                            "train.seq_len=32")}
HOST_PROBE_MICROBATCHES = (4, 16)


def host_launch_us(device: torch.device, iters: int = 12) -> float:
    """Host time per kernel launch as an eager train step pays it, Python, autograd and
    the trainer's own bookkeeping included.

    The app's ``Trainer`` (the ``bench-1gpu`` preset's options, ``HOST_PROBE_MODEL``'s
    model at ``HOST_PROBE_SIZES``, ``train.cuda_graphs=false``) runs steps of ``HOST_PROBE_MICROBATCHES``
    microbatches, the two trainers in turn, each step timed to its one host read. The
    estimate is the median over ``iters`` of the paired differences (a long step minus
    the short step just before it) per microbatch, over the kernels the cost model
    counts per microbatch (``KERNELS_PER_BLOCK`` per block and ``KERNELS_PER_EDGE``).
    The difference cancels what a step pays once (optimizer, statistics, the host read);
    pairing cancels the host's slow drifts; the median, not the fastest pair, because a
    run pays the host's typical speed, not its best (the fastest of 8 steps read 15%
    below what the host-bound ``small-experts`` eager step then ran at, in
    ``tools/validate_step_time.py --shapes small-experts --graphs off``).
    A bare loop of launches would not do: it misses the host work around each kernel
    that the step's modules do. On a CPU it measures the host and the compute together."""
    import contextlib
    import tempfile

    from pretrain.config import load_config, validate_layout
    from pretrain.mesh import build_mesh
    from pretrain.runtime import distributed
    from pretrain.trainer import Trainer

    with (distributed(device.type) as rt, tempfile.TemporaryDirectory() as tmp,
          contextlib.ExitStack() as stack):
        trainers = []
        for microbatches in HOST_PROBE_MICROBATCHES:
            cfg = load_config("bench-1gpu", [
                *HOST_PROBE_MODEL, *HOST_PROBE_SIZES[device.type],
                f"train.global_batch={microbatches}",
                "train.cuda_graphs=false", f"train.device={device.type}",
                f"train.steps={iters + 2}", "optim.schedule=constant", "checkpoint.every=0",
                "metrics.expert_load_every=0", f"run_dir={tmp}/{microbatches}"])
            mesh = build_mesh(validate_layout(cfg, rt.world_size), device.type)
            trainers.append(Trainer(cfg, mesh, device))
            stack.callback(trainers[-1].close)
        added = []  # per step: the long trainer's time minus the short one's
        for step in range(1, iters + 3):
            seconds = []
            for trainer in trainers:
                start = time.perf_counter()
                trainer.train_step(step)  # ends with the step's one host read
                seconds.append(time.perf_counter() - start)
            if step > 2:  # two warm-up steps
                added.append(seconds[1] - seconds[0])
    low, high = HOST_PROBE_MICROBATCHES
    per_microbatch = max(statistics.median(added), 0.0) / (high - low)
    kernels = cfg.model.n_layers * KERNELS_PER_BLOCK + KERNELS_PER_EDGE
    return per_microbatch / kernels * 1e6


def _by_name(table: dict[str, str | float], device_name: str) -> str | float | None:
    return next((v for k, v in table.items() if k in device_name), None)


def calibrate(device: torch.device, name: str | None = None,
              links: dict[str, Link] | None = None, progress: Callable[[str], None] = print
              ) -> Profile:
    """Measure a profile on ``device`` (CUDA: a minute or two; CPU: seconds)."""
    cuda = device.type == "cuda"
    s = GPU_SIZES if cuda else CPU_SIZES
    dtype = torch.bfloat16 if cuda else torch.float32
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    t = Timer(device)
    torch.manual_seed(0)
    progress("dense GEMMs")
    dense = dense_gemm_tflops(t, s, dtype)
    progress("expert grouped GEMMs")
    rates = expert_gemm_rates(t, s, dtype)
    peak_expert, half = fit_expert_rate(rates)
    progress("attention")
    att_fwd, att_bwd = attention_tflops(t, s, dtype)
    progress("memory bandwidth")
    bandwidth = memory_gb_per_s(t, s)
    progress("launches")
    gap = graph_gap_us(device)
    host = host_launch_us(device)
    if cuda:
        gpu_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        nvlink = _by_name(NVLINK, device_name)
        peak = _by_name(PEAK_TFLOPS, device_name) or dense
    else:
        import os

        gpu_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        nvlink, peak = None, dense
    table = {"nvlink": LINK_TABLE[nvlink or "h200-nvlink4"],
             "network": LINK_TABLE[DEFAULT_NETWORK]}
    link_note = (f"links: nvlink {nvlink or 'h200-nvlink4 (device not in the table)'}, "
                 f"network {DEFAULT_NETWORK} from LINK_TABLE unless overridden")
    return Profile(
        name=name or f"{device_name} calibrated",
        source=f"measured by pretrain calibrate on {device_name} (torch {torch.__version__}); "
               + link_note,
        device=device_name, peak_tflops=float(peak), dense_gemm_tflops=dense,
        expert_gemm_tflops=peak_expert, expert_gemm_half_rows=half,
        attention_fwd_tflops=att_fwd, attention_bwd_tflops=att_bwd,
        memory_gb_per_s=bandwidth, kernel_gap_us_graphs=gap,
        kernel_gap_us_eager=gap + (EAGER_EXTRA_GAP_US if cuda else 0.0),
        host_launch_us=host, gpu_gib=gpu_gib, links={**table, **(links or {})},
        ep_transport_efficiency=EP_TRANSPORT_EFFICIENCY,
        **({"sm_count": torch.cuda.get_device_properties(device).multi_processor_count}
           if cuda else {}),
        notes="expert GEMM rates measured (rows per expert: TFLOP/s): "
              + ", ".join(f"{m}: {r:.1f}" for m, r in rates)
              + ("" if cuda else "; a CPU profile (FP32, tiny shapes)"),
    )
