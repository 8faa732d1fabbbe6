"""Does the pipelined EP step stall, and which setting stops it: one call on two GPUs.

    tools/from_source.sh python3 tools/probe_ep_overlap.py --out $OUT/probe.json

On two H200s the app's EP2 steps with ``parallel.ep_overlap_chunks`` > 1 stalled for
seconds once in a run, or never finished their first step, while the unsplit step, the
same run under ``CUDA_LAUNCH_BLOCKING=1`` and the communication stream bounded to 16 SMs
ran through (``docs/performance.md``). This runs the app (``pretrain --config tiny``,
EP2 on the rowwise transport, ``--chunks`` chunks) in fresh processes with a time limit,
``--repeats`` times per variant, the variants changing one setting each:

- ``unsplit``: ``parallel.ep_overlap_chunks=1`` (the reference: no stall seen);
- ``base``: as configured;
- ``eager-loading``: ``CUDA_MODULE_LOADING=EAGER`` (kernels load at start-up, not at
  their first launch, where loading may wait for the device while a barrier spins);
- ``queues-32``: ``CUDA_DEVICE_MAX_CONNECTIONS=32`` (streams stop sharing hardware queues);
- ``nccl-connect-at-init``: ``NCCL_RUNTIME_CONNECT=0``;
- ``comm-sms-16``: ``parallel.ep_comm_sms=16`` (a green context's stream).

Per run: finished or not, steps done, the slowest step (``step_time_s`` of the run's
``metrics.jsonl``) and the wall time. Every rank dumps all its threads' Python stacks
every ``--dump-every`` seconds (``tools/_stack_dumps.py``) into the run's folder under
``--out``'s directory, so a stalled run shows where each host waited. Prints a table and
writes JSON. ``--device cpu`` runs the same on gloo (no streams: a check of the tool).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_testing import run_process_tree

TOOLS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()


VARIANTS = (
    Variant("unsplit", overrides=("parallel.ep_overlap_chunks=1",)),
    Variant("base"),
    Variant("eager-loading", env={"CUDA_MODULE_LOADING": "EAGER"}),
    Variant("queues-32", env={"CUDA_DEVICE_MAX_CONNECTIONS": "32"}),
    Variant("nccl-connect-at-init", env={"NCCL_RUNTIME_CONNECT": "0"}),
    Variant("comm-sms-16", overrides=("parallel.ep_comm_sms=16",)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file; the runs' folders go beside it")
    p.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS],
                   default=[v.name for v in VARIANTS])
    p.add_argument("--repeats", type=int, default=2, help="runs per variant (the stall comes and goes)")
    p.add_argument("--chunks", type=int, default=3, help="parallel.ep_overlap_chunks of the runs")
    p.add_argument("--steps", type=int, default=8, help="train.steps of a run")
    p.add_argument("--timeout", type=float, default=45.0, help="seconds a run may take before it is killed")
    p.add_argument("--dump-every", type=float, default=8.0, help="seconds between stack dumps")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = p.parse_args(argv)
    if a.repeats < 1 or a.steps < 3 or a.chunks < 2:
        p.error("--repeats must be positive, --steps at least 3 (the tiny preset warms up for 2), "
                "--chunks at least 2")
    if a.timeout <= 0 or a.dump_every <= 0:
        p.error("--timeout and --dump-every must be positive seconds")
    return a


def command(a: argparse.Namespace, variant: Variant, run_dir: Path) -> list[str]:
    """The launch of one run: two ranks of the app through the stack-dumping launcher."""
    dtype = ["train.compute_dtype=float32"] if a.device == "cuda" else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(TOOLS / "_stack_dumps.py"), str(a.dump_every), str(run_dir / "stacks"),
            "--config", "tiny", f"train.device={a.device}", *dtype, "parallel.ep=2",
            "parallel.ep_backend=rowwise", f"parallel.ep_overlap_chunks={a.chunks}",
            f"train.steps={a.steps}", f"run_dir={run_dir}", *variant.overrides]


def step_times(run_dir: Path) -> list[float]:
    """``step_time_s`` of every step the run recorded (none where it recorded none)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    times = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "step_time_s" in record:
            times.append(float(record["step_time_s"]))
    return times


def run_once(a: argparse.Namespace, variant: Variant, run_dir: Path) -> dict[str, Any]:
    """One run in its own process group, killed with its ranks past ``--timeout``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rc, timed_out = None, False
    with open(run_dir / "output.txt", "w") as log:
        try:
            rc = run_process_tree(command(a, variant, run_dir), timeout=a.timeout, stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, **variant.env}).returncode
        except subprocess.TimeoutExpired:
            timed_out = True
    times = step_times(run_dir)
    return {"variant": variant.name, "run_dir": str(run_dir), "returncode": rc,
            "finished": rc == 0 and len(times) == a.steps, "timed_out": timed_out,
            "steps": len(times), "slowest_step_s": max(times) if times else None,
            "step_times_s": times, "wall_s": time.time() - started}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':>22} {'finished':>9} {'steps':>6} {'slowest s':>10} {'wall s':>8}")
    for r in rows:
        slowest = f"{r['slowest_step_s']:.2f}" if r["slowest_step_s"] is not None else "-"
        state = "yes" if r["finished"] else ("timeout" if r["timed_out"] else f"rc {r['returncode']}")
        print(f"{r['variant']:>22} {state:>9} {r['steps']:>6} {slowest:>10} {r['wall_s']:>8.1f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    root = a.out.parent / a.out.stem
    report: dict[str, Any] = {"chunks": a.chunks, "steps": a.steps, "timeout_s": a.timeout,
                              "device": a.device, "runs": []}
    for variant in (v for v in VARIANTS if v.name in a.variants):
        for i in range(a.repeats):
            report["runs"].append(run_once(a, variant, root / f"{variant.name}-{i}"))
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(report, indent=2))  # after every run: a later hang keeps these
            print_table(report["runs"][-1:])
    print()
    print_table(report["runs"])
    return report


if __name__ == "__main__":
    main()
