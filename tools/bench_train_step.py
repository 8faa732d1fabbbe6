"""Full training-step benchmark through the app's own ``Trainer`` (not a copy of its loop).

    # one H200: bench-1gpu with the distributed optimizer, three routings
    tools/from_source.sh python3 tools/bench_train_step.py --config bench-1gpu \\
        --out $OUT/train_step_1gpu.json
    # two H200s: bench-2gpu as DP2, as EP2 (NVSHMEM rowwise transport) and under FSDP2
    tools/from_source.sh python3 -m torch.distributed.run --nproc-per-node 2 \\
        tools/bench_train_step.py --config bench-2gpu --methods ddp ep fsdp2 \\
        --out $OUT/train_step_2gpu.json
    # CPU smoke run (CI runs this through tests/test_app_bench_train_step.py)
    uv run python tools/bench_train_step.py --config tiny --device cpu --warmup 1 --steps 2

Methods (the same model, data and batch; only the layout differs):

- ``ddp``: data parallelism over every rank, FP32 grads in buckets reduced inside
  each replica group, the distributed optimizer (``parallel.ep=1``);
- ``ep``: expert parallelism over every rank (EP2 on two GPUs), dense parameters
  data-parallel; the token transport is ``--ep-backend`` (default: ``rowwise``,
  NVSHMEM, on CUDA; ``all_to_all`` on CPU);
- ``fsdp2``: the baseline of ``tools/fsdp2_baseline.py`` (PyTorch's ``fully_shard``
  per block, full reshard, same model, data, loss and optimizer policy); it marks
  forward, backward (its reduce-scatters run inside), optimizer and stats.

Routings: ``model`` (the router's own choices), ``balanced`` and ``zipf`` (forced
by ``pretrain.routing_override``: same router cost, forced expert choices), since
benchmarks that only force balanced routing overstate throughput.

Per (method, routing): ``--warmup`` steps, then ``--steps`` timed steps, each a
full ``Trainer.step`` (data, forward, backward, gradient sync, clip, optimizer,
weight rebuild, statistics, the one end-of-step host read). Reported: tokens/s
(whole job and per GPU), MFU against 989 TFLOP/s per GPU with
``moe_model.flops_per_token``, the model FLOP rate against a BF16 matmul ceiling
measured in the same run, peak memory (max over ranks), and the step-time
breakdown from CUDA events at the trainer's phase boundaries (``PhaseTimer``;
max over ranks; "other" is data, statistics, the bias step and host time between
marks), and "lead": the host's smallest lead over the device at a phase mark after
the first microbatch's forward (ms, min over steps and ranks), about zero where the
device waited for the host's launches in the steady state. With ``train.cuda_graphs`` (the
``bench-1gpu`` preset) the microbatches and the gradient sync are one phase, ``graph``,
the graphs are captured again for every routing (the routing hooks change the model's
launch fingerprint), and the peak memory includes the
warm-up step, where the capture allocates what the replays then reuse; ``--warmup``
must then be at least 1 (the first step of a routing runs eagerly and captures the
graphs: not a step to time). With graphs the lead is measured only at the marks after
the replay (the replay is the step's first phase), so it is not comparable with an eager
run's lead, which includes the marks between the microbatches.

CUDA graphs per method: where the method's layout refuses ``train.cuda_graphs``
(``pretrain.config``: pipeline parallelism, the all_to_all EP transport, MXFP8 layers)
the method runs eagerly, with a printed note, and the FSDP2
baseline always runs eagerly; every row records ``cuda_graphs`` (the table's
"graphs" column; ``cuda_graphs_off``: why the benchmark turned them off), so a
comparison never mixes graph-replayed and eager runs unseen. The JSON holds every
step; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _bench import matmul_ceiling_tflops, max_over_ranks
from moe_model import flops_per_token
from pretrain.config import ConfigError, load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.phases import PhaseTimer
from pretrain.routing_override import ROUTING_MODES, force_routing
from pretrain.runtime import distributed
from pretrain.trainer import PEAK_FLOPS, Trainer

METHODS = ("ddp", "ep", "fsdp2")
PHASES = ("forward", "backward", "pipeline", "graph", "grad_sync", "optimizer", "weight_rebuild",
          "stats")
EAGER = "train.cuda_graphs=false"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-1gpu", help="preset name or TOML file")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=["ddp"])
    p.add_argument("--routing", nargs="+", choices=ROUTING_MODES, default=list(ROUTING_MODES))
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps per (method, routing); at least 1 with train.cuda_graphs")
    p.add_argument("--steps", type=int, default=10, help="timed steps per (method, routing)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--ep-backend", choices=["all_to_all", "rowwise"], default=None,
                   help="EP transport of the ep method (default: rowwise on CUDA, else all_to_all)")
    p.add_argument("--out", type=Path, default=None, help="JSON file (written by rank 0)")
    p.add_argument("--profile", type=Path, default=None,
                   help="also profile one extra step per (method, routing) with torch.profiler and "
                        "write its kernel table (top kernels by device time) to this text file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides for every run, e.g. model.recompute=selective")
    return p.parse_args(argv)


def build_fsdp2_trainer(cfg: Any, device: torch.device, timer: PhaseTimer) -> Any:
    """The FSDP2 baseline's trainer (``tools/fsdp2_baseline.py``)."""
    import fsdp2_baseline  # a tool beside this one; imported only by the fsdp2 method

    return fsdp2_baseline.build_fsdp2_trainer(cfg, None, device, timer)


