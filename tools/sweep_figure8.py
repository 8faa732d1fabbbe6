"""The reference report's Figure 8 on our hardware: DDP vs DDP+EP vs FSDP2, two sweeps.

    # on N GPUs (each point is one torchrun of tools/bench_train_step.py):
    tools/from_source.sh python3 tools/sweep_figure8.py --nproc 2 --config bench-2gpu \\
        --global-batches 32,128,1024 --experts 8,32,64,128 model.n_layers=4 \\
        --out $OUT/figure8.json
    # table and plot from a saved JSON (no GPU needed):
    uv run python tools/sweep_figure8.py --plot-from figure8.json --png figure8.png

(a) accumulation sweep: fixed shape, global batch doubling (in sequences; x seq_len
tokens), methods ``ddp`` and ``fsdp2`` — DDP pays its gradient sync and optimizer
once per step, FSDP2 pays parameter all-gathers and gradient reduce-scatters every
microbatch, so DDP's advantage should grow with the batch.
(b) expert-count sweep: fixed top-k and expert width (so fixed active size), routed
experts varied, methods ``ddp`` (no EP), ``ep`` (EP over all ranks) and ``fsdp2``.

Every point is a separate process, which runs the point's methods one after another
(an out-of-memory point fails alone). When the process fails, the first method
without a result is the one it failed in, marked ``OOM`` (out of memory),
``timeout`` (past ``--timeout``) or ``error``; the methods after it never ran and
are marked ``not run``, not as failures of their own. Extra
``KEY=VALUE`` overrides apply to every point: ``model.n_layers=4`` keeps the sweep
affordable; per-layer compute, parameter traffic and optimizer work all scale with
the layer count, so the DDP/FSDP2 ratios carry over to the full depth, while the
out-of-memory boundary does not (``pretrain plan`` gives it for the full depth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from moe_testing import run_process_tree

BENCH = Path(__file__).resolve().with_name("bench_train_step.py")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-2gpu")
    p.add_argument("--nproc", type=int, default=2, help="GPUs (processes) per point")
    p.add_argument("--global-batches", default="32,128,1024",
                   help="accumulation sweep: global batches in sequences ('' to skip)")
    p.add_argument("--experts", default="8,32,64,128",
                   help="expert-count sweep: routed experts ('' to skip)")
    p.add_argument("--expert-sweep-global-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per point")
    p.add_argument("--out", type=Path, default=None, help="JSON of every point")
    p.add_argument("--plot-from", type=Path, default=None,
                   help="skip running: print the table of this JSON (and plot with --png)")
    p.add_argument("--png", type=Path, default=None, help="write the two-panel plot here")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p.parse_args(argv)


def run_point(a: argparse.Namespace, sweep: str, value: int, methods: list[str],
              overrides: list[str]) -> list[dict[str, Any]]:
    """One torchrun of the train-step benchmark; a row per method: measured, failed or not run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "point.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={a.nproc}", str(BENCH), "--config", a.config,
               "--methods", *methods, "--routing", "model", "--warmup", str(a.warmup),
               "--steps", str(a.steps), "--out", str(out), *a.overrides, *overrides]
        try:
            proc = run_process_tree(cmd, capture_output=True, text=True, timeout=a.timeout,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            failure = None if proc.returncode == 0 else (
                "OOM" if "OutOfMemoryError" in proc.stderr + proc.stdout else "error")
            tail = (proc.stderr or proc.stdout)[-1500:]
        except subprocess.TimeoutExpired:
            failure, tail = "timeout", ""
        measured = json.loads(out.read_text())["runs"] if out.exists() else []
    rows = [{**r, "sweep": sweep, "value": value, "status": "ok"} for r in measured]
    rows += unmeasured_rows(sweep, value, methods, {r["method"] for r in measured}, failure, tail)
    print(f"{sweep}={value}: " + ", ".join(
        f"{r['method']} {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU" if r["status"] == "ok"
        else f"{r['method']} {r['status']}" for r in rows), flush=True)
    return rows


def unmeasured_rows(sweep: str, value: int, methods: list[str], done: set[str],
                    failure: str | None, tail: str) -> list[dict[str, Any]]:
    """Rows of the methods without a result. The benchmark runs ``methods`` in order and
    writes its JSON after each, so the first of them is the one the process failed in
    (``failure``; or its setup before it, which the error tail shows) and the others never
    started: ``not run``, whatever ended the process. Without a failure a missing method
    is ``missing``."""
    todo = [m for m in methods if m not in done]
    rows = []
    for i, method in enumerate(todo):
        row = {"sweep": sweep, "value": value, "method": method}
        if failure is None:
            row.update(status="missing", error_tail=tail)
        elif i == 0:
            row.update(status=failure, error_tail=tail)
        else:
            row.update(status="not run", after=f"{todo[0]} {failure}")
        rows.append(row)
    return rows


def print_table(points: list[dict[str, Any]], seq_len: int | None) -> None:
    print(f"\n{'sweep':>10s} {'value':>7s} {'tokens':>9s} {'method':>7s} {'tok/s/GPU':>10s} "
          f"{'MFU':>6s} {'peak GiB':>9s} {'step ms':>9s} {'x fsdp2':>8s}")
    fsdp2 = {(p["sweep"], p["value"]): p for p in points
             if p["method"] == "fsdp2" and p["status"] == "ok"}
    for p in points:
        tokens = f"{p['value'] * seq_len / 2**20:.2f}Mi" if p["sweep"] == "global_batch" and \
            seq_len else "-"
        if p["status"] != "ok":
            after = f"  (the process ended at {p['after']} first)" if "after" in p else ""
            print(f"{p['sweep']:>10s} {p['value']:>7d} {tokens:>9s} {p['method']:>7s} "
                  f"{p['status']:>10s}{after}")
            continue
        ref = fsdp2.get((p["sweep"], p["value"]))
        ratio = f"{p['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}" if ref else "-"
        mfu = f"{p['mfu']:.1%}" if p["mfu"] is not None else "-"  # None on CPU
        peak = f"{p['peak_mem_gib']:.1f}" if p["peak_mem_gib"] is not None else "-"
        print(f"{p['sweep']:>10s} {p['value']:>7d} {tokens:>9s} {p['method']:>7s} "
              f"{p['tokens_per_s_per_gpu']:>10,.0f} {mfu:>6s} {peak:>9s} "
              f"{p['step_ms']:>9.0f} {ratio:>8s}")


def plot(points: list[dict[str, Any]], seq_len: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, sweep, xlabel in ((axes[0], "global_batch", "global batch (Mi tokens)"),
                              (axes[1], "experts", "routed experts")):
        for row, (method, color) in enumerate((("ddp", "tab:blue"), ("ep", "tab:green"),
                                               ("fsdp2", "tab:orange"))):
            pts = sorted((p for p in points if p["sweep"] == sweep and p["method"] == method),
                         key=lambda p: p["value"])
            if not pts:
                continue
            scale = seq_len / 2**20 if sweep == "global_batch" else 1
            ok = [p for p in pts if p["status"] == "ok"]
            ax.plot([p["value"] * scale for p in ok],
                            [p["tokens_per_s_per_gpu"] / 1e3 for p in ok], marker="o", label=method,
                            color=color)
            for p in pts:  # at zero: a failure as x, a method that never ran hollow; one label row per method
                if p["status"] != "ok":
                    style = {"marker": "o", "fillstyle": "none"} if p["status"] == "not run" \
                        else {"marker": "x"}
                    ax.plot(p["value"] * scale, 0, color=color, **style)
                    ax.annotate(f"{method} {p['status']}", (p["value"] * scale, 0), fontsize=8,
                                color=color, textcoords="offset points", xytext=(4, 4 + 10 * row))
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("thousand tokens/s per GPU")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_title("(a) accumulation sweep")
    axes[1].set_title("(b) expert-count sweep")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.plot_from is not None:
        report = json.loads(a.plot_from.read_text())
    else:
        from pretrain.config import load_config

        report = {"config": a.config, "overrides": a.overrides, "nproc": a.nproc,
                  "seq_len": load_config(a.config, list(a.overrides)).train.seq_len,
                  "points": []}
        todo = [("global_batch", int(v), ["ddp", "fsdp2"], [f"train.global_batch={v}"])
                for v in a.global_batches.split(",") if v]
        todo += [("experts", int(v), ["ddp", "ep", "fsdp2"],
                  [f"model.n_experts={v}", f"train.global_batch={a.expert_sweep_global_batch}"])
                 for v in a.experts.split(",") if v]
        for sweep, value, methods, overrides in todo:
            report["points"] += run_point(a, sweep, value, methods, overrides)
            if a.out is not None:  # after every point: a cut-short sweep keeps what it measured
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(report, indent=2))
    print_table(report["points"], report["seq_len"])
    if a.png is not None:
        plot(report["points"], report["seq_len"], a.png)


if __name__ == "__main__":
    main()
