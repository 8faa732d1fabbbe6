"""The experts' GEMMs on one GPU, three subcommands.

    tools/from_source.sh python3 tools/bench_expert_gemms.py layer --out $OUT/layer.json
    tools/from_source.sh python3 tools/bench_expert_gemms.py layer --sweep --out $OUT/sweep.json
    tools/from_source.sh python3 tools/bench_expert_gemms.py gate-up --out $OUT/gate_up.json
    tools/from_source.sh python3 tools/bench_expert_gemms.py gemms --tokens 8192 --merge 4 --out $OUT/gemms.json

Timing and the matmul ceiling come from ``_bench`` (CUDA events; an 8192^3 BF16 matmul
measured in the same run).

``layer``: Benchmark one MoE layer's forward+backward on a GPU, per grouped-GEMM backend.

Shape (the bench-1gpu model's MoE layer): d_model 2048, 64 experts, top-8, expert
hidden 1024, 16k tokens, bf16 compute with FP32 accumulation. Routings:
- ``balanced``: every expert gets exactly T*k/E rows (tokens shuffled);
- ``real``: the layer's own router (random init) on random inputs;
- ``skewed``: k distinct experts per token drawn from a Zipf(1.0) distribution
  over experts (the busiest expert gets ~8x the mean load).

Measured, per routing and backend (``grouped_mm`` = torch._grouped_mm, ``triton``,
``loop`` = one matmul per expert):
- expert GEMMs: the 3 forward grouped GEMMs (gate, up, down) and their 6 backward
  GEMMs (dX, dW), 18*R*D*F FLOPs, as TFLOP/s, and the forward alone;
- whole layer: router, dispatch, expert GEMMs, SwiGLU, combine, forward+backward,
  as ms and TFLOP/s of the layer's model FLOPs 6*T*(D*E + k*3*D*F).
Compared with torch._grouped_mm in the same run, with a BF16 8192^3 matmul measured
in the same run ("vs ceil"; ``_bench.matmul_ceiling_tflops``, the JSON's
``matmul_ceiling_tflops``) and, as MFU, with the 989 TFLOP/s dense BF16 peak.
``--sweep`` first times each Triton kernel alone (forward, dX, dW shapes) over
tile configurations on balanced routing, next to torch._grouped_mm on the same
GEMM, and runs the benchmark with the fastest configuration of each kernel (the
library's defaults are set from such a sweep). The tables are printed last; the
JSON holds every number.

``gate-up``: The experts' gate and up projections: two grouped GEMMs vs one paired Triton GEMM.

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

``gemms``: How fast can the MoE layer's expert GEMMs be? Grouped kernels against cuBLAS on the same work.

The expert-GEMM target (700 TFLOP/s, balanced routing) is only meaningful next to
what the vendor library reaches on the same arithmetic without the grouping. For
the bench-1gpu MoE layer (d_model 2048, 64 experts, top-8, expert hidden 1024, 16k
tokens: R = 131072 dispatched rows, 2048 per expert when balanced) each of the
layer's six GEMM shapes is timed as:

- ``mm``: one cuBLAS matmul over all R rows (no groups at all: an upper bound for
  the row GEMMs; the weight-gradient GEMMs have no such form, their K is per group);
- ``bmm``: cuBLAS batched matmul over 64 equal groups (perfect balance, one launch);
- ``grouped_mm``: ``torch._grouped_mm`` with the balanced offsets;
- ``triton``: this project's grouped kernels (``moe_model._grouped_mm_launch``).

The layer runs each shape's FLOPs once or twice (gate and up share shapes), so its
expert-GEMM rate is the FLOP-weighted harmonic mean over the nine GEMMs; the table
prints it per implementation, next to a large square matmul measured in the same
run (the matmul ceiling, ``_bench.matmul_ceiling_tflops`` as in the other
benchmarks).

A second table times a weight gradient's way into an FP32 main grad (what every
microbatch of data-parallel training does): a BF16 gradient GEMM followed by
moe_ddp's accumulation pass, against the Triton kernel adding in its epilogue
(``wgrad_accumulate_``, into a flat buffer and into owner-major bucket rows), next to
the same GEMM writing a BF16 dW (what the FP32 add costs on top), and two to four
batches of rows (microbatches) reduced in one launch, one FP32 add for all (per batch).
``--tokens 8192`` gives bench-1gpu's microbatch (65536 rows), where the add's share is
largest.

A third table gives the nine GEMMs as a training step runs them :
the gate/up pair in one Triton launch each way, the down projection through
``torch._grouped_mm``, the weight gradients added to FP32 main grads with ``--merge``
microbatches per launch, and their FLOP-weighted rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _bench import matmul_ceiling_tflops, time_ms
from moe_ddp.accumulate import accumulate_
from moe_model import MoEConfig, MoELayer, grouped_mm, init_weights
from moe_model._grouped_mm_launch import (
    TileConfig,
    default_config,
    rows_mm,
    rows_mm_split2,
    rows_mm_sum2,
    set_default_config,
    wgrad_accumulate_,
    wgrad_mm,
)
from moe_model.experts import GroupedExperts
from moe_model.router import RoutingResult, count_per_expert

PEAK = 989.0  # TFLOP/s, dense bf16 peak used for MFU
BACKENDS = ("grouped_mm", "triton", "loop")


@dataclass
class Shape:
    tokens: int = 16384
    d_model: int = 2048
    experts: int = 64
    top_k: int = 8
    hidden: int = 1024


def routing_ids(kind: str, s: Shape, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """[T, k] expert ids for a forced routing (``balanced`` or ``skewed``)."""
    T, E, k = s.tokens, s.experts, s.top_k
    if kind == "balanced":
        ids = (torch.arange(T)[:, None] * k + torch.arange(k)[None, :]) % E
        return ids[torch.randperm(T, generator=gen)].to(device)
    if kind == "skewed":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
        p = p[torch.randperm(E, generator=gen)]  # the busy experts are not the low ids
        return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen).to(device)
    raise ValueError(kind)


class ForcedRouter(torch.nn.Module):
    """The layer's real router (its cost stays in the measurement) with fixed expert ids."""

    def __init__(self, router: torch.nn.Module, ids_Tk: torch.Tensor) -> None:
        super().__init__()
        self.router, self.ids_Tk = router, ids_Tk

    def forward(self, x_TD: torch.Tensor) -> RoutingResult:
        r = self.router(x_TD)
        return RoutingResult(self.ids_Tk, r.probs.gather(1, self.ids_Tk), count_per_expert(
            self.ids_Tk, r.probs.shape[1]), r.probs, r.z_loss)