def method_config(a: argparse.Namespace, method: str, device: torch.device, world: int,
                  run_dir: Path) -> tuple[Any, str | None]:
    """``method``'s config, and why this benchmark turned ``train.cuda_graphs`` off for it
    (``None``: as configured). A layout that refuses the graphs runs eagerly rather than
    not at all; the FSDP2 baseline never replays graphs, its config says so too."""
    per_routing = a.warmup + a.steps + (a.profile is not None)
    overrides = [*a.overrides, f"train.steps={per_routing * len(a.routing)}",
                 "optim.schedule=constant", "checkpoint.every=0", "metrics.expert_load_every=0",
                 f"train.device={device.type}", f"run_dir={run_dir / method}"]
    if method == "ep":
        backend = a.ep_backend or ("rowwise" if device.type == "cuda" else "all_to_all")
        overrides += [f"parallel.ep={world}", f"parallel.ep_backend={backend}"]
    if method == "fsdp2":
        cfg = load_config(a.config, overrides)
        if not cfg.train.cuda_graphs:
            return cfg, None
        return load_config(a.config, [*overrides, EAGER]), "the FSDP2 baseline runs eagerly"
    try:
        return _with_layout(a.config, overrides, world), None
    except ConfigError as refused:  # a refusal that turning the graphs off does not lift stands
        why = str(refused)
    return _with_layout(a.config, [*overrides, EAGER], world), why


def _with_layout(config: str, overrides: list[str], world: int) -> Any:
    """The config, once its layout on ``world`` ranks is checked (``ConfigError`` if refused)."""
    cfg = load_config(config, overrides)
    validate_layout(cfg, world)
    return cfg


