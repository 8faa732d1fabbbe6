"""Every two-GPU expert-parallelism target in one call: the training step and the transport.

    tools/from_source.sh python3 tools/bench_ep_2gpu.py --out $OUT/ep_2gpu.json

It runs, one after the other on the GPUs of this host (``torch.distributed.run``,
``--nproc-per-node`` = ``--gpus``):

1. ``tools/bench_train_step.py --config bench-2gpu --methods ddp ep`` with the
   model's own, forced balanced and forced Zipf routing: EP tokens/s per GPU over
   DP's on the same commit (target >= 1.05x for every routing) and both MFUs
   (target >= 42%);
2. ``tools/bench_ep_transport.py --graphs`` from 512 to 64k tokens per rank,
   balanced and Zipf routing: the rowwise transport over a bare NCCL
   ``all_to_all_single`` (targets: >= 1.0x at every size, >= 1.5x at 16-64 MiB of
   payload) and the share of the put ceiling measured in the same run at the largest
   size (target >= 80%).

Each part writes its own JSON next to ``--out``; ``--out`` gets both plus the
target checks, and a short table is printed. A part that fails is recorded with
its exit status and the rest still runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parent
ROUTINGS = ("model", "balanced", "zipf")
EP_OVER_DP = 1.05
MFU = 0.42
X_NCCL_ALL, X_NCCL_MID, MID_MIB = 1.0, 1.5, (16, 64)
PUT_SHARE = 80.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON file of both parts and the checks")
    p.add_argument("--gpus", type=int, default=2, help="GPUs of this host (processes per part)")
    p.add_argument("--config", default="bench-2gpu", help="bench_train_step preset")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per (method, routing)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", default="512,1024,2048,4096,8192,16384,32768,65536",
                   help="transport sizes, tokens per rank, comma-separated")
    p.add_argument("--transport-routing", default="balanced,zipf")
    p.add_argument("--iters", type=int, default=20, help="transport iterations per size")
    p.add_argument("--skip", choices=["train", "transport"], action="append", default=[],
                   help="leave a part out (repeatable)")
    a = p.parse_args(argv)
    if a.gpus < 2:
        p.error(f"--gpus {a.gpus}: expert parallelism needs at least 2")
    if a.steps < 1 or a.warmup < 0 or a.iters < 1:
        p.error("--steps and --iters must be positive, --warmup not negative")
    try:
        sizes = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens {a.tokens!r}: comma-separated integers expected")
    if not sizes or min(sizes) < 1:
        p.error(f"--tokens {a.tokens!r}: positive sizes expected")
    bad = set(a.transport_routing.split(",")) - {"balanced", "random", "zipf"}
    if bad:
        p.error(f"--transport-routing: unknown routing {sorted(bad)} (balanced, random, zipf)")
    if len(set(a.skip)) == 2:
        p.error("--skip train and transport leaves nothing to measure")
    return a


def commands(a: argparse.Namespace) -> dict[str, tuple[list[str], Path]]:
    """Each part's command line and the JSON it writes."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.gpus)]
    train_json = a.out.with_name(a.out.stem + "_train_step.json")
    transport_json = a.out.with_name(a.out.stem + "_transport.json")
    parts = {
        "train": ([*run, str(TOOLS / "bench_train_step.py"), "--config", a.config, "--methods", "ddp", "ep",
                   "--routing", *ROUTINGS, "--steps", str(a.steps), "--warmup", str(a.warmup),
                   "--out", str(train_json)], train_json),
        "transport": ([*run, str(TOOLS / "bench_ep_transport.py"), "--graphs", "--tokens", a.tokens,
                       "--routing", a.transport_routing, "--iters", str(a.iters),
                       "--out", str(transport_json)], transport_json),
    }
    return {name: part for name, part in parts.items() if name not in a.skip}


def train_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """EP over DP tokens/s per GPU and both MFUs, per routing."""
    by = {(r["method"], r["routing"]): r for r in report["runs"]}
    checks = []
    for routing in ROUTINGS:
        dp, ep = by.get(("ddp", routing)), by.get(("ep", routing))
        if dp is None or ep is None:
            continue
        ratio = ep["tokens_per_s_per_gpu"] / dp["tokens_per_s_per_gpu"]
        checks.append(dict(routing=routing, dp_tokens_per_s_per_gpu=dp["tokens_per_s_per_gpu"],
                           ep_tokens_per_s_per_gpu=ep["tokens_per_s_per_gpu"], ep_over_dp=ratio,
                           dp_mfu=dp["mfu"], ep_mfu=ep["mfu"],
                           met=ratio >= EP_OVER_DP and min(dp["mfu"] or 0, ep["mfu"] or 0) >= MFU))
    return checks


def transport_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Rowwise (``combine="auto"``, from CUDA graphs where replayed) over NCCL per size and routing."""
    rows = report["rows"]
    largest = max(r["tokens"] for r in rows)
    checks = []
    for r in rows:
        if r["backend"] not in ("rowwise:graph", "rowwise"):
            continue
        graphed = any(o["backend"] == "rowwise:graph" and o["tokens"] == r["tokens"]
                      and o["routing"] == r["routing"] for o in rows)
        if graphed and r["backend"] == "rowwise":
            continue  # the graph replay is the device time the targets are about
        want = X_NCCL_MID if MID_MIB[0] <= r["payload_mib"] <= MID_MIB[1] else X_NCCL_ALL
        met = r["x_nccl"] >= want
        if r["tokens"] == largest and r["routing"] == "balanced":
            met = met and r["pct_put_ceiling"] >= PUT_SHARE
        checks.append(dict(tokens=r["tokens"], routing=r["routing"], backend=r["backend"],
                           payload_mib=r["payload_mib"], x_nccl=r["x_nccl"], want_x_nccl=want,
                           pct_put_ceiling=r["pct_put_ceiling"], met=met))
    return checks


def print_summary(result: dict[str, Any]) -> None:
    for name, part in result["parts"].items():
        if part["returncode"] != 0:
            print(f"{name}: exited {part['returncode']} (its output is above)")
    for c in result.get("train_checks", []):
        print(f"train {c['routing']:>8}: EP {c['ep_tokens_per_s_per_gpu']:,.0f} / DP "
              f"{c['dp_tokens_per_s_per_gpu']:,.0f} tok/s/GPU = {c['ep_over_dp']:.3f}x (>= {EP_OVER_DP}), "
              f"MFU EP {c['ep_mfu'] or 0:.1%} DP {c['dp_mfu'] or 0:.1%} (>= {MFU:.0%}): "
              f"{'met' if c['met'] else 'NOT met'}")
    for c in result.get("transport_checks", []):
        print(f"transport {c['tokens']:>6} {c['routing']:>8} {c['payload_mib']:>7.1f} MiB: "
              f"{c['x_nccl']:.2f}x NCCL (>= {c['want_x_nccl']}), {c['pct_put_ceiling']:.0f}% put: "
              f"{'met' if c['met'] else 'NOT met'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"parts": {}}
    for name, (cmd, json_path) in commands(a).items():
        print("+", " ".join(cmd), flush=True)
        code = subprocess.run(cmd, check=False).returncode
        report = json.loads(json_path.read_text()) if json_path.exists() else None
        result["parts"][name] = {"command": cmd, "returncode": code, "report": report}
        if report is not None:
            checks = train_checks(report) if name == "train" else transport_checks(report)
            result[f"{name}_checks"] = checks
        a.out.write_text(json.dumps(result, indent=1))  # after every part: a later failure keeps it
    print_summary(result)
    return result


if __name__ == "__main__":
    main()