def make_layer(s: Shape, backend: str, device: torch.device) -> MoELayer:
    cfg = MoEConfig(vocab_size=256, d_model=s.d_model, n_layers=1, n_heads=16, n_kv_heads=4,
                    head_dim=128, n_experts=s.experts, top_k=s.top_k, expert_hidden=s.hidden,
                    grouped_mm_backend=backend)
    layer = MoELayer(cfg).to(device)
    init_weights(layer, cfg, seed=0)
    return layer.to(torch.bfloat16)


def offsets_of(ids_Tk: torch.Tensor, E: int) -> torch.Tensor:
    return count_per_expert(ids_Tk, E).cumsum(0).to(torch.int32)


def bench_gemms(s: Shape, ids_Tk: torch.Tensor, backend: str, device: torch.device) -> dict:
    """The layer's 9 grouped GEMMs (3 forward + dX, dW of each) on dispatched rows."""
    R, D, F, E = s.tokens * s.top_k, s.d_model, s.hidden, s.experts
    offs = offsets_of(ids_Tk, E)
    gen = torch.Generator(device=device).manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.05).to(torch.bfloat16).requires_grad_()

    x, h = rand(R, D), rand(R, F)
    w1, w3, w2 = rand(E, F, D), rand(E, F, D), rand(E, D, F)
    g1, g3, g2 = rand(R, F).detach(), rand(R, F).detach(), rand(R, D).detach()

    def forward() -> list[torch.Tensor]:
        return [grouped_mm(x, w1.transpose(1, 2), offs, backend),
                grouped_mm(x, w3.transpose(1, 2), offs, backend),
                grouped_mm(h, w2.transpose(1, 2), offs, backend)]

    def forward_backward() -> None:
        torch.autograd.grad(forward(), [x, h, w1, w3, w2], [g1, g3, g2])

    with torch.no_grad():
        fwd_ms = time_ms(forward)
    ms = time_ms(forward_backward)
    flops = 2 * R * D * F
    return {"gemm_ms": ms, "gemm_tflops": 9 * flops / ms / 1e9,
            "gemm_fwd_ms": fwd_ms, "gemm_fwd_tflops": 3 * flops / fwd_ms / 1e9}