def run_method(a: argparse.Namespace, method: str, cfg: Any, device: torch.device,
               world: int) -> list[dict[str, Any]]:
    """Build one trainer for ``method`` from ``cfg`` and time every routing on it."""
    timer = PhaseTimer(device)
    if method == "fsdp2":
        trainer = build_fsdp2_trainer(cfg, device, timer)
    else:
        mesh = build_mesh(validate_layout(cfg, world), device.type)
        trainer = Trainer(cfg, mesh, device, phase_timer=timer)
    # graphs captured under another routing are captured again (the trainer sees the
    # hooks change); the warm-up step is the eager one before the capture
    graphs = trainer.graphs is not None
    rows = []
    step = 0
    try:
        for routing in a.routing:
            hooks = force_routing(trainer.model, routing, seed=cfg.seed)
            if device.type == "cuda" and graphs:  # the activations are allocated at the capture
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(a.warmup):
                step += 1
                trainer.train_step(step)
                trainer.capture_graphs()  # after the first warm-up step (again after a reset)
                timer.collect()
            if device.type == "cuda" and not graphs:
                torch.cuda.reset_peak_memory_stats(device)
            records, phases, leads = [], [], []
            for _ in range(a.steps):
                step += 1
                records.append(trainer.train_step(step).record)
                phases.append(timer.collect())
                leads.append(timer.min_host_lead_s)
            row = summarize(method, routing, cfg, world, records, phases, device)
            row["cuda_graphs"] = graphs
            row["min_host_lead_ms"] = _min_host_lead_ms(leads, device)
            if a.profile is not None:
                step += 1
                row["profile"] = profile_step(trainer, step, a.profile, f"{method}/{routing}")
                timer.collect()
            for hook in hooks:
                hook.remove()
            rows.append(row)
    finally:
        trainer.close()
    return rows


def profile_step(trainer: Trainer, step: int, path: Path, title: str,
                 rows: int = 40) -> dict[str, Any]:
    """Run one more step under ``torch.profiler`` and append its kernel table to ``path``.

    Untimed; it says where the device time goes, which the phase breakdown cannot, and
    how long the device sat idle within the step (kernel intervals merged over every
    stream: what the host's launches or a wait left empty), and how much of the
    communication ran while compute ran too (``comm_overlap``: what of the EP transport and
    NCCL hid under the compute). On CUDA only device activity is recorded, which keeps the
    profiler's own host cost small. Only rank 0 writes.
    """
    on_cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        trainer.train_step(step)
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=70)
    busy = device_busy([(e.time_range.start, e.time_range.end) for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA]) if on_cuda else None
    overlap = None
    if on_cuda:
        names = communication_kernels()
        overlap = comm_overlap([(is_communication(e.name(), names), e.start_ns() / 1e3, e.end_ns() / 1e3,
                                 "memcpy" in e.name().lower())
                                for e in prof.profiler.kineto_results.events()
                                if e.device_type() == torch.autograd.DeviceType.CUDA])
    if not dist.is_initialized() or dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(f"=== {title}\n")
            if busy is not None:
                f.write("device span {span_ms:.1f} ms, busy {busy_ms:.1f} ms, idle {idle_ms:.1f} ms "
                        "({gaps} gaps over 20 us: {gap_ms:.1f} ms)\n".format(**busy))
            if overlap is not None:
                f.write("communication {comm_ms:.1f} ms ({comm_copy_ms:.1f} ms of copies), {comm_under_compute_ms:.1f} "
                        "ms of it under compute ({compute_ms:.1f} ms)\n".format(**overlap))
            f.write(f"{table}\n")
    return {"file": str(path), "device": busy, "overlap": overlap}


def communication_kernels() -> tuple[str, ...]:
    """Names of the device work that communicates: NCCL's kernels, the EP transport's Triton
    kernels (``moe_ep_transport``'s kernel modules) and copies (every one: the copy engines'
    peer copies, but also a local ``copy_``, which the split ``comm_copy_ms`` shows). By
    name, not by stream: in a replayed CUDA graph every kernel may report the stream the
    graph was launched on."""
    names = ["nccl", "Memcpy"]
    try:
        from moe_ep_transport import _plan_kernels, _transport_kernels
    except ImportError:  # no Triton here: the transport runs no kernels of its own
        return tuple(names)
    for module in (_plan_kernels, _transport_kernels):
        names += [name for name in vars(module) if name.endswith("_kernel")]
    return tuple(names)


