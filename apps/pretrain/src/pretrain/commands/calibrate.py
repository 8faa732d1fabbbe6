"""Measure this machine's kernel rates into a step-time profile for ``pretrain plan --time``.

    uv run pretrain calibrate --out h200.json                      # one GPU: a minute or two
    uv run pretrain calibrate --out p.json --link network=ib-xdr-800
    uv run pretrain calibrate --out p.json --ep-transport ep_transport.json
    uv run pretrain plan --config my_run.toml --gpus 64 --time --profile h200.json

Measures dense GEMMs, the experts' grouped GEMMs at several rows per expert, causal
attention, memory bandwidth, the gap between kernels replayed from a CUDA graph and
the host time per eager launch (``pretrain.planner.calibrate``). Link parameters are
not measured: they come from the published figures of ``LINK_TABLE`` for the device
(``--link`` overrides). The EP transport's share of NVLink comes from a two-GPU run of
``tools/bench_ep_transport.py`` with ``--ep-transport`` (``pretrain.planner.transport_fit``),
else from the two H200s the project measured. Without a GPU (or with ``--device cpu``) the same
measurements run at tiny sizes in seconds: a CPU profile, for plans of CPU runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pretrain.errors import PretrainError, UsageError

HELP = "measure this machine's kernel rates into a step-time profile for plan --time"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="PROFILE.json",
                        help="where to write the profile (JSON)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: the GPU if there is one, else a tiny CPU profile")
    parser.add_argument("--name", default=None, help="the profile's name (default: the device's)")
    parser.add_argument("--link", action="append", default=[], metavar="CLASS=ALPHA_US,GBPS",
                        help="a link class's figures instead of the table's (nvlink, network), "
                             "e.g. network=ib-xdr-800 or network=10,90")
    parser.add_argument("--ep-transport", type=Path, default=None, metavar="BENCH.json",
                        help="fit the EP transport's share of NVLink to this two-GPU run of "
                             "tools/bench_ep_transport.py (balanced routing rows)")


def run(args: argparse.Namespace) -> int:
    from pretrain.planner.profile import parse_link

    try:
        links = dict(parse_link(text) for text in args.link)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not args.out.parent.is_dir():
        raise UsageError(f"--out {args.out}: directory {args.out.parent} does not exist")
    transport = None
    if args.ep_transport is not None:  # checked before minutes of measuring
        from pretrain.planner.transport_fit import load_transport_report

        try:
            transport = load_transport_report(args.ep_transport)
        except ValueError as e:
            raise UsageError(f"--ep-transport {e}") from None
    import torch

    from pretrain.planner.calibrate import calibrate

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PretrainError("--device cuda: no CUDA device here "
                            "(--device cpu measures a CPU profile)")
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    def progress(what: str) -> None:
        print(f"measuring {what}", file=sys.stderr, flush=True)

    profile = calibrate(device, args.name, links, progress=progress)
    if transport is not None:
        from dataclasses import replace

        from pretrain.planner.transport_fit import ep_transport_efficiency

        share = ep_transport_efficiency(transport, profile.links["nvlink"], str(args.ep_transport))
        profile = replace(profile, ep_transport_efficiency=share,
                          source=f"{profile.source}; EP transport share fitted to {args.ep_transport}")
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    tmp.replace(args.out)  # never a half-written profile
    print(f"{profile.device}: dense GEMMs {profile.dense_gemm_tflops:.4g} TFLOP/s, experts "
          f"{profile.expert_gemm_tflops:.4g} (half at {profile.expert_gemm_half_rows:.0f} rows "
          f"per expert), attention {profile.attention_fwd_tflops:.4g}/"
          f"{profile.attention_bwd_tflops:.4g}, memory {profile.memory_gb_per_s:,.4g} GB/s, "
          f"graph gap {profile.kernel_gap_us_graphs:.2f} us, host {profile.host_launch_us:.1f} "
          f"us/launch, EP transport {profile.ep_transport_efficiency:.3g} of NVLink -> {args.out}")
    return 0
