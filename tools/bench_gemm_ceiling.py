"""How fast can the MoE layer's expert GEMMs be? Grouped kernels against cuBLAS on the same work.

    tools/from_source.sh python3 tools/bench_gemm_ceiling.py --out $OUT/gemm_ceiling.json

The expert-GEMM target (700 TFLOP/s, balanced routing) is only meaningful next to
what the vendor library reaches on the same arithmetic without the grouping. For
the bench-1gpu MoE layer (d_model 2048, 64 experts, top-8, expert hidden 1024, 16k
tokens: R = 131072 dispatched rows, 2048 per expert when balanced) each of the
layer's six GEMM shapes is timed as:

- ``mm``: one cuBLAS matmul over all R rows (no groups at all: an upper bound for
  the row GEMMs; the weight-gradient GEMMs have no such form, their K is per group);
- ``bmm``: cuBLAS batched matmul over 64 equal groups (perfect balance, one launch);
- ``grouped_mm``: ``torch._grouped_mm`` with the balanced offsets;
- ``triton``: this project's grouped kernels (``moe_model.triton_grouped_mm``).

The layer runs each shape's FLOPs once or twice (gate and up share shapes), so its
expert-GEMM rate is the FLOP-weighted harmonic mean over the nine GEMMs; the table
prints it per implementation, next to a large square matmul measured in the same
run (the matmul ceiling, ``bench_train_step.matmul_ceiling_tflops`` as in the other
benchmarks).

A second table times a weight gradient's way into an FP32 main grad (what every
microbatch of data-parallel training does): a BF16 gradient GEMM followed by
moe_ddp's accumulation pass, against the Triton kernel adding in its epilogue
(``wgrad_accumulate_``, into a flat buffer and into owner-major bucket rows), next to
the same GEMM writing a BF16 dW (what the FP32 add costs on top), and two to four
batches of rows (microbatches) reduced in one launch, one FP32 add for all (per batch).
``--tokens 8192`` gives bench-1gpu's microbatch (65536 rows), where the add's share is
largest.

A third table gives the nine GEMMs as a training step runs them (the issue's figure):
the gate/up pair in one Triton launch each way, the down projection through
``torch._grouped_mm``, the weight gradients added to FP32 main grads with ``--merge``
microbatches per launch, and their FLOP-weighted rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_moe_layer import time_ms  # noqa: E402
from bench_train_step import matmul_ceiling_tflops  # noqa: E402
from moe_ddp.accumulate import accumulate_  # noqa: E402
from moe_model.triton_grouped_mm import (  # noqa: E402
    rows_mm,
    rows_mm_split2,
    rows_mm_sum2,
    wgrad_accumulate_,
    wgrad_mm,
)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--merge", type=int, default=4,
                        help="microbatches per weight-gradient launch in the as-the-step-runs table")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