def is_communication(kernel: str, names: tuple[str, ...]) -> bool:
    return kernel.startswith(names)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering ``intervals``."""
    merged: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def comm_overlap(activities_us: list[tuple[bool, float, float, bool]]) -> dict[str, float]:
    """From device activities ``(is_communication, start_us, end_us, is_copy)``: the busy time
    (union of intervals) of the communication and of the compute, the copies' part of the
    communication, and the part of the communication that ran while compute ran too, in ms.

    ``comm_under_compute_ms / comm_ms`` is how much of the transport hid (what the step-time
    model's SM share stands for); the copy engines' copies take no SM, kernels do.
    """
    comm = _union([(s, e) for is_comm, s, e, _ in activities_us if is_comm])
    compute = _union([(s, e) for is_comm, s, e, _ in activities_us if not is_comm])
    copies = _union([(s, e) for is_comm, s, e, is_copy in activities_us if is_comm and is_copy])
    return {"comm_ms": _length(comm) / 1e3, "comm_copy_ms": _length(copies) / 1e3,
            "compute_ms": _length(compute) / 1e3, "comm_under_compute_ms": _intersection(comm, compute) / 1e3}


def device_busy(intervals_us: list[tuple[float, float]], gap_us: float = 20.0) -> dict[str, float]:
    """Span, busy time (the union of the intervals) and idle time of kernel intervals, in ms.

    ``gaps``/``gap_ms``: the idle stretches longer than ``gap_us`` (a launch the device
    waited for, not the few microseconds between back-to-back kernels).
    """
    spans = _union(intervals_us)
    if not spans:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "gaps": 0, "gap_ms": 0.0}
    idle = [start - end for (_, end), (start, _) in zip(spans, spans[1:], strict=False)]
    long_gaps = [g for g in idle if g > gap_us]
    span, busy = spans[-1][1] - spans[0][0], _length(spans)
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps": len(long_gaps), "gap_ms": sum(long_gaps) / 1e3}


def summarize(method: str, routing: str, cfg: Any, world: int, records: list[dict],
              phases: list[dict[str, float]], device: torch.device) -> dict[str, Any]:
    step_s = statistics.mean(r["step_time_s"] for r in records)
    mean_phase = [statistics.mean(p.get(name, 0.0) for p in phases) for name in PHASES]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    *phase_s, step_s, peak = max_over_ranks([*mean_phase, step_s, peak], device)
    tokens = cfg.train.global_batch * cfg.train.seq_len
    flops = flops_per_token(cfg.model, cfg.train.seq_len) * tokens / step_s  # model FLOP/s, all GPUs
    return {
        "method": method, "routing": routing, "world": world,
        "tokens_per_s": tokens / step_s, "tokens_per_s_per_gpu": tokens / step_s / world,
        "model_tflops_per_gpu": flops / world / 1e12,
        "mfu": flops / (world * PEAK_FLOPS) if device.type == "cuda" else None,
        "peak_mem_gib": peak if device.type == "cuda" else None,
        "step_ms": step_s * 1e3,
        "phase_ms": {name: s * 1e3 for name, s in zip(PHASES, phase_s, strict=True)},
        "other_ms": (step_s - sum(phase_s)) * 1e3,
        "loss": [r["loss"] for r in records],
        "dropped_token_rate": _mean(records, "dropped_token_rate"),
        "expert_load_imbalance": _mean(records, "expert_load_imbalance"),
    }


def _min_host_lead_ms(leads: list[float | None], device: torch.device) -> float | None:
    """The host's smallest lead over the device at a phase mark, over steps and ranks
    (``PhaseTimer.min_host_lead_s``): about zero where the device waited for launches."""
    if device.type != "cuda" or None in leads:
        return None
    return -max_over_ranks([-min(leads)], device)[0] * 1e3


def _mean(records: list[dict], key: str) -> float | None:
    """Mean of a record field; ``None`` where the trainer does not report it (FSDP2)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.mean(values) if values else None


def print_table(report: dict[str, Any]) -> None:
    ceiling = report["matmul_ceiling_tflops"]
    print(f"\n{report['config']} on {report['world']} x {report['device']}, torch {report['torch']}"
          + (f"; BF16 matmul ceiling {ceiling:.0f} TFLOP/s, MFU vs {PEAK_FLOPS / 1e12:.0f}" if ceiling
             else ""))
    head = ["method", "routing", "graphs", "tok/s", "tok/s/GPU", "MFU", "of ceil", "peak GiB",
            "step ms", "fwd", "bwd", "pipe", "graph", "sync", "optim", "rebuild", "stats", "other",
            "lead"]
    print(" ".join(f"{h:>9s}" for h in head))
    for r in report["runs"]:
        ph = r["phase_ms"]
        cells = [r["method"], r["routing"], "on" if r["cuda_graphs"] else "off",
                 f"{r['tokens_per_s']:,.0f}",
                 f"{r['tokens_per_s_per_gpu']:,.0f}",
                 f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                 f"{r['model_tflops_per_gpu'] / ceiling:.1%}" if ceiling else "-",
                 f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-",
                 f"{r['step_ms']:.1f}", *(f"{ph[name]:.1f}" for name in PHASES),
                 f"{r['other_ms']:.1f}",
                 f"{r['min_host_lead_ms']:.1f}" if r.get("min_host_lead_ms") is not None else "-"]
        print(" ".join(f"{c:>9s}" for c in cells))


def method_configs(a: argparse.Namespace, device: torch.device, world: int, run_dir: Path
                   ) -> tuple[dict[str, tuple[Any, str | None]], dict[str, ConfigError]]:
    """Every method's config (``method_config``), and apart the ``ConfigError`` of each
    method whose layout is refused. The caller raises a refusal when that method's turn
    comes, so the methods before it are still measured and the first method without a
    result is the one that failed (``sweep_figure8``)."""
    configs: dict[str, tuple[Any, str | None]] = {}
    refused: dict[str, ConfigError] = {}
    for method in a.methods:
        try:
            configs[method] = method_config(a, method, device, world, run_dir)
        except ConfigError as error:
            refused[method] = error
    return configs, refused


def refuse_warmup_before_capture(warmup: int, configs: dict[str, Any]) -> None:
    """Exit unless every method replaying CUDA graphs warms up: the first step of each
    routing runs eagerly and captures the graphs, which a timed mean must not hold."""
    graphed = [m for m, cfg in configs.items() if cfg.train.cuda_graphs]
    if graphed and warmup < 1:
        raise SystemExit(f"--warmup {warmup} with train.cuda_graphs ({', '.join(graphed)}): the "
                         "first step of every routing runs eagerly and captures the graphs; use "
                         f"--warmup 1 or more, or {EAGER}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    with distributed(a.device) as rt, tempfile.TemporaryDirectory() as tmp:
        report = {
            "config": a.config, "overrides": a.overrides, "world": rt.world_size,
            "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "warmup": a.warmup, "steps": a.steps,
            "matmul_ceiling_tflops": matmul_ceiling_tflops(rt.device),
            "peak_tflops": PEAK_FLOPS / 1e12, "runs": [],
        }
        configs, refused = method_configs(a, rt.device, rt.world_size, Path(tmp))
        refuse_warmup_before_capture(a.warmup, {m: cfg for m, (cfg, _) in configs.items()})
        for method, (_, why) in configs.items():
            if why is not None and rt.rank == 0:
                print(f"{method}: train.cuda_graphs off for this method ({why})", flush=True)
        started = time.time()
        for method in dict.fromkeys(a.methods):  # in order, once each
            if method in refused:  # after the methods before it are measured
                raise ConfigError(f"--methods {method}: {refused[method]}") from refused[method]
            cfg, why = configs[method]
            runs = run_method(a, method, cfg, rt.device, rt.world_size)
            report["runs"] += [{**r, "cuda_graphs_off": why} if why else r for r in runs]
            report["wall_s"] = time.time() - started
            gc.collect()
            if rt.device.type == "cuda":
                torch.cuda.empty_cache()
            if rt.rank == 0:  # after every method, so a later failure keeps what was measured
                if a.out is not None:
                    a.out.parent.mkdir(parents=True, exist_ok=True)
                    a.out.write_text(json.dumps(report, indent=2))
                print_table(report)
    return report


if __name__ == "__main__":
    main()
