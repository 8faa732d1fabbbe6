"""Step-time predictions against measured steps on one GPU.

    # one H200 (< 8 min): calibrate, then bench-1gpu and three shapes no preset names,
    # each with and without CUDA graphs, through the app's own Trainer
    tools/from_source.sh python3 tools/validate_step_time.py \\
        --profile-out $OUT/h200.json --out $OUT/validate_step_time.json
    # CPU: the shapes, their plans and predictions from a profile, nothing measured
    uv run python tools/validate_step_time.py --dry-run --profile h200

The measurement is ``tools/bench_train_step.py``'s (``run_method``: warm-up steps,
then timed ``Trainer.step`` calls, model routing). The prediction is ``pretrain plan
--time``'s (``predict_step``) for the same config, from the profile calibrated at the
start of the run (or ``--profile``). Prints a table and writes JSON: the profile,
and per shape and graphs on/off the predicted and measured step and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Shapes the presets do not name, on top of bench-1gpu: fewer and wider experts; a wide
# model; many small experts (short kernels: where the host and the graphs matter).
SHAPES: dict[str, list[str]] = {
    "bench-1gpu": [],
    "wide-experts": ["model.n_layers=6", "model.n_experts=16", "model.top_k=2",
                     "model.expert_hidden=4096", "train.global_batch=16"],
    "d4096": ["model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
              "model.n_layers=4", "model.n_experts=32", "model.top_k=4",
              "model.expert_hidden=1536", "train.micro_batch=1", "train.global_batch=16"],
    "small-experts": ["model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=2",
                      "model.n_layers=12", "model.n_experts=128", "model.expert_hidden=512",
                      "train.global_batch=32"],
}
GRAPHS = {"on": "train.cuda_graphs=true", "off": "train.cuda_graphs=false"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", default=None,
                   help="use this profile (file or bundled name) instead of calibrating")
    p.add_argument("--profile-out", type=Path, default=None,
                   help="write the calibrated profile here")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--graphs", nargs="+", choices=list(GRAPHS), default=list(GRAPHS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dry-run", action="store_true",
                   help="print the shapes and their predictions; measure nothing (CPU)")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    return p.parse_args(argv)


def shape_config(shape: str, graphs: str) -> Any:
    from pretrain.config import load_config

    return load_config("bench-1gpu", [*SHAPES[shape], GRAPHS[graphs]])


def predict(cfg: Any, profile: Any) -> dict[str, Any]:
    from pretrain.planner import PlanRequest, plan_memory, predict_step

    request = PlanRequest.from_config(cfg, 1, gpu_gib=profile.gpu_gib)
    st = predict_step(request, profile, cuda_graphs=cfg.train.cuda_graphs)
    plan = plan_memory(request)
    return {"step_ms": st.step_s * 1e3, "tokens_per_s": st.tokens_per_s, "mfu": st.mfu,
            "planned_peak_gib": plan.worst.peak_allocated / 2**30, "fits": plan.fits,
            "breakdown_ms": {k: v * 1e3 for k, v in st.compute.items()}}


def measure(cfg: Any, shape: str, graphs: str, a: argparse.Namespace, device: torch.device,
            run_dir: Path) -> dict[str, Any]:
    """``bench_train_step``'s measurement of ``cfg`` (ddp on one rank, model routing)."""
    import bench_train_step as bench

    args = bench.parse_args([*SHAPES[shape], GRAPHS[graphs], "--config", "bench-1gpu",
                             "--routing", "model", "--warmup", str(a.warmup),
                             "--steps", str(a.steps)])
    cfg, why = bench.method_config(args, "ddp", device, 1, run_dir / f"{shape}-{graphs}")
    if why is not None:
        raise SystemExit(f"{shape}: CUDA graphs refused ({why})")
    row = bench.run_method(args, "ddp", cfg, device, 1)[0]
    return {"step_ms": row["step_ms"], "tokens_per_s": row["tokens_per_s"], "mfu": row["mfu"],
            "peak_gib": row["peak_mem_gib"], "phase_ms": row["phase_ms"]}


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("shape", "graphs", "pred ms", "meas ms", "pred tok/s", "meas tok/s", "error")
    print(" ".join(f"{h:>13}" for h in head))
    for r in rows:
        p, m = r["predicted"], r.get("measured")
        cells = [r["shape"], r["graphs"], f"{p['step_ms']:.1f}",
                 f"{m['step_ms']:.1f}" if m else "-", f"{p['tokens_per_s']:,.0f}",
                 f"{m['tokens_per_s']:,.0f}" if m else "-",
                 f"{r['error']:+.1%}" if m else "-"]
        print(" ".join(f"{c:>13}" for c in cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    from pretrain.planner import load_profile
    from pretrain.planner.calibrate import calibrate
    from pretrain.runtime import distributed

    started = time.time()
    report: dict[str, Any] = {"shapes": {s: SHAPES[s] for s in a.shapes}, "rows": []}
    if a.dry_run:
        profile = load_profile(a.profile or "h200")
        report["profile"] = profile.to_json()
        for shape in a.shapes:
            for graphs in a.graphs:
                report["rows"].append({"shape": shape, "graphs": graphs,
                                       "predicted": predict(shape_config(shape, graphs), profile)})
        print_table(report["rows"])
    else:
        if not torch.cuda.is_available():
            raise SystemExit("validate_step_time measures on a CUDA GPU; --dry-run runs on CPU")
        with distributed("cuda") as rt, tempfile.TemporaryDirectory() as tmp:
            profile = load_profile(a.profile) if a.profile else calibrate(rt.device)
            report["profile"] = profile.to_json()
            report["device"] = torch.cuda.get_device_name(rt.device)
            report["calibrate_s"] = time.time() - started
            if a.profile_out is not None:
                a.profile_out.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
            for shape in a.shapes:
                for graphs in a.graphs:
                    cfg = shape_config(shape, graphs)
                    row = {"shape": shape, "graphs": graphs, "predicted": predict(cfg, profile),
                           "measured": measure(cfg, shape, graphs, a, rt.device, Path(tmp))}
                    row["error"] = (row["predicted"]["tokens_per_s"]
                                    / row["measured"]["tokens_per_s"] - 1)
                    report["rows"].append(row)
                    torch.cuda.empty_cache()
                    if a.out is not None:  # after every row: a later failure keeps the rest
                        a.out.parent.mkdir(parents=True, exist_ok=True)
                        a.out.write_text(json.dumps(report, indent=2))
                    print_table(report["rows"][-1:])
            print()
            print_table(report["rows"])
    report["wall_s"] = time.time() - started
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
