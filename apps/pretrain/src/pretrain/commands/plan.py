"""Predict per-GPU peak memory of a run (or of a family of large layouts) and whether it fits.

    uv run pretrain plan --config bench-1gpu                        # one H200
    uv run pretrain plan --config bench-2gpu --gpus 2 parallel.ep=2 # the same overrides as a run
    uv run pretrain plan --config my_run.toml --gpus 64 --json      # machine-readable
    uv run pretrain plan --sweep                                    # 12B-1.2T models on 16-512 GPUs

The plan counts, per pipeline rank, the persistent training state tensor by
tensor with the packages' own layout rules (compute weights, FP32 gradient
buckets, sharded FP32 main weights and optimizer states, MXFP8 caches), the
activations the schedule keeps in flight with their transients, the optimizer
step's buffers, and what lives outside PyTorch's allocator (CUDA context, NCCL,
the NVSHMEM heap). See ``pretrain.planner`` for how each number is derived and
``tools/perf_notes.md`` for what has been measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pretrain.commands.train import add_config_arguments
from pretrain.errors import UsageError

HELP = "predict per-GPU memory of a run before renting the GPUs"

_SWEEP_COLUMNS = ("gpus", "pp", "dp", "ep", "recompute", "in_flight", "persistent_gib",
                  "activations_gib", "peak_allocated_gib", "device_gib")


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="world size the run will use (default: 1)")
    parser.add_argument("--gpu-gib", type=float, default=None, metavar="GIB",
                        help="memory of one GPU in GiB (default: an H200's)")
    parser.add_argument("--headroom", type=float, default=0.10, metavar="FRACTION",
                        help="share of the GPU to keep free (default: 0.10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--sweep", action="store_true",
                        help="plan the built-in 12B-1.2T model family on 16-512 GPUs instead")


def _print_sweep(args: argparse.Namespace) -> None:
    from pretrain.planner import FAMILY, summary_row, sweep

    rows: dict[str, list[dict]] = {}
    for result in sweep(gpu_gib=args.gpu_gib, headroom=args.headroom):
        plan = result.chosen or result.smallest
        rows.setdefault(result.member.name, []).append(
            {"model": result.member.name, "report": result.member.report,
             "total_params": plan.total_params, "active_params": plan.active_params,
             "layouts_tried": result.tried, **summary_row(plan)})
    if args.json:
        print(json.dumps([row for member_rows in rows.values() for row in member_rows], indent=1))
        return
    print(f"Layouts on {args.gpu_gib:g} GiB GPUs ({args.headroom:.0%} headroom): seq 4096, "
          "global batch 4 Mi tokens, micro batch 1, 1F1B, BF16, capacity factor 1.25.")
    print("First layout that fits, preferring fewer pipeline stages, then less recompute, then "
          "smaller EP; 'NO FIT' rows show the layout needing the least memory.")
    for member in FAMILY:
        first = rows[member.name][0]
        m = member.model
        print(f"\n{member.name}: {first['active_params'] / 1e9:.1f}B active @ "
              f"{first['total_params'] / 1e9:.0f}B total (report: {member.report}); d {m.d_model}, "
              f"{m.n_layers} layers, {m.n_experts} experts top-{m.top_k}, hidden {m.expert_hidden}")
        print("  " + "  ".join(f"{c:>9}" for c in (*_SWEEP_COLUMNS, "fits")))
        for row in rows[member.name]:
            cells = [f"{row[c]!s:>9}" for c in _SWEEP_COLUMNS]
            print("  " + "  ".join(cells) + f"  {'yes' if row['fits'] else 'NO FIT':>9}")


def run(args: argparse.Namespace) -> int:
    """Exit 0 (also when the layout does not fit), 2 on a bad config or flag."""
    from pretrain.planner import H200_GIB

    if args.gpu_gib is None:
        args.gpu_gib = H200_GIB
    bad = [f"--gpus must be >= 1, got {args.gpus}" if args.gpus < 1 else None,
           f"--gpu-gib must be a finite positive number, got {args.gpu_gib:g}"
           if not (math.isfinite(args.gpu_gib) and args.gpu_gib > 0) else None,
           f"--headroom must be in [0, 1), got {args.headroom:g}"
           if not 0 <= args.headroom < 1 else None]
    if any(bad):
        raise UsageError("; ".join(b for b in bad if b))
    if args.sweep:
        if args.config is not None or args.overrides:
            raise UsageError("--sweep plans the built-in family; it takes no --config or overrides")
        _print_sweep(args)
        return 0
    from pretrain.config import load_config
    from pretrain.data import resolve_vocab_size
    from pretrain.init_from import adopt_source_model
    from pretrain.planner import PlanRequest, format_plan, plan_memory

    cfg = load_config(args.config, args.overrides)
    for note in (adopt_source_model(cfg), resolve_vocab_size(cfg)):  # in this order
        if note:
            print(note, file=sys.stderr if args.json else sys.stdout)
    try:
        request = PlanRequest.from_config(cfg, args.gpus, gpu_gib=args.gpu_gib,
                                          headroom=args.headroom)
        plan = plan_memory(request)
    except ValueError as e:  # moe_pp's ScheduleError is a ValueError too
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(format_plan(plan, f"pretrain plan --config {args.config or 'default'}"))
    return 0
