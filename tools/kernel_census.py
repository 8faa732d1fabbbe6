"""Which ops launch a training step's kernels: count, device time and the idle gap before them.

    tools/from_source.sh python3 tools/kernel_census.py --config bench-1gpu --out $OUT/census.json
    tools/from_source.sh python3 tools/kernel_census.py --config bench-1gpu --replay \
        --against $OUT/census.json --out $OUT/replay.json

One warmed-up ``Trainer.step`` (the model's own routing) runs under ``torch.profiler`` with
host and device activity. Each kernel is attributed to the op that launched it: the
outermost profiled op around its launch call (an aten op or one of the model's autograd
Functions) and, in the backward, the autograd node it ran in. Per (node, op): kernels,
their device time, and the idle time on the device just before them (what the launch
gaps cost). At tens of thousands of kernels per step each launch gap of ~1-2 us adds up,
so many tiny kernels are a cost of their own, apart from their device time. The host
activity slows the host down, so read the gaps as an upper bound; the counts are exact.
A short table is printed last; the JSON holds every row, and every kernel name's count,
device time and gaps (``by_kernel``).

``--replay`` profiles a step replayed from CUDA graphs instead (``train.cuda_graphs=true``).
A replay launches no ops, so its kernels are counted by name only, with the step's span
on the device, its idle time and the largest idle gaps with the kernels around them.
``--against`` an eager census's JSON lists the kernel names whose device time differs
most between the two steps: the same kernels running slower back to back (clocks, power)
show there, idle time between them in the gaps.
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from pretrain.config import load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.phases import PhaseTimer
from pretrain.routing_override import force_routing
from pretrain.runtime import distributed
from pretrain.trainer import Trainer

_NOT_AN_OP = ("autograd::engine", "ProfilerStep", "##")
_WINDOW = 3000


def _is_runtime_call(name: str) -> bool:
    """A CUDA runtime or driver call (the launch itself), not an op."""
    return name.startswith(("cuda", "cu")) and not name.startswith("cudnn")


def census(events: list, n_parts: int = 4) -> list[dict]:
    """Rows of (node, op, kernels, device ms, gap ms before), most kernels first; each with
    its ``n_parts`` largest (kernel name, innermost op) pairs by device time, which say
    what inside an autograd Function or a composite op the time went to."""
    kernels = _device_kernels(events)
    host = [e for e in events if e.device_type() != torch.autograd.DeviceType.CUDA]
    launches = {e.correlation_id(): e for e in host if _is_runtime_call(e.name())}
    ops = sorted((e for e in host if not _is_runtime_call(e.name())), key=lambda e: e.start_ns())
    starts = [e.start_ns() for e in ops]

    def enclosing(t: int) -> list[str]:
        """Names of the ops open at time ``t``, outermost first. Only the last ``_WINDOW`` ops
        that started before ``t`` are looked at (a step has ~10^5 ops): the ops around a
        launch start shortly before it, except step-wide scopes, which are skipped anyway."""
        i = bisect.bisect_right(starts, t)
        return [e.name() for e in ops[max(0, i - _WINDOW):i] if e.start_ns() + e.duration_ns() >= t]

    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    parts: dict[tuple[str, str], dict[tuple[str, str], list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0.0]))
    for k, gap in _with_gaps(kernels):
        launch = launches.get(k.correlation_id())
        stack = enclosing(launch.start_ns()) if launch is not None else []
        named = [n for n in stack if not n.startswith(_NOT_AN_OP)]
        op = named[0] if named else "(unattributed)"
        node = next((n.removeprefix("autograd::engine::evaluate_function: ") for n in stack
                     if n.startswith("autograd::engine")), "forward")
        row = rows[(node, op)]
        row[0] += 1
        row[1] += k.duration_ns() / 1e6
        row[2] += gap / 1e6
        part = parts[(node, op)][(_short(k.name()), named[-1] if named else op)]
        part[0] += 1
        part[1] += k.duration_ns() / 1e6
    return [{"node": n, "op": o, "kernels": int(c), "device_ms": d, "gap_ms": g,
             "parts": [{"kernel": kn, "inner_op": io, "kernels": int(pc), "device_ms": pd}
                       for (kn, io), (pc, pd) in sorted(parts[(n, o)].items(),
                                                        key=lambda kv: -kv[1][1])[:n_parts]]}
            for (n, o), (c, d, g) in sorted(rows.items(), key=lambda kv: -kv[1][0])]


def _device_kernels(events: list) -> list:
    on_device = torch.autograd.DeviceType.CUDA
    return sorted((e for e in events if e.device_type() == on_device), key=lambda e: e.start_ns())


def _with_gaps(kernels: list):
    """Each kernel (in start order) with the device's idle ns just before it, counted once:
    against the latest end of the kernels before it (kernels of other streams overlap)."""
    busy_until = kernels[0].start_ns() if kernels else 0
    for k in kernels:
        yield k, max(0, k.start_ns() - busy_until)
        busy_until = max(busy_until, _end(k))


def _end(kernel) -> int:
    return kernel.start_ns() + kernel.duration_ns()


def _short(name: str) -> str:
    """A kernel's name without its template arguments (aten kernels' names run to pages)."""
    return name.split("<", 1)[0][:100]


def by_kernel(kernels: list) -> dict[str, dict]:
    """Per kernel name: launches, device ms, and the device's idle ms just before them."""
    rows: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for k, gap in _with_gaps(kernels):
        row = rows[_short(k.name())]
        row[0] += 1
        row[1] += k.duration_ns() / 1e6
        row[2] += gap / 1e6
    return {n: {"kernels": int(c), "device_ms": d, "gap_ms": g}
            for n, (c, d, g) in sorted(rows.items(), key=lambda kv: -kv[1][1])}


