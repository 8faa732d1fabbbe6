"""Step-time predictions against measured steps, on one GPU or on two.

    # one H200 (< 8 min): calibrate, then bench-1gpu and three shapes no preset names,
    # each with and without CUDA graphs, through the app's own Trainer
    tools/from_source.sh python3 tools/validate_step_time.py \\
        --profile-out $OUT/h200.json --out $OUT/validate_step_time.json
    # two H200s, after the one-GPU run (its profile; links from the profile's table):
    # bench-2gpu as DP2, EP2 (rowwise transport) and PP2
    tools/from_source.sh python3 -m torch.distributed.run --nproc-per-node 2 \\
        tools/validate_step_time.py --profile $OUT/h200.json --out $OUT/validate_2gpu.json
    # CPU: the cases, their plans and predictions from a profile, nothing measured
    uv run python tools/validate_step_time.py --dry-run --profile h200 [--world 2]
    # CPU: a recorded measurement predicted again from another profile
    uv run python tools/validate_step_time.py --dry-run --profile h200 --world 2 \
        --measured tools/results/validate_step_time_2gpu.json
    # two GPUs: EP2 also with its transport pipelined (parallel.ep_overlap_chunks, and
    # parallel.ep_comm_sms with --ep-comm-sms)
    uv run python tools/validate_step_time.py --dry-run --profile h200 --world 2 \
        --ep-overlap-chunks 2 4 [--ep-comm-sms 32]

The measurement is ``tools/bench_train_step.py``'s (``run_method``: warm-up steps,
then timed ``Trainer.step`` calls, model routing). The prediction is ``pretrain plan
--time``'s (``predict_step``) for the same config, from the profile calibrated at the
start of the run (or ``--profile``; required on more than one GPU, where the host probe
of the calibration would run on every rank). Prints a table and writes JSON (rank 0):
the profile, and per case the predicted and measured step and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
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
# Two GPUs: bench-2gpu (eager, as its preset runs) in each layout, and the bench
# method that builds it.
LAYOUTS: dict[str, tuple[str, list[str]]] = {
    "dp2": ("ddp", []),
    "ep2": ("ep", []),  # the method sets parallel.ep=2 and the rowwise transport
    "pp2": ("ddp", ["parallel.pp=2"]),
}


@dataclass(frozen=True)
class Case:
    """One measured configuration: a shape on one GPU, or a layout on two."""

    name: str
    graphs: str  # "on" | "off" | "preset"
    config: str
    overrides: tuple[str, ...]
    method: str  # tools/bench_train_step.py's method

    def bench_config(self, a: argparse.Namespace, device: torch.device, world: int,
                     run_dir: Path) -> tuple[argparse.Namespace, Any, str | None]:
        """``bench_train_step``'s arguments and config for this case, and why it turned
        the graphs off (``None``: as configured): the one config both the prediction and
        the measurement read (``device`` only by its type: a dry run names CUDA)."""
        import bench_train_step as bench

        args = bench.parse_args([*self.overrides, "--config", self.config, "--routing", "model",
                                 "--warmup", str(a.warmup), "--steps", str(a.steps)])
        cfg, why = bench.method_config(args, self.method, device, world,
                                       run_dir / f"{self.name}-{self.graphs}")
        return args, cfg, why


def cases(world: int, shapes: list[str], graphs: list[str], overlap_chunks: list[int] = (),
          comm_sms: int | None = None) -> list[Case]:
    """The cases on ``world`` GPUs; on two, EP2 also pipelined in each of ``overlap_chunks``
    chunks (its communication stream bounded to ``comm_sms`` SMs)."""
    if world == 1:
        return [Case(shape, g, "bench-1gpu", (*SHAPES[shape], GRAPHS[g]), "ddp")
                for shape in shapes for g in graphs]
    if world == 2:
        sms = () if comm_sms is None else (f"parallel.ep_comm_sms={comm_sms}",)
        return [Case(name, "preset", "bench-2gpu", tuple(extra), method)
                for name, (method, extra) in LAYOUTS.items()] + [
            Case(f"ep2-overlap{n}", "preset", "bench-2gpu",
                 (f"parallel.ep_overlap_chunks={n}", *sms), "ep") for n in overlap_chunks]
    raise SystemExit(f"validate_step_time measures one or two GPUs, not {world}")


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
                   help="print the cases and their predictions; measure nothing (CPU)")
    p.add_argument("--world", type=int, default=1,
                   help="with --dry-run: the GPU count whose cases to predict (1 or 2)")
    p.add_argument("--ep-overlap-chunks", type=int, nargs="+", default=[], metavar="N",
                   help="on two GPUs, also EP2 with parallel.ep_overlap_chunks=N (N >= 2)")
    p.add_argument("--ep-comm-sms", type=int, default=None, metavar="S",
                   help="parallel.ep_comm_sms of the --ep-overlap-chunks cases")
    p.add_argument("--measured", type=Path, default=None, metavar="JSON",
                   help="with --dry-run: score the predictions against this earlier run's "
                        "measurements (its --out), case by case")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    a = p.parse_args(argv)
    if a.measured is not None and not a.dry_run:
        p.error("--measured scores a --dry-run's predictions (a measuring run measures its own)")
    if any(n < 2 for n in a.ep_overlap_chunks):
        p.error(f"--ep-overlap-chunks {a.ep_overlap_chunks}: 2 or more chunks (1 is ep2 itself)")
    if a.ep_comm_sms is not None and (a.ep_comm_sms < 1 or not a.ep_overlap_chunks):
        p.error(f"--ep-comm-sms {a.ep_comm_sms}: a positive SM count, with --ep-overlap-chunks")
    return a


def predict(cfg: Any, profile: Any, world: int) -> dict[str, Any]:
    from pretrain.planner import PlanRequest, plan_memory, predict_step

    request = PlanRequest.from_config(cfg, world, gpu_gib=profile.gpu_gib)
    st = predict_step(request, profile, cuda_graphs=cfg.train.cuda_graphs)
    plan = plan_memory(request)
    return {"step_ms": st.step_s * 1e3, "tokens_per_s": st.tokens_per_s, "mfu": st.mfu,
            "planned_peak_gib": plan.worst.peak_allocated / 2**30, "fits": plan.fits,
            "cuda_graphs": cfg.train.cuda_graphs,
            "breakdown_ms": {k: v * 1e3 for k, v in st.compute.items()},
            "exposed_comm_ms": st.exposed_comm_s * 1e3, "bubble_ms": st.bubble_s * 1e3,
            "ep_comm_ms": st.comm["ep_all_to_all"] * 1e3,
            "ep_exposed_ms": st.exposed["ep_all_to_all"] * 1e3}


def measure(case: Case, args: argparse.Namespace, cfg: Any, why: str | None,
            device: torch.device, world: int) -> dict[str, Any]:
    """``bench_train_step``'s measurement of ``case`` (model routing)."""
    import bench_train_step as bench

    if why is not None and case.graphs == "on":
        raise SystemExit(f"{case.name}: CUDA graphs refused ({why})")
    row = bench.run_method(args, case.method, cfg, device, world)[0]
    return {"step_ms": row["step_ms"], "tokens_per_s": row["tokens_per_s"], "mfu": row["mfu"],
            "peak_gib": row["peak_mem_gib"], "phase_ms": row["phase_ms"],
            "cuda_graphs": row["cuda_graphs"]}


