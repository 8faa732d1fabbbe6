"""The experts' gate and up projections: two grouped GEMMs vs one paired Triton GEMM.

    tools/from_source.sh python3 tools/bench_gate_up.py --out $OUT/gate_up.json

At the bench-1gpu MoE shapes (8k tokens x top-8 = 65536 dispatched rows, 64 experts,
d_model 2048, expert hidden 1024), balanced and skewed routing, it times, in the same
run:

- forward: ``torch._grouped_mm`` twice (``x @ w1^T``, ``x @ w3^T``) vs the paired
  kernel writing both (``rows_mm_split2``: one work list over both outputs);
- input gradient: ``torch._grouped_mm`` twice (``dg @ w1``, ``du @ w3``, reduction 1024
  each) plus the add of the two ``[R, D]`` results (what autograd does when a tensor
  feeds two GEMMs) vs one GEMM over the joint reduction (``rows_mm_sum2``, 2048);
- the expert layer (``GroupedExperts``) forward + backward with ``grouped_mm`` (two
  GEMMs) vs ``auto`` (the paired path), the input and weight gradients returned by
  ``torch.autograd.grad``: nothing is added into an existing ``.grad``, an
  accumulation over every expert weight the training step does not run (its weight
  gradients go to a gradient sink);
- with ``--padding F``, the rows of an expert-parallel receive buffer sized ``F`` times
  the live rows (dropless EP2 sizes for twice as many): the layer then also shows what
  skipping padding rows in the fused SwiGLU saves.

Times are CUDA events around back-to-back calls (median of repeats); TFLOP/s counts
the live rows' GEMM FLOPs only. A short table is printed last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_layer import Shape, offsets_of, routing_ids, time_ms  # noqa: E402
from moe_model.experts import GroupedExperts  # noqa: E402
from moe_model.triton_grouped_mm import rows_mm_split2, rows_mm_sum2  # noqa: E402


def run(routing: str, padding: float, device: torch.device) -> list[dict]:
    s = Shape(tokens=8192)
    gen = torch.Generator().manual_seed(0)
    ids = routing_ids(routing, s, gen, device)
    R, D, F, E = s.tokens * s.top_k, s.d_model, s.hidden, s.experts
    C = int(R * padding)
    offs = offsets_of(ids, E)
    g = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.05).to(torch.bfloat16)

    x, dg, du = rand(C, D), rand(C, F), rand(C, F)
    w1, w3 = rand(E, F, D), rand(E, F, D)
    gemm_flop = 2 * R * D * F
    rows = []

    def add(what: str, impl: str, ms: float, flop: float | None) -> None:
        rows.append({"routing": routing, "padding": padding, "what": what, "impl": impl, "ms": ms,
                     "tflops": flop / ms / 1e9 if flop else None})

    with torch.no_grad():
        add("fwd gate+up", "2x torch._grouped_mm", time_ms(lambda: (
            torch._grouped_mm(x, w1.transpose(1, 2), offs=offs), torch._grouped_mm(x, w3.transpose(1, 2), offs=offs))),
            2 * gemm_flop)
        add("fwd gate+up", "paired Triton", time_ms(lambda: rows_mm_split2(
            x, w1.transpose(1, 2), w3.transpose(1, 2), offs)), 2 * gemm_flop)
        add("dx", "2x torch._grouped_mm + add", time_ms(lambda: torch._grouped_mm(dg, w1, offs=offs)
                                                      + torch._grouped_mm(du, w3, offs=offs)), 2 * gemm_flop)
        add("dx", "paired Triton (one reduction)", time_ms(lambda: rows_mm_sum2(dg, w1, du, w3, offs)),
            2 * gemm_flop)
        a = torch._grouped_mm(dg, w1, offs=offs) + torch._grouped_mm(du, w3, offs=offs)
        b = rows_mm_sum2(dg, w1, du, w3, offs)
        rows[-1]["max_rel_diff_vs_two_gemms"] = (
            (a[:R].float() - b[:R].float()).abs().max() / a[:R].float().abs().max()).item()
    for backend in ("grouped_mm", "auto"):
        mod = GroupedExperts(E, D, F, backend).to(device)
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0, 0.02, generator=g)
        mod = mod.to(torch.bfloat16)
        xr = x.clone().requires_grad_()
        dy = rand(C, D)

        def layer(mod: GroupedExperts = mod, xr: torch.Tensor = xr, dy: torch.Tensor = dy) -> None:
            torch.autograd.grad(mod(xr, offs), [xr, *mod.parameters()], dy)

        add("expert layer fwd+bwd", backend, time_ms(layer, warmup=2, iters=5), 9 * gemm_flop)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--routing", nargs="+", default=["balanced", "skewed"])
    p.add_argument("--padding", nargs="+", type=float, default=[1.0, 2.0])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    device = torch.device("cuda")
    rows = [r for routing in a.routing for pad in a.padding for r in run(routing, pad, device)]
    if a.out is not None:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=2))
    print(f"{'routing':9s} {'pad':>4s} {'what':22s} {'impl':32s} {'ms':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        print(f"{r['routing']:9s} {r['padding']:4.1f} {r['what']:22s} {r['impl']:32s} {r['ms']:8.3f} {tf:>8s}")


if __name__ == "__main__":
    main()
