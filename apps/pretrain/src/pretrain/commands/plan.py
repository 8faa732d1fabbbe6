"""Predict per-GPU peak memory of a run (or of a family of large layouts) and whether it fits.

    uv run pretrain plan --config bench-1gpu                        # one H200
    uv run pretrain plan --config bench-2gpu --gpus 2 parallel.ep=2 # the same overrides as a run
    uv run pretrain plan --config my_run.toml --gpus 64 --json      # machine-readable
    uv run pretrain plan --sweep                                    # 12B-1.2T models on 16-512 GPUs
    uv run pretrain plan --config bench-1gpu --time                 # + predicted step time
    uv run pretrain plan --config my_run.toml --gpus 64 --gpus-per-node 8 --time --profile p.json
    uv run pretrain plan --sweep --time                             # layouts ranked by tokens/s

The plan counts, per pipeline rank, the persistent training state tensor by
tensor with the packages' own layout rules (compute weights, FP32 gradient
buckets, sharded FP32 main weights and optimizer states, MXFP8 caches), the
activations the schedule keeps in flight with their transients, the optimizer
step's buffers, and what lives outside PyTorch's allocator (CUDA context, NCCL,
the NVSHMEM heap). See ``pretrain.planner`` for how each number is derived and
docs/performance.md for what has been measured.

A layout that does not fit comes with the overrides that would make it fit, the least
change first (``pretrain.planner.remedies``: expert-gradient merging, activation
recompute, micro batch size), or the reason none does.

``--time`` adds the predicted step time, tokens/s per GPU and MFU, with what the
step is made of (compute per kernel class, exposed communication per collective,
the pipeline bubble), from a calibration profile (``pretrain calibrate``; default:
the bundled ``h200`` profile, built from recorded figures) and the link table
(``--link`` overrides a link class).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pretrain.commands.train import add_config_arguments
from pretrain.errors import UsageError

HELP = "predict per-GPU memory (and, with --time, step time) of a run before renting the GPUs"

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
    parser.add_argument("--time", action="store_true",
                        help="also predict step time, tokens/s per GPU and MFU (with --sweep: "
                             "rank the layouts that fit by predicted tokens/s)")
    parser.add_argument("--profile", default="h200", metavar="P",
                        help="calibration profile: a JSON file from 'pretrain calibrate' or a "
                             "bundled name (h200, b200; default: h200)")
    parser.add_argument("--gpus-per-node", type=int, default=8, metavar="M",
                        help="GPUs sharing one NVLink node (default: 8)")
    parser.add_argument("--link", action="append", default=[], metavar="CLASS=ALPHA_US,GBPS",
                        help="override a link class of the profile (nvlink, network) with "
                             "alpha-beta figures or a table entry, e.g. network=ib-xdr-800")
    parser.add_argument("--top", type=int, default=3, metavar="K",
                        help="with --sweep --time: layouts printed per model and GPU count "
                             "(default: 3; --json gives all)")


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


_TIME_COLUMNS = ("gpus", "pp", "dp", "ep", "recompute", "device_gib", "step_s",
                 "tokens_per_s_per_gpu", "mfu", "exposed_comm_s", "bubble_s")
_TIME_HEADS = ("gpus", "pp", "dp", "ep", "recompute", "GiB", "step s", "tok/s/GPU", "MFU",
               "comm s", "bubble s")


def _print_time_sweep(args: argparse.Namespace, profile: object) -> None:
    from pretrain import planner
    from pretrain.planner import summary_row, sweep_time, time_row

    results = sweep_time(profile, planner.FAMILY, planner.GPU_COUNTS,
                         gpus_per_node=args.gpus_per_node, gpu_gib=args.gpu_gib,
                         headroom=args.headroom)
    if args.json:
        print(json.dumps([
            {"model": r.member.name, "gpus": r.world, "rank": i + 1,
             **summary_row(t.plan), **time_row(t.time)}
            for r in results for i, t in enumerate(r.ranked)], indent=1))
        return
    print(f"Predicted step times (profile {profile.name}: {profile.source.split(':')[0]}); "
          f"predictions, not measurements. {args.gpu_gib:g} GiB GPUs ({args.headroom:.0%} "
          f"headroom), {args.gpus_per_node} per node; seq 4096, global batch 4 Mi tokens, "
          "micro batch 1, 1F1B, BF16, capacity factor 1.25.")
    print(f"Per model and GPU count, the {args.top} fastest layouts that fit (the least "
          "recompute that fits per pipeline depth and EP), fastest first.")
    for member in planner.FAMILY:
        m = member.model
        print(f"\n{member.name} ({member.report}): d {m.d_model}, {m.n_layers} layers, "
              f"{m.n_experts} experts top-{m.top_k}, hidden {m.expert_hidden}")
        print("  " + "  ".join(f"{h:>9}" for h in _TIME_HEADS))
        for result in (r for r in results if r.member is member):
            if not result.ranked:
                print(f"  {result.world:>9}  no layout fits")
            for t in result.ranked[:args.top]:
                row = {**summary_row(t.plan), **time_row(t.time)}
                row["mfu"] = f"{row['mfu']:.1%}"
                row["tokens_per_s_per_gpu"] = f"{row['tokens_per_s_per_gpu']:,}"
                print("  " + "  ".join(f"{row[c]!s:>9}" for c in _TIME_COLUMNS))


def _profile(args: argparse.Namespace) -> object:
    from pretrain.planner import load_profile
    from pretrain.planner.profile import parse_link

    try:
        profile = load_profile(args.profile)
        links = dict(parse_link(text) for text in args.link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return profile.with_links(**links) if links else profile


def run(args: argparse.Namespace) -> int:
    """Exit 0 (also when the layout does not fit), 2 on a bad config or flag."""
    from pretrain.planner import H200_GIB

    profile = _profile(args) if args.time else None
    if args.gpu_gib is None:
        args.gpu_gib = profile.gpu_gib if profile is not None else H200_GIB
    bad = [f"--gpus must be >= 1, got {args.gpus}" if args.gpus < 1 else None,
           f"--gpus-per-node must be >= 1, got {args.gpus_per_node}"
           if args.gpus_per_node < 1 else None,
           f"--top must be >= 1, got {args.top}" if args.top < 1 else None,
           f"--gpu-gib must be a finite positive number, got {args.gpu_gib:g}"
           if not (math.isfinite(args.gpu_gib) and args.gpu_gib > 0) else None,
           f"--headroom must be in [0, 1), got {args.headroom:g}"
           if not 0 <= args.headroom < 1 else None]
    if any(bad):
        raise UsageError("; ".join(b for b in bad if b))
    if args.sweep:
        if args.config is not None or args.overrides:
            raise UsageError("--sweep plans the built-in family; it takes no --config or overrides")
        if profile is not None:
            _print_time_sweep(args, profile)
        else:
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
        step = None
        if profile is not None:
            from pretrain.planner import predict_step

            step = predict_step(request, profile, args.gpus_per_node,
                                cuda_graphs=cfg.train.cuda_graphs)
    except ValueError as e:  # moe_pp's ScheduleError is a ValueError too
        raise UsageError(str(e)) from None
    remedies = more_gpus = None
    if not plan.fits:
        from pretrain.planner.remedies import fewest_gpus, fitting_changes

        remedies = fitting_changes(cfg, args.gpus, gpu_gib=args.gpu_gib, headroom=args.headroom)
        if not remedies:
            more_gpus = fewest_gpus(cfg, args.gpus, gpu_gib=args.gpu_gib, headroom=args.headroom)
    if args.json:
        out = plan.to_json()
        if remedies is not None:
            out["fits_with"] = [r.to_json() for r in remedies]
            out["fits_on_more_gpus"] = more_gpus.to_json() if more_gpus is not None else None
        if step is not None:
            out["step_time"] = step.to_json()
        print(json.dumps(out, indent=1))
    else:
        print(format_plan(plan, f"pretrain plan --config {args.config or 'default'}"))
        if remedies is not None:
            from pretrain.planner.remedies import format_remedies

            print(format_remedies(plan, remedies, more_gpus))
        if step is not None:
            from pretrain.planner import format_step_time

            print()
            print(format_step_time(step))
    return 0
