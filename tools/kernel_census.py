"""Which ops launch a training step's kernels: count, device time and the idle gap before them.

    tools/from_source.sh python3 tools/kernel_census.py --config bench-1gpu --out $OUT/census.json

One warmed-up ``Trainer.step`` (the model's own routing) runs under ``torch.profiler`` with
host and device activity. Each kernel is attributed to the op that launched it: the
outermost profiled op around its launch call (an aten op or one of the model's autograd
Functions) and, in the backward, the autograd node it ran in. Per (node, op): kernels,
their device time, and the idle time on the device just before them (what the launch
gaps cost). At tens of thousands of kernels per step each launch gap of ~1-2 us adds up,
so many tiny kernels are a cost of their own, apart from their device time. The host
activity slows the host down, so read the gaps as an upper bound; the counts are exact.
A short table is printed last; the JSON holds every row.
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


def census(events: list) -> list[dict]:
    """Rows of (node, op, kernels, device ms, gap ms before), most kernels first."""
    on_device = torch.autograd.DeviceType.CUDA
    kernels = sorted((e for e in events if e.device_type() == on_device), key=lambda e: e.start_ns())
    host = [e for e in events if e.device_type() != on_device]
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
    busy_until = kernels[0].start_ns() if kernels else 0
    for k in kernels:
        launch = launches.get(k.correlation_id())
        stack = enclosing(launch.start_ns()) if launch is not None else []
        op = next((n for n in stack if not n.startswith(_NOT_AN_OP)), "(unattributed)")
        node = next((n.removeprefix("autograd::engine::evaluate_function: ") for n in stack
                     if n.startswith("autograd::engine")), "forward")
        row = rows[(node, op)]
        row[0] += 1
        row[1] += k.duration_ns() / 1e6
        row[2] += max(0, k.start_ns() - busy_until) / 1e6
        busy_until = max(busy_until, k.start_ns() + k.duration_ns())
    return [{"node": n, "op": o, "kernels": int(c), "device_ms": d, "gap_ms": g}
            for (n, o), (c, d, g) in sorted(rows.items(), key=lambda kv: -kv[1][0])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-1gpu", help="preset name or TOML file")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", type=int, default=40, help="rows printed")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    a = p.parse_args()
    with distributed("cuda") as rt, tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(a.config, [*a.overrides, f"train.steps={a.warmup + 1}", "optim.schedule=constant",
                                     "checkpoint.every=0", "metrics.expert_load_every=0",
                                     "train.device=cuda", f"run_dir={tmp}/run",
                                     "train.cuda_graphs=false"])  # a replayed graph has no ops
        mesh = build_mesh(validate_layout(cfg, rt.world_size), "cuda")
        trainer = Trainer(cfg, mesh, rt.device, phase_timer=PhaseTimer(rt.device))
        try:
            force_routing(trainer.model, "model", seed=cfg.seed)
            for step in range(1, a.warmup + 1):
                trainer.train_step(step)
                trainer.capture_graphs()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                trainer.train_step(a.warmup + 1)
        finally:
            trainer.close()
    rows = census(prof.profiler.kineto_results.events())
    total = {k: sum(r[k] for r in rows) for k in ("kernels", "device_ms", "gap_ms")}
    if a.out is not None:
        a.out.write_text(json.dumps({"config": a.config, "overrides": a.overrides, "total": total,
                                     "rows": rows}, indent=1))
    print(f"\n{a.config}: {total['kernels']} kernels per step, {total['device_ms']:.1f} ms on the "
          f"device, {total['gap_ms']:.1f} ms idle before them (under the profiler)")
    print(f"{'kernels':>8} {'dev ms':>8} {'gap ms':>7}  node | op")
    for r in rows[:a.rows]:
        print(f"{r['kernels']:8d} {r['device_ms']:8.1f} {r['gap_ms']:7.1f}  {r['node'][:45]} | {r['op'][:50]}")


if __name__ == "__main__":
    main()
