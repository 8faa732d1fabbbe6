"""`pretrain plan` against the memory the app actually uses, per rank.

    # one H200 (each case in its own process: NCCL/NVSHMEM state does not carry over)
    for c in base selective muon mxfp8 fp8_rowwise fp8_rowwise_gw_hp fp8_blockwise fp8_step; do
        tools/from_source.sh python3 tools/plan_validate.py \\
        --config bench-1gpu --case $c --out $OUT/plan_1gpu_$c.json; done
    # two H200s
    for c in dp ep pp; do tools/from_source.sh python3 -m torch.distributed.run \\
        --nproc-per-node 2 tools/plan_validate.py --config bench-2gpu --case $c \\
        --out $OUT/plan_2gpu_$c.json; done
    # CPU (gloo; LiveBytes stands in for the CUDA allocator's statistics)
    uv run python tools/plan_validate.py --config tiny --device cpu --case base

A case is a set of overrides on the config (``--case``, plus any KEY=VALUE; printed
first and kept in the JSON). The ``ep``, ``pp`` and low-precision cases turn
``train.cuda_graphs`` off, which those layouts refuse (``bench-1gpu`` has it on). The
FP8 cases (``moe_mxfp8.FP8_RECIPES``) run the routed experts on the recipe's native
grouped GEMMs on CUDA where it has them (``mxfp8.gemm=native``), emulated otherwise;
``fp8_step`` is the fastest FP8 step's settings (experts, attention projections and LM
head on the Triton and native FP8 GEMMs, CUDA graphs as the config has them; GPU only).
The app's own ``Trainer`` is built and runs ``--steps`` optimizer steps; measured per
rank: ``torch.cuda.max_memory_allocated`` (what the plan's "peak allocated"
predicts; the target is within 10%), ``max_memory_reserved`` (peak allocated plus
fragmentation) and the device's used memory from ``cudaMemGetInfo`` (adds the CUDA
context, NCCL and the NVSHMEM heap: the plan's "on the device"). On CPU the peak
comes from ``pretrain.planner.measure.LiveBytes`` over the same build and steps,
compared with the plan of the CPU kernels. The plan is made for the run's compute
dtype (``train.compute_dtype=auto`` is float32 on CPU, bfloat16 on GPU). A short table
is printed last; the JSON holds both sides of every number.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_mxfp8 import FP8_RECIPES
from pretrain.config import load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.planner import PlanRequest, plan_memory
from pretrain.planner.measure import LiveBytes
from pretrain.planner.memory import GIB, KERNEL_WORKSPACES
from pretrain.runtime import distributed
from pretrain.trainer import Trainer, resolve_dtype

EAGER = "train.cuda_graphs=false"  # what the layouts that refuse CUDA graphs run with
CASES: dict[str, list[str]] = {
    "base": [],  # the config as given (DP over all ranks)
    "dp": [],
    "selective": ["model.recompute=selective"],
    "block": ["model.recompute=block"],
    "muon": ["optim.name=muon"],
    "ep": ["parallel.ep=2", EAGER],  # rowwise on CUDA, all_to_all on CPU (below)
    "pp": ["parallel.pp=2", EAGER],
    "mxfp8": ["mxfp8.targets=[experts]", EAGER],
    **{recipe: ["mxfp8.targets=[experts]", f"mxfp8.recipe={recipe}", EAGER]
       for recipe in FP8_RECIPES},
    # the fastest FP8 step (docs/performance.md), CUDA graphs as the config has them
    "fp8_step": ["mxfp8.targets=[experts,attn.w?,head]", "mxfp8.recipe=fp8_rowwise_gw_hp",
                 "mxfp8.gemm=triton", "mxfp8.fp8_fast_accum=[output,grad_input]",
                 "mxfp8.dense_gemm=native"],
}
TARGET = 0.10


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-1gpu", help="preset name or TOML file")
    p.add_argument("--case", choices=list(CASES), default="base")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps to run")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON file (rank 0)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p.parse_args(argv)


def _measure(cfg: Any, world: int, device: torch.device, steps: int) -> dict[str, Any]:
    """Build the app's trainer, run ``steps`` steps; this rank's peaks in bytes."""
    mesh = build_mesh(validate_layout(cfg, world), device.type)
    out: dict[str, Any] = {"pp_rank": mesh.pp_rank, "rank": dist.get_rank()}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        trainer = Trainer(cfg, mesh, device)
        for step in range(1, steps + 1):
            trainer.train_step(step)
            if step < steps:
                trainer.capture_graphs()
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        out.update(peak_allocated=torch.cuda.max_memory_allocated(device),
                   peak_reserved=torch.cuda.max_memory_reserved(device), device_used=total - free)
    else:
        with LiveBytes() as live:
            trainer = Trainer(cfg, mesh, device)
            for step in range(1, steps + 1):
                trainer.train_step(step)
                if step < steps:
                    trainer.capture_graphs()
        out["peak_allocated"] = live.peak
    trainer.close()
    del trainer
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    # A constant schedule: memory does not depend on it, and a cosine one needs more
    # steps than its warmup.
    overrides = [*CASES[args.case], *args.overrides, f"train.steps={args.steps}",
                 "optim.schedule=constant", f"train.device={args.device}"]
    with distributed(args.device) as rt:
        if args.case == "ep":
            backend = "rowwise" if rt.device.type == "cuda" else "all_to_all"
            overrides.append(f"parallel.ep_backend={backend}")
        if args.case in FP8_RECIPES and FP8_RECIPES[args.case].native and rt.device.type == "cuda":
            overrides.append("mxfp8.gemm=native")
        cfg = load_config(args.config, overrides)
        if rt.rank == 0:
            graphs = "on" if cfg.train.cuda_graphs else "off"
            print(f"case {args.case}: {args.config} {' '.join(overrides)} (CUDA graphs {graphs})",
                  flush=True)
        measured = _measure(cfg, rt.world_size, rt.device, args.steps)
        gathered: list[dict[str, Any]] = [{}] * rt.world_size
        dist.all_gather_object(gathered, measured)
        if rt.rank != 0:
            return
        dtype = str(resolve_dtype(cfg.train.compute_dtype, rt.device)).removeprefix("torch.")
        plan = plan_memory(PlanRequest.from_config(cfg, rt.world_size, compute_dtype=dtype),
                           kernels=rt.device.type)
        rows = []
        for m in gathered:
            rank_plan = plan.ranks[m["pp_rank"]]
            predicted = rank_plan.peak_allocated
            if rt.device.type == "cpu":
                predicted -= KERNEL_WORKSPACES  # CUDA-only
            row = {"case": args.case, "rank": m["rank"], "pp_rank": m["pp_rank"],
                   "predicted_peak_allocated": predicted,
                   "measured_peak_allocated": m["peak_allocated"],
                   "error": predicted / m["peak_allocated"] - 1}
            if rt.device.type == "cuda":
                row.update(predicted_reserved=predicted + rank_plan.fragmentation,
                           measured_reserved=m["peak_reserved"],
                           predicted_device=rank_plan.device_total,
                           measured_device=m["device_used"])
            rows.append(row)
        if args.out is not None:
            args.out.write_text(json.dumps({"config": args.config, "overrides": overrides,
                                            "cuda_graphs": cfg.train.cuda_graphs,
                                            "plan": plan.to_json(), "ranks": rows}, indent=1))
        print(f"{'case':>17} {'rank':>4} {'planned':>12} {'measured':>12} {'error':>7}"
              + ("    reserved plan / measured     device plan / measured"
                 if rt.device.type == "cuda" else ""))
        for r in rows:
            line = (f"{r['case']:>17} {r['rank']:>4} {_size(r['predicted_peak_allocated']):>12} "
                    f"{_size(r['measured_peak_allocated']):>12} {r['error']:+7.1%}")
            if rt.device.type == "cuda":
                for key in ("reserved", "device"):
                    line += (f"    {_size(r['predicted_' + key]):>10} / "
                             f"{_size(r['measured_' + key]):<10}")
            print(line)
        worst = max(abs(r["error"]) for r in rows)
        verdict = "ok" if worst <= TARGET else "MISSED"
        print(f"worst |error| {worst:.1%} (target {TARGET:.0%}): {verdict}")


if __name__ == "__main__":
    main()