def timeline(kernels: list, n_gaps: int = 15) -> dict:
    """The step's span on the device (first kernel's start to last kernel's end), the time
    some kernel ran, the idle rest, and the ``n_gaps`` largest idle gaps with the kernels
    on either side (a gap where the device waits on the host, a copy or another rank)."""
    if not kernels:
        return {"span_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "largest_gaps": []}
    gaps, last = [], kernels[0]  # last: the kernel that ends latest so far
    for k, gap in _with_gaps(kernels):
        if gap:
            gaps.append((gap, _short(last.name()), _short(k.name())))
        if _end(k) >= _end(last):
            last = k
    span, idle = _end(last) - kernels[0].start_ns(), sum(g[0] for g in gaps)
    gaps.sort(reverse=True)
    return {"span_ms": span / 1e6, "busy_ms": (span - idle) / 1e6, "idle_ms": idle / 1e6,
            "gaps_over_10us": sum(1 for g in gaps if g[0] > 10_000),
            "largest_gaps": [{"ms": g / 1e6, "after": a, "before": b} for g, a, b in gaps[:n_gaps]]}


def differences(replay: dict[str, dict], eager: dict[str, dict], n: int) -> list[dict]:
    """The ``n`` kernel names whose device ms differ most between a replay and an eager step."""
    names = set(replay) | set(eager)
    rows = [{"kernel": k, "replay_ms": replay.get(k, {}).get("device_ms", 0.0),
             "eager_ms": eager.get(k, {}).get("device_ms", 0.0),
             "replay_kernels": replay.get(k, {}).get("kernels", 0),
             "eager_kernels": eager.get(k, {}).get("kernels", 0)} for k in names]
    return sorted(rows, key=lambda r: -abs(r["replay_ms"] - r["eager_ms"]))[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-1gpu", help="preset name or TOML file")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--replay", action="store_true", help="profile a step replayed from CUDA graphs")
    p.add_argument("--against", type=Path, default=None,
                   help="an eager census's JSON: list the kernels whose device time differs most")
    p.add_argument("--rows", type=int, default=40, help="rows printed")
    p.add_argument("--parts", type=int, default=8, help="rows printed with their kernels (eager)")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = p.parse_args()
    eager = None if a.against is None else json.loads(a.against.read_text())["by_kernel"]
    with distributed("cuda") as rt, tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(a.config, [*a.overrides, f"train.steps={a.warmup + 2}", "optim.schedule=constant",
                                     "checkpoint.every=0", "metrics.expert_load_every=0",
                                     "train.device=cuda", f"run_dir={tmp}/run",
                                     f"train.cuda_graphs={str(a.replay).lower()}"])
        mesh = build_mesh(validate_layout(cfg, rt.world_size), "cuda")
        trainer = Trainer(cfg, mesh, rt.device, phase_timer=PhaseTimer(rt.device))
        try:
            force_routing(trainer.model, "model", seed=cfg.seed)
            for step in range(1, a.warmup + 1):
                trainer.train_step(step)
                trainer.capture_graphs()
            if a.replay:  # the first replay after the capture, unprofiled
                trainer.train_step(a.warmup + 1)
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                trainer.train_step(a.warmup + 2)
                torch.cuda.synchronize()
        finally:
            trainer.close()
    events = prof.profiler.kineto_results.events()
    kernels = _device_kernels(events)
    if not kernels:
        raise SystemExit("kernel_census: the profiler recorded no kernels of the step")
    names, span = by_kernel(kernels), timeline(kernels)
    rows = [] if a.replay else census(events)
    total = {"kernels": len(kernels), "device_ms": sum(r["device_ms"] for r in names.values()),
             "gap_ms": span["idle_ms"]}
    diff = [] if eager is None else differences(names, eager, a.rows)
    if a.out is not None:
        a.out.write_text(json.dumps({"config": a.config, "overrides": a.overrides, "replay": a.replay,
                                     "total": total, "timeline": span, "rows": rows,
                                     "by_kernel": names, "against": diff}, indent=1))
    how = "replayed from CUDA graphs" if a.replay else "eager, under the profiler"
    print(f"\n{a.config} ({how}): {total['kernels']} kernels per step, {total['device_ms']:.1f} ms of "
          f"kernels, a span of {span['span_ms']:.1f} ms on the device, {span['idle_ms']:.1f} ms of it "
          f"idle ({span['gaps_over_10us']} gaps over 10 us)")
    print("largest idle gaps: ms, after | before")
    for g in span["largest_gaps"][:8]:
        print(f"  {g['ms']:8.2f}  {g['after'][:50]} | {g['before'][:50]}")
    if rows:
        print(f"{'kernels':>8} {'dev ms':>8} {'gap ms':>7}  node | op")
        for r in rows[:a.rows]:
            print(f"{r['kernels']:8d} {r['device_ms']:8.1f} {r['gap_ms']:7.1f}  {r['node'][:45]} | {r['op'][:50]}")
        print("the largest rows by device time, by kernel and innermost op:")
        for r in sorted(rows, key=lambda r: -r["device_ms"])[:a.parts]:
            print(f"  {r['node'][:40]} | {r['op'][:40]}: {r['device_ms']:.1f} ms")
            for q in r["parts"]:
                print(f"    {q['kernels']:6d} {q['device_ms']:8.1f}  {q['kernel'][:50]} | {q['inner_op'][:40]}")
    else:
        print(f"{'kernels':>8} {'dev ms':>8} {'gap ms':>7}  kernel")
        for n, r in list(names.items())[:a.rows]:
            print(f"{r['kernels']:8d} {r['device_ms']:8.1f} {r['gap_ms']:7.1f}  {n[:80]}")
    if diff:
        print(f"{'replay ms':>9} {'eager ms':>9} {'n replay':>8} {'n eager':>8}  kernel (largest differences)")
        for r in diff:
            print(f"{r['replay_ms']:9.1f} {r['eager_ms']:9.1f} {r['replay_kernels']:8d} "
                  f"{r['eager_kernels']:8d}  {r['kernel'][:70]}")


if __name__ == "__main__":
    main()
