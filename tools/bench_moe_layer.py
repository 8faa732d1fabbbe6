"""Benchmark one MoE layer's forward+backward on a GPU, per grouped-GEMM backend.

    tools/from_source.sh python3 tools/bench_moe_layer.py --out $OUT/bench_moe_layer.json
    tools/from_source.sh python3 tools/bench_moe_layer.py --sweep --out $OUT/sweep.json

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
in the same run ("vs ceil"; ``bench_train_step.matmul_ceiling_tflops``, the JSON's
``matmul_ceiling_tflops``) and, as MFU, with the 989 TFLOP/s dense BF16 peak.
``--sweep`` first times each Triton kernel alone (forward, dX, dW shapes) over
tile configurations on balanced routing, next to torch._grouped_mm on the same
GEMM, and runs the benchmark with the fastest configuration of each kernel (the
library's defaults are set from such a sweep). The tables are printed last; the
JSON holds every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from bench_train_step import matmul_ceiling_tflops
from moe_model import MoEConfig, MoELayer, grouped_mm, init_weights
from moe_model.router import RoutingResult, count_per_expert
from moe_model.triton_grouped_mm import (
    TileConfig,
    default_config,
    rows_mm,
    set_default_config,
    wgrad_mm,
)

PEAK = 989.0  # TFLOP/s, dense bf16 peak used for MFU
BACKENDS = ("grouped_mm", "triton", "loop")


@dataclass
class Shape:
    tokens: int = 16384
    d_model: int = 2048
    experts: int = 64
    top_k: int = 8
    hidden: int = 1024


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 10, reps: int = 5) -> float:
    """Median over ``reps`` of the mean time of ``iters`` back-to-back calls (CUDA events)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--sweep", action="store_true",
                        help="first sweep Triton tile configs and benchmark with the fastest")
    parser.add_argument("--tokens", type=int, default=Shape.tokens)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_layer needs a CUDA GPU")
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


if __name__ == "__main__":
    main()