def bench_layer(s: Shape, routing: str, backend: str, device: torch.device,
                gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Whole-layer forward+backward; returns the numbers and the expert ids used."""
    layer = make_layer(s, backend, device)
    x = torch.randn(1, s.tokens, s.d_model, device=device, generator=torch.Generator(
        device=device).manual_seed(2)).to(torch.bfloat16).requires_grad_()
    if routing == "real":
        with torch.no_grad():
            ids = layer.router(x.view(-1, s.d_model)).expert_ids
    else:
        ids = routing_ids(routing, s, gen, device)
    layer.router = ForcedRouter(layer.router, ids)
    grad = torch.randn_like(x)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step() -> None:
        torch.autograd.grad(layer(x), [x, *params], grad)

    ms = time_ms(step)
    layer.pop_step_stats()
    flops = 6 * s.tokens * (s.d_model * s.experts + s.top_k * 3 * s.d_model * s.hidden)
    counts = count_per_expert(ids, s.experts).float()
    return {"layer_ms": ms, "layer_tflops": flops / ms / 1e9,
            "max_over_mean_load": (counts.max() / counts.mean()).item()}, ids


def launch_overhead_us(device: torch.device, calls: int = 300) -> dict[str, float]:
    """Host time per call of each backend's forward on a tiny GEMM (GPU time negligible)."""
    import time

    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(8, 256, 256, device=device, dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.arange(32, 257, 32, device=device, dtype=torch.int32)
    calls_by_name = {
        "torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offs),
        "triton (custom op)": lambda: grouped_mm(x, w, offs, "triton"),
        "triton (kernel wrapper)": lambda: rows_mm(x, w, offs),
    }
    out = {}
    with torch.no_grad():
        for name, fn in calls_by_name.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            out[name] = (time.perf_counter() - start) / calls * 1e6
    return out


def run_benchmark(s: Shape, device: torch.device, ceiling: float) -> list[dict]:
    """Every (routing, backend); ``ceiling``: the matmul TFLOP/s measured in this run."""
    rows = []
    for routing in ("balanced", "real", "skewed"):
        for backend in BACKENDS:
            gen = torch.Generator().manual_seed(0)
            layer_numbers, ids = bench_layer(s, routing, backend, device, gen)
            row = {"routing": routing, "backend": backend, **bench_gemms(s, ids, backend, device),
                   **layer_numbers}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    for row in rows:
        base = next(r for r in rows if r["routing"] == row["routing"] and r["backend"] == "grouped_mm")
        row["gemm_vs_grouped_mm"] = row["gemm_tflops"] / base["gemm_tflops"]
        row["gemm_vs_ceiling"] = row["gemm_tflops"] / ceiling
        row["layer_mfu"] = row["layer_tflops"] / PEAK
    return rows


def print_table(rows: list[dict], ceiling: float) -> None:
    print(f"\nMoE layer fwd+bwd, bf16 (ceiling {ceiling:.0f} TFLOP/s: 8192^3 matmul in this run; "
          f"MFU vs {PEAK:.0f})")
    print(f"{'routing':9} {'backend':11} {'max/mean':>8} {'GEMM fwd':>9} {'GEMM f+b':>9} "
          f"{'vs _gmm':>8} {'vs ceil':>8} {'layer ms':>9} {'layer TF':>9} {'MFU':>6}")
    for r in rows:
        print(f"{r['routing']:9} {r['backend']:11} {r['max_over_mean_load']:8.2f} "
              f"{r['gemm_fwd_tflops']:9.1f} {r['gemm_tflops']:9.1f} {r['gemm_vs_grouped_mm']:8.2f} "
              f"{r['gemm_vs_ceiling']:8.2f} {r['layer_ms']:9.2f} {r['layer_tflops']:9.1f} "
              f"{r['layer_mfu']:6.1%}")


SWEEP_CONFIGS = [  # (BM, BN, BK, GROUP_M, warps, stages, persistent, TMA)
    TileConfig(128, 256, 64, 8, 8, 3, True, True),
    TileConfig(128, 256, 64, 8, 8, 4, True, True),
    TileConfig(128, 256, 64, 4, 8, 3, True, True),
    TileConfig(128, 256, 64, 16, 8, 3, True, True),
    TileConfig(128, 256, 64, 8, 8, 3, False, True),
    TileConfig(128, 256, 64, 8, 8, 4, False, True),
    TileConfig(256, 128, 64, 8, 8, 3, True, True),
    TileConfig(128, 128, 64, 8, 4, 4, True, True),
    TileConfig(128, 256, 64, 8, 8, 3, True, False),
    TileConfig(128, 256, 64, 8, 8, 3, False, False),
    TileConfig(128, 256, 64, 4, 8, 3, False, False),
    TileConfig(128, 256, 64, 16, 8, 3, False, False),
    TileConfig(128, 256, 64, 8, 8, 4, False, False),
    TileConfig(256, 128, 64, 8, 8, 3, False, False),
    TileConfig(128, 256, 32, 8, 8, 5, False, False),
]


def run_sweep(s: Shape, device: torch.device) -> list[dict]:
    """Each Triton kernel alone over tile configs, next to torch._grouped_mm (balanced)."""
    R, D, F, E = s.tokens * s.top_k, s.d_model, s.hidden, s.experts
    gen = torch.Generator().manual_seed(0)
    offs = offsets_of(routing_ids("balanced", s, gen, device), E)
    bf = torch.bfloat16
    x, h = torch.randn(R, D, device=device, dtype=bf), torch.randn(R, F, device=device, dtype=bf)
    w_in, w_out = torch.randn(E, F, D, device=device, dtype=bf), torch.randn(E, D, F, device=device, dtype=bf)
    # name -> (triton call taking a config, torch._grouped_mm call, FLOPs, kernel kind)
    cases: dict[str, tuple[Callable, Callable, int, str]] = {
        "fwd x@w1^T": (lambda c: rows_mm(x, w_in.transpose(1, 2), offs, c),
                       lambda: torch._grouped_mm(x, w_in.transpose(1, 2), offs=offs), 2 * R * D * F, "rows"),
        "fwd h@w2^T": (lambda c: rows_mm(h, w_out.transpose(1, 2), offs, c),
                       lambda: torch._grouped_mm(h, w_out.transpose(1, 2), offs=offs), 2 * R * D * F, "rows"),
        "dx dh@w1": (lambda c: rows_mm(h, w_in, offs, c),
                     lambda: torch._grouped_mm(h, w_in, offs=offs), 2 * R * D * F, "rows"),
        "dx dy@w2": (lambda c: rows_mm(x, w_out, offs, c),
                     lambda: torch._grouped_mm(x, w_out, offs=offs), 2 * R * D * F, "rows"),
        "dw1 dh^T x": (lambda c: wgrad_mm(x, h, offs, w_in.transpose(1, 2), c),
                       lambda: torch._grouped_mm(h.t(), x, offs=offs), 2 * R * D * F, "wgrad"),
        "dw2 dy^T h": (lambda c: wgrad_mm(h, x, offs, w_out.transpose(1, 2), c),
                       lambda: torch._grouped_mm(x.t(), h, offs=offs), 2 * R * D * F, "wgrad"),
    }
    results = []
    for name, (triton_call, torch_call, flops, kind) in cases.items():
        try:
            ms = time_ms(torch_call)
            results.append({"gemm": name, "impl": "torch._grouped_mm", "tflops": flops / ms / 1e9})
        except RuntimeError as e:
            results.append({"gemm": name, "impl": "torch._grouped_mm", "error": str(e)[:200]})
        for cfg in SWEEP_CONFIGS:
            if kind == "wgrad" and (cfg.persistent or cfg.use_tma):
                continue
            try:
                ms = time_ms(lambda cfg=cfg, call=triton_call: call(cfg))
                results.append({"gemm": name, "impl": "triton", "kind": kind, **asdict(cfg),
                                "ms": ms, "tflops": flops / ms / 1e9})
            except Exception as e:  # a config that does not compile (resources) is reported, not fatal
                results.append({"gemm": name, "impl": "triton", "kind": kind, **asdict(cfg),
                                "error": str(e)[:200]})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    return results


def best_configs(results: list[dict]) -> dict[str, TileConfig]:
    """Per kernel kind, the config with the least total time over that kind's GEMMs."""
    best = {}
    for kind in ("rows", "wgrad"):
        gemms = {r["gemm"] for r in results if r.get("kind") == kind}
        totals: dict[TileConfig, float] = {}
        for cfg in SWEEP_CONFIGS:
            times = [r["ms"] for r in results if r.get("kind") == kind and "ms" in r
                     and TileConfig(**{f: r[f] for f in asdict(cfg)}) == cfg]
            if len(times) == len(gemms):
                totals[cfg] = sum(times)
        if totals:
            best[kind] = min(totals, key=totals.get)
    return best


def print_sweep(results: list[dict]) -> None:
    print("\nTriton tile sweep (TFLOP/s, balanced routing); best per GEMM vs torch._grouped_mm")
    for name in dict.fromkeys(r["gemm"] for r in results):
        mine = [r for r in results if r["gemm"] == name and r["impl"] == "triton" and "tflops" in r]
        base = next(r for r in results if r["gemm"] == name and r["impl"] != "triton")
        best = max(mine, key=lambda r: r["tflops"]) if mine else None
        cfg = {k: best[k] for k in ("block_m", "block_n", "block_k", "num_warps", "num_stages",
                                    "persistent", "use_tma")} if best else {}
        print(f"{name:12} torch {base.get('tflops', float('nan')):7.1f}  triton best "
              f"{best['tflops'] if best else float('nan'):7.1f}  {cfg}")


def gate_up_rows(routing: str, padding: float, device: torch.device) -> list[dict]:
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


IMPLS = ("mm", "bmm", "grouped_mm", "triton")


def shape_cases(R: int, D: int, F: int, E: int, device: torch.device) -> dict[str, tuple[int, dict[str, Callable]]]:
    """GEMM name -> (how many of the layer's nine GEMMs have this shape, impl -> call)."""
    bf = torch.bfloat16
    Re = R // E
    x, h = torch.randn(R, D, device=device, dtype=bf), torch.randn(R, F, device=device, dtype=bf)
    w_in = torch.randn(E, F, D, device=device, dtype=bf)  # gate / up: [E, out=F, in=D]
    w_out = torch.randn(E, D, F, device=device, dtype=bf)  # down: [E, out=D, in=F]
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * Re

    def rows(a: torch.Tensor, w_EKN: torch.Tensor) -> dict[str, Callable]:
        K, N = w_EKN.shape[1:]
        return {
            "mm": lambda: a @ w_EKN[0],
            "bmm": lambda: torch.bmm(a.view(E, Re, K), w_EKN),
            "grouped_mm": lambda: torch._grouped_mm(a, w_EKN, offs=offs),
            "triton": lambda: rows_mm(a, w_EKN, offs),
        }

    def wgrad(a: torch.Tensor, b: torch.Tensor, like_ENK: torch.Tensor) -> dict[str, Callable]:
        """dW[e] = a_e^T @ b_e (a [R, N], b [R, K]): the reduction runs over each group's rows."""
        N, K = a.shape[1], b.shape[1]
        return {
            "bmm": lambda: torch.bmm(a.view(E, Re, N).transpose(1, 2), b.view(E, Re, K)),
            "grouped_mm": lambda: torch._grouped_mm(a.t(), b, offs=offs),
            "triton": lambda: wgrad_mm(b, a, offs, like_ENK),
        }

    return {
        "fwd gate/up x@w1^T (2048 -> 1024)": (2, rows(x, w_in.transpose(1, 2))),
        "fwd down h@w2^T (1024 -> 2048)": (1, rows(h, w_out.transpose(1, 2))),
        "dx gate/up dh@w1 (1024 -> 2048)": (2, rows(h, w_in)),
        "dx down dy@w2 (2048 -> 1024)": (1, rows(x, w_out)),
        "dw gate/up dh^T x": (2, wgrad(h, x, w_in.transpose(1, 2))),
        "dw down dy^T h": (1, wgrad(x, h, w_out.transpose(1, 2))),
    }


def into_main_grad(R: int, D: int, F: int, E: int, device: torch.device) -> dict[str, float]:
    """ms to add dW1 = dh^T x (per group) to an FP32 main grad, each way."""
    bf = torch.bfloat16
    x, h = torch.randn(R, D, device=device, dtype=bf), torch.randn(R, F, device=device, dtype=bf)
    like = torch.empty(E, F, D, device=device, dtype=bf).transpose(1, 2)
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (R // E)
    main = torch.zeros(E * F * D, device=device)
    # an owner-major bucket of two owners: [2, piece] rows inside a wider buffer
    bucket = torch.zeros(2, E * F * D // 2 + 64, device=device)[:, : E * F * D // 2]
    return {
        "Triton BF16 dW alone (the GEMM without any FP32 add)": time_ms(
            lambda: wgrad_mm(x, h, offs, like), iters=20),
        "torch._grouped_mm BF16 dW, then accumulate_": time_ms(
            lambda: accumulate_(main, torch._grouped_mm(h.t(), x, offs=offs)), iters=20),
        "Triton BF16 dW, then accumulate_": time_ms(
            lambda: accumulate_(main, wgrad_mm(x, h, offs, like).transpose(1, 2)), iters=20),
        "accumulate_ alone": time_ms(lambda: accumulate_(main, like.transpose(1, 2)), iters=20),
        "Triton dW added in the epilogue": time_ms(
            lambda: wgrad_accumulate_(main, x, h, offs, like), iters=20),
        "the same into owner-major bucket rows": time_ms(
            lambda: wgrad_accumulate_(bucket, x, h, offs, like), iters=20),
        **{f"the same, {n} batches of rows in one launch (per batch)": merged_ms(n, x, h, offs, like, main)
           for n in (2, 3, 4)},
    }


def merged_ms(n: int, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, like: torch.Tensor,
              main: torch.Tensor) -> float:
    """ms per batch when ``n`` batches of rows (microbatches, separate tensors) add ``a_g^T @
    b_g`` to the FP32 main grad in one launch (``parallel.merge_expert_grad_microbatches=n``)."""
    more = [(torch.randn_like(a), torch.randn_like(b), offs) for _ in range(n - 1)]
    return time_ms(lambda: wgrad_accumulate_(main, a, b, offs, like, more=more), iters=20) / n


def as_the_step_runs(R: int, D: int, F: int, E: int, merge: int, device: torch.device) -> dict[str, tuple[int, float]]:
    """GEMM -> (how many of the nine it is, ms) with the kernels a training step on CUDA
    runs (``GroupedExperts`` with backend ``auto`` and the gradient sink): the gate/up
    projections as one paired Triton launch each way, the down projection through
    ``torch._grouped_mm``, and the three weight gradients added to FP32 main grads with
    ``merge`` microbatches per launch (ms per microbatch)."""
    bf = torch.bfloat16
    x, dy = torch.randn(R, D, device=device, dtype=bf), torch.randn(R, D, device=device, dtype=bf)
    h, dg = torch.randn(R, F, device=device, dtype=bf), torch.randn(R, F, device=device, dtype=bf)
    w1, w3 = (torch.randn(E, F, D, device=device, dtype=bf) for _ in range(2))  # [E, out=F, in=D]
    w2 = torch.randn(E, D, F, device=device, dtype=bf)  # [E, out=D, in=F]
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * (R // E)
    main_in, main_out = torch.zeros(E * F * D, device=device), torch.zeros(E * D * F, device=device)
    return {
        "gate/up forward (paired Triton)": (2, time_ms(
            lambda: rows_mm_split2(x, w1.transpose(1, 2), w3.transpose(1, 2), offs), iters=20)),
        "down forward (torch._grouped_mm)": (1, time_ms(
            lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), iters=20)),
        "gate/up input gradient (paired Triton, one reduction)": (2, time_ms(
            lambda: rows_mm_sum2(dg, w1, h, w3, offs), iters=20)),
        "down input gradient (torch._grouped_mm)": (1, time_ms(
            lambda: torch._grouped_mm(dy, w2, offs=offs), iters=20)),
        # two launches of the same shape (gate and up), each into its own main grad
        f"gate and up weight gradients into FP32, {merge} per launch": (2, 2 * merged_ms(
            merge, x, dg, offs, w1.transpose(1, 2), main_in)),
        f"down weight gradient into FP32, {merge} per launch": (1, merged_ms(
            merge, h, dy, offs, w2.transpose(1, 2), main_out)),
    }


def run_layer(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        sys.exit("the layer benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    shape = Shape(tokens=args.tokens)
    meta = {"shape": asdict(shape), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    out: dict = dict(meta)
    if args.sweep:
        out["sweep"] = run_sweep(shape, device)
        for kind, cfg in best_configs(out["sweep"]).items():
            set_default_config(kind, cfg)
    out["configs"] = {kind: asdict(default_config(kind, device)) for kind in ("rows", "wgrad")}
    out["launch_overhead_us"] = launch_overhead_us(device)
    out["matmul_ceiling_tflops"] = matmul_ceiling_tflops(device)
    out["results"] = run_benchmark(shape, device, out["matmul_ceiling_tflops"])
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.sweep:
        print_sweep(out["sweep"])
        print(f"benchmark configs: {out['configs']}")
    print("host time per forward call, tiny GEMM (us): "
          + ", ".join(f"{k} {v:.0f}" for k, v in out["launch_overhead_us"].items()))
    print_table(out["results"], out["matmul_ceiling_tflops"])



def run_gate_up(a: argparse.Namespace) -> None:
    device = torch.device("cuda")
    rows = [r for routing in a.routing for pad in a.padding for r in gate_up_rows(routing, pad, device)]
    if a.out is not None:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=2))
    print(f"{'routing':9s} {'pad':>4s} {'what':22s} {'impl':32s} {'ms':>8s} {'TFLOP/s':>8s}")
    for r in rows:
        tf = f"{r['tflops']:.0f}" if r["tflops"] else "-"
        print(f"{r['routing']:9s} {r['padding']:4.1f} {r['what']:22s} {r['impl']:32s} {r['ms']:8.3f} {tf:>8s}")



def run_gemms(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    R, D, F, E = args.tokens * args.top_k, args.d_model, args.hidden, args.experts
    if R % E:
        raise SystemExit(f"--tokens * --top-k ({R}) must split evenly over --experts ({E})")
    flops = 2 * R * D * F  # every one of the nine GEMMs

    ceiling = matmul_ceiling_tflops(device)
    results: list[dict] = []
    for name, (count, calls) in shape_cases(R, D, F, E, device).items():
        for impl, call in calls.items():
            ms = time_ms(call, iters=20)
            results.append({"gemm": name, "count": count, "impl": impl, "ms": ms, "tflops": flops / ms / 1e9})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)

    main_grad = into_main_grad(R, D, F, E, device)
    step = as_the_step_runs(R, D, F, E, args.merge, device)
    step_rate = 9 * flops / sum(ms for _, ms in step.values()) / 1e9
    by = {(r["gemm"], r["impl"]): r for r in results}
    gemms = dict.fromkeys(r["gemm"] for r in results)

    def layer_rate(ms_of: Callable[[str], float]) -> float:
        """The nine GEMMs' TFLOP/s when GEMM ``g`` takes ``ms_of(g)`` each time it runs."""
        return 9 * flops / sum(by[g, "bmm"]["count"] * ms_of(g) for g in gemms) / 1e9

    # mm has no weight-gradient form: its layer figure borrows bmm's for those GEMMs.
    layer = {impl: layer_rate(lambda g, impl=impl: (by.get((g, impl)) or by[g, "bmm"])["ms"])
             for impl in IMPLS}
    layer["best grouped per GEMM"] = layer_rate(
        lambda g: min(by[g, "grouped_mm"]["ms"], by[g, "triton"]["ms"]))

    Path(args.out).write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "rows": R, "experts": E, "d_model": D, "hidden": F,
        "matmul_8192_tflops": ceiling, "gemms": results, "layer_tflops": layer,
        "into_main_grad_ms": main_grad,
        "as_the_step_runs": {"merge": args.merge, "ms": {k: ms for k, (_, ms) in step.items()},
                             "nine_gemms_tflops": step_rate},
    }, indent=1))
    print(f"\nTFLOP/s, {R} rows over {E} balanced groups; 8192^3 matmul in this run: {ceiling:.0f}")
    print(f"| GEMM (x in layer) | {' | '.join(IMPLS)} |")
    print(f"|---|{'---|' * len(IMPLS)}")
    for name in dict.fromkeys(r["gemm"] for r in results):
        cells = {r["impl"]: f"{r['tflops']:.0f}" for r in results if r["gemm"] == name}
        count = next(r["count"] for r in results if r["gemm"] == name)
        print(f"| {name} (x{count}) | {' | '.join(cells.get(i, '-') for i in IMPLS)} |")
    print("| nine GEMMs of the layer | " + " | ".join(f"{layer[i]:.0f}" for i in IMPLS) + " |")
    print(f"fastest grouped kernel per GEMM: {layer['best grouped per GEMM']:.0f}")
    print("\nms for one [E, F, D] weight gradient into an FP32 main grad (TFLOP/s of its GEMM)")
    print("| path | ms | TFLOP/s |\n|---|---|---|")
    for name, ms in main_grad.items():
        rate = "-" if name.startswith("accumulate_") else f"{flops / ms / 1e9:.0f}"
        print(f"| {name} | {ms:.3f} | {rate} |")
    print(f"\nThe nine GEMMs with the kernels a training step runs (weight gradients into FP32, "
          f"{args.merge} microbatches per launch; ms per microbatch)")
    print("| GEMM | of the nine | ms | TFLOP/s |\n|---|---|---|---|")
    for name, (count, ms) in step.items():
        print(f"| {name} | {count} | {ms:.3f} | {count * flops / ms / 1e9:.0f} |")
    print(f"| nine GEMMs, FLOP-weighted | 9 | {sum(ms for _, ms in step.values()):.3f} | {step_rate:.0f} |")



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    subs = parser.add_subparsers(dest="command", required=True)
    sp = subs.add_parser("layer", help="one MoE layer per grouped-GEMM backend; --sweep: Triton tiles")
    sp.add_argument("--out", required=True, help="JSON output path")
    sp.add_argument("--sweep", action="store_true",
                        help="first sweep Triton tile configs and benchmark with the fastest")
    sp.add_argument("--tokens", type=int, default=Shape.tokens)
    sp.set_defaults(run=run_layer)
    sp = subs.add_parser("gate-up", help="gate and up: two grouped GEMMs vs one paired Triton GEMM")
    sp.add_argument("--routing", nargs="+", default=["balanced", "skewed"])
    sp.add_argument("--padding", nargs="+", type=float, default=[1.0, 2.0])
    sp.add_argument("--out", type=Path, default=None)
    sp.set_defaults(run=run_gate_up)
    sp = subs.add_parser("gemms", help="the nine GEMMs against cuBLAS, into FP32, as the step runs them")
    sp.add_argument("--out", required=True, help="JSON output path")
    sp.add_argument("--tokens", type=int, default=16384)
    sp.add_argument("--experts", type=int, default=64)
    sp.add_argument("--top-k", type=int, default=8)
    sp.add_argument("--d-model", type=int, default=2048)
    sp.add_argument("--hidden", type=int, default=1024)
    sp.add_argument("--merge", type=int, default=4,
                        help="microbatches per weight-gradient launch in the as-the-step-runs table")
    sp.set_defaults(run=run_gemms)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