def recorded_measurements(path: Path) -> dict[tuple[str, str, tuple[str, ...]], dict[str, Any]]:
    """The measured rows of an earlier run's JSON by (case, graphs, overrides): a case
    is only scored against the configuration it measured."""
    try:
        rows = json.loads(path.read_text())["rows"]
        return {(r["case"], r["graphs"], tuple(r["overrides"])): r["measured"]
                for r in rows if "measured" in r}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--measured {path}: not a validate_step_time report ({e})") from None


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("case", "graphs", "pred ms", "meas ms", "pred tok/s", "meas tok/s", "error",
            "pred EP ms", "EP exposed")
    print(" ".join(f"{h:>13}" for h in head))
    for r in rows:
        p, m = r["predicted"], r.get("measured")
        cells = [r["case"], r["graphs"], f"{p['step_ms']:.1f}",
                 f"{m['step_ms']:.1f}" if m else "-", f"{p['tokens_per_s']:,.0f}",
                 f"{m['tokens_per_s']:,.0f}" if m else "-",
                 f"{r['error']:+.1%}" if m else "-", f"{p['ep_comm_ms']:.1f}",
                 f"{p['ep_exposed_ms']:.1f}"]
        print(" ".join(f"{c:>13}" for c in cells))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    from pretrain.planner import load_profile
    from pretrain.planner.calibrate import calibrate
    from pretrain.runtime import distributed

    started = time.time()
    report: dict[str, Any] = {"rows": []}
    if a.dry_run:
        profile = load_profile(a.profile or "h200")
        report["profile"] = profile.to_json()
        earlier = recorded_measurements(a.measured) if a.measured is not None else {}
        if a.measured is not None:
            report["measured_in"] = str(a.measured)
        for case in cases(a.world, a.shapes, a.graphs, a.ep_overlap_chunks, a.ep_comm_sms):
            _, cfg, _ = case.bench_config(a, torch.device("cuda"), a.world, Path("dry-run"))
            row = {"case": case.name, "graphs": case.graphs, "overrides": list(case.overrides),
                   "predicted": predict(cfg, profile, a.world)}
            measured = earlier.get((case.name, case.graphs, tuple(case.overrides)))
            if measured is not None:
                row["measured"] = measured
                row["error"] = row["predicted"]["tokens_per_s"] / measured["tokens_per_s"] - 1
            report["rows"].append(row)
        print_table(report["rows"])
    else:
        if not torch.cuda.is_available():
            raise SystemExit("validate_step_time measures on a CUDA GPU; --dry-run runs on CPU")
        with distributed("cuda") as rt, tempfile.TemporaryDirectory() as tmp:
            if rt.world_size > 1 and not a.profile:
                raise SystemExit("on more than one GPU, pass --profile (the one-GPU run's "
                                 "--profile-out)")
            lead = rt.rank == 0
            profile = load_profile(a.profile) if a.profile else calibrate(rt.device)
            report["profile"] = profile.to_json()
            report["device"] = torch.cuda.get_device_name(rt.device)
            report["world"] = rt.world_size
            report["calibrate_s"] = time.time() - started
            if a.profile_out is not None and lead:
                a.profile_out.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
            for case in cases(rt.world_size, a.shapes, a.graphs, a.ep_overlap_chunks,
                              a.ep_comm_sms):
                args, cfg, why = case.bench_config(a, rt.device, rt.world_size, Path(tmp))
                row = {"case": case.name, "graphs": case.graphs, "overrides": list(case.overrides),
                       "predicted": predict(cfg, profile, rt.world_size),
                       "measured": measure(case, args, cfg, why, rt.device, rt.world_size)}
                row["error"] = (row["predicted"]["tokens_per_s"]
                                / row["measured"]["tokens_per_s"] - 1)
                report["rows"].append(row)
                torch.cuda.empty_cache()
                if a.out is not None and lead:  # after every row: a later failure keeps the rest
                    a.out.parent.mkdir(parents=True, exist_ok=True)
                    a.out.write_text(json.dumps(report, indent=2))
                if lead:
                    print_table(report["rows"][-1:])
            if lead:
                print()
                print_table(report["rows"])
            else:
                return report
    report["wall_s"] = time.time() - started
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
