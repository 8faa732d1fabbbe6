"""Benchmark moe_mxfp8 on one GPU: quantize kernels vs a device copy, MXFP8 experts vs BF16.

    tools/from_source.sh python3 tools/bench_mxfp8.py --out $OUT/bench_mxfp8.json

1. Kernels on [tokens * top_k, d_model] BF16 (the dispatched expert rows): a device
   copy measured in the same run is the ceiling; each kernel's bandwidth counts the
   bytes it must read and write. Row = blocks along the contiguous dim (activations,
   the codec), column = blocks along dim 0 (weight caches' input-gradient copy),
   both = the weight-cache kernel (one read, two outputs).
2. Expert layer (d_model 2048, 64 experts, top-8, hidden 1024, 16k tokens, random
   routing): moe_model.GroupedExperts in BF16 vs MXFP8GroupedExperts (Hopper:
   exact emulation, i.e. quantize + dequantize + the same BF16 grouped GEMMs), with
   BF16 compute weights in both; forward and forward+backward (the input and weight
   gradients returned by ``torch.autograd.grad``: nothing is added into an existing
   ``.grad``, which the training step does not do either, its expert weight
   gradients going to a gradient sink).
Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import json

import torch
from _bench import time_ms
from moe_mxfp8 import (
    MXFP8GroupedExperts,
    MXFP8RowCodec,
    dequantize,
    quantize,
    quantize_dequantize,
    quantize_rows_and_cols,
)
from moe_testing import saved_tensor_bytes

COPY_CEILING = 4.2e12  # H200 device copy, bytes/s (read + write)
BF16_PEAK = 989e12  # H200 dense BF16, FLOP/s


def cuda_time(fn, reps: int = 10, trials: int = 7) -> float:
    """Median seconds per call over ``trials`` batches of ``reps`` back-to-back calls."""
    return time_ms(fn, warmup=1, iters=reps, reps=trials) / 1e3


def bench_kernels(rows: int, d: int) -> dict:
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    out = torch.empty_like(x)
    mx_bytes = n + n // 32  # E4M3 data + E8M0 scales
    data, scales = quantize(x)
    col_data, col_scales = quantize(x, axis=0)
    cases = {
        "device copy (ceiling)": (lambda: out.copy_(x), 2 * n * 2),
        "quantize rows": (lambda: quantize(x), 2 * n + mx_bytes),
        "quantize columns": (lambda: quantize(x, axis=0), 2 * n + mx_bytes),
        "quantize both (weight cache)": (lambda: quantize_rows_and_cols(x), 2 * n + 2 * mx_bytes),
        "quantize+dequantize rows (GEMM operand)": (
            lambda: quantize_dequantize(x, torch.bfloat16), 2 * n + 2 * n),
        "dequantize rows": (lambda: dequantize(data, scales), mx_bytes + 2 * n),
        "dequantize columns": (lambda: dequantize(col_data, col_scales, axis=0), mx_bytes + 2 * n),
    }
    results = {}
    for name, (fn, nbytes) in cases.items():
        seconds = cuda_time(fn)
        results[name] = {"ms": seconds * 1e3, "bytes": nbytes, "tb_per_s": nbytes / seconds / 1e12}
    copy = results["device copy (ceiling)"]["tb_per_s"]
    for r in results.values():
        r["fraction_of_copy"] = r["tb_per_s"] / copy
    return results


# Tile(size, warps, steps, stages) candidates per kernel kind of moe_mxfp8._quantize_kernels (its
# _TILES table; see Tile): the current default first, the pre-rewrite shapes ((128, 4)
# rows, (128, 1) columns, (128, 2) both), and neighbours in each knob.
TILE_CANDIDATES = {
    "rows": [(32, 1, 8, 2), (128, 4, 1, 1), (128, 4, 4, 1), (128, 4, 4, 2), (256, 4, 4, 1),
             (64, 2, 8, 2), (32, 1, 4, 1), (64, 1, 8, 2)],
    "cols": [(64, 1, 8, 3), (64, 1, 1, 1), (64, 1, 4, 1), (64, 1, 8, 1), (64, 1, 4, 2),
             (128, 1, 1, 1), (32, 1, 8, 1), (128, 2, 4, 1)],
    "both": [(64, 1, 1, 1), (64, 1, 4, 1), (64, 1, 8, 2), (32, 1, 4, 1), (128, 2, 1, 1),
             (128, 2, 4, 1), (64, 2, 4, 1), (64, 1, 2, 2)],
    "qdq": [(32, 1, 4, 1), (128, 4, 1, 1), (128, 4, 4, 1), (64, 1, 8, 2), (64, 2, 4, 1)],
    "dequant_rows": [(32, 1, 4, 1), (128, 4, 1, 1), (64, 1, 8, 2), (128, 4, 4, 1)],
    "dequant_cols": [(128, 1, 1, 1), (64, 1, 4, 1), (128, 1, 4, 1), (256, 2, 1, 1)],
}


def _mismatches(got, ref) -> int:
    """Differing elements of two (data, scales) results; NaN data equal to NaN."""
    total = 0
    for g, r in zip(got, ref, strict=True):
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[g.element_size()]
        both_nan = g.float().isnan() & r.float().isnan()
        total += int(((g.view(as_int) != r.view(as_int)) & ~both_nan).sum())
    return total


def sweep_tiles(rows: int, d: int) -> dict:
    """Bandwidth of each kernel kind under each Tile candidate, in the same run, so the
    table in moe_mxfp8._quantize_kernels can be set from measurements. Each candidate is first
    checked bit-exact against the torch reference on the first 4096 rows; one that
    fails to compile or to match is reported with the reason, not timed."""
    from moe_mxfp8 import _quantize_kernels

    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    mx_bytes = n + n // 32
    head = x[:4096]

    def flat(pair_or_pairs):
        if isinstance(pair_or_pairs[0], torch.Tensor):
            return list(pair_or_pairs)
        return [t for m in pair_or_pairs for t in (m.data, m.scales)]

    row_q, col_q = quantize(x), quantize(x, axis=0)  # dequantize inputs (default tiles)

    def dequant(pair, axis):
        # The first 4096 rows of the quantized pair are those of the first 4096 of x.
        def fn(t, backend="auto"):
            rows_ = t.shape[0]
            data = pair[0][:rows_]
            scales = pair[1][:rows_] if axis == 1 else pair[1][: -(-rows_ // 32)]
            return (dequantize(data, scales, axis, backend=backend),)
        return fn

    work = {
        "rows": (lambda t, backend="auto": quantize(t, backend=backend), 2 * n + mx_bytes),
        "cols": (lambda t, backend="auto": quantize(t, axis=0, backend=backend), 2 * n + mx_bytes),
        "both": (lambda t, backend="auto": quantize_rows_and_cols(t, backend=backend),
                 2 * n + 2 * mx_bytes),
        "qdq": (lambda t, backend="auto": quantize_dequantize(t, torch.bfloat16,
                                                              backend=backend)[:1], 4 * n),
        "dequant_rows": (dequant(row_q, 1), mx_bytes + 2 * n),
        "dequant_cols": (dequant(col_q, 0), mx_bytes + 2 * n),
    }
    out = torch.empty_like(x)
    copy = 4 * n / cuda_time(lambda: out.copy_(x))
    default = dict(_quantize_kernels._TILES)
    results = {"copy_tb_per_s": copy / 1e12}
    try:
        for kind, candidates in TILE_CANDIDATES.items():
            fn, nbytes = work[kind]
            ref = flat(fn(head, "reference"))
            for cand in candidates:
                tile = _quantize_kernels.Tile(*cand)
                name = (f"{kind} tile={tile.size} warps={tile.warps} steps={tile.steps} "
                        f"stages={tile.stages}")
                entry = {"tile": list(cand), "default": tile == default[kind]}
                _quantize_kernels._TILES[kind] = tile  # what the launchers read at every call
                try:
                    bad = _mismatches(flat(fn(head)), ref)
                    if bad:
                        entry["error"] = f"{bad} elements differ from the torch reference"
                    else:
                        rate = nbytes / cuda_time(lambda fn=fn: fn(x))
                        entry.update(tb_per_s=rate / 1e12, fraction_of_copy=rate / copy)
                except Exception as e:  # noqa: BLE001 - a candidate that fails is reported
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                results[name] = entry
            _quantize_kernels._TILES[kind] = default[kind]
    finally:
        _quantize_kernels._TILES.update(default)
    return results


def routed_offsets(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """Group ends of random top-k routing (uniform expert choice per token)."""
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices
    counts = torch.zeros(experts, dtype=torch.int64, device="cuda")
    counts.scatter_add_(0, ids.reshape(-1), torch.ones(tokens * top_k, dtype=torch.int64, device="cuda"))
    return counts.cumsum(0).to(torch.int32)


def bench_experts(tokens: int, d: int, experts: int, top_k: int, hidden: int) -> dict:
    from moe_model import GroupedExperts  # the model's own BF16 layer

    torch.manual_seed(0)
    bf16 = GroupedExperts(experts, d, hidden, backend="grouped_mm").cuda()
    for p in bf16.parameters():
        torch.nn.init.normal_(p, std=0.02)
    bf16 = bf16.to(torch.bfloat16)  # compute weights in BF16, as the optimizer rebuilds them
    offsets = routed_offsets(tokens, experts, top_k)
    rows = torch.randn(tokens * top_k, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(rows)
    flops_fwd = 2 * rows.shape[0] * d * hidden * 3
    layers = {
        "bf16 (moe_model.GroupedExperts)": bf16,
        "mxfp8 emulated": MXFP8GroupedExperts.from_module(bf16),
        "mxfp8 emulated, MXFP8 saved activations": MXFP8GroupedExperts.from_module(bf16, True),
    }
    results = {}
    for name, layer in layers.items():
        fwd = cuda_time(lambda layer=layer: layer(rows, offsets), reps=3, trials=5)
        step = cuda_time(lambda layer=layer: torch.autograd.grad(
            layer(rows, offsets), [rows, *layer.parameters()], grad), reps=3, trials=5)
        results[name] = {
            "forward_ms": fwd * 1e3,
            "fwd_bwd_ms": step * 1e3,
            "fwd_bwd_tflops": 3 * flops_fwd / step / 1e12,
            "saved_activation_gib": saved_tensor_bytes(lambda layer=layer: layer(rows, offsets)) / 2**30,
        }
    base = results["bf16 (moe_model.GroupedExperts)"]
    for r in results.values():
        r["fwd_bwd_vs_bf16"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    mx = layers["mxfp8 emulated"]
    results["weight_cache_gib"] = (mx.w13_cache.nbytes + mx.w2_cache.nbytes) / 2**30
    results["weight_cache_refresh_ms"] = cuda_time(mx.refresh_weight_cache, reps=3, trials=5) * 1e3
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_mxfp8.json")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tile-sweep", action="store_true",
                    help="also measure every Tile candidate of the quantize kernels")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mxfp8 needs a CUDA GPU")
    kernels = bench_kernels(args.tokens * args.top_k, args.d_model)
    tiles = sweep_tiles(args.tokens * args.top_k, args.d_model) if args.tile_sweep else None
    layer = bench_experts(args.tokens, args.d_model, args.experts, args.top_k, args.hidden)
    codec = MXFP8RowCodec()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": vars(args),
        "kernels": kernels,
        "tile_sweep": tiles,
        "experts": layer,
        "codec": {"bytes_per_row": codec.packed_width(args.d_model),
                  "bf16_bytes_per_row": 2 * args.d_model,
                  "ratio_vs_bf16": codec.bytes_ratio(args.d_model)},
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"\n{report['device']}, torch {torch.__version__}; rows [{args.tokens * args.top_k}, "
          f"{args.d_model}] BF16")
    print(f"{'kernel':42s} {'ms':>8s} {'TB/s':>7s} {'of copy':>8s}")
    for name, r in kernels.items():
        print(f"{name:42s} {r['ms']:8.3f} {r['tb_per_s']:7.2f} {r['fraction_of_copy']:8.0%}")
    print(f"(copy ceiling of the design brief: {COPY_CEILING / 1e12:.1f} TB/s)")
    if tiles is not None:
        print(f"\n{'tile sweep':42s} {'TB/s':>7s} {'of copy':>8s}")
        for name, r in tiles.items():
            if isinstance(r, dict):
                mark = "  (current)" if r["default"] else ""
                if "error" in r:
                    print(f"{name:42s} FAILED: {r['error']}{mark}")
                else:
                    print(f"{name:42s} {r['tb_per_s']:7.2f} {r['fraction_of_copy']:8.0%}{mark}")
        best = {}
        for name, r in tiles.items():
            if isinstance(r, dict) and "error" not in r:
                kind = name.split()[0]
                if kind not in best or r["tb_per_s"] > best[kind][1]["tb_per_s"]:
                    best[kind] = (name, r)
        for kind, (_, r) in best.items():
            print(f"best {kind}: Tile{tuple(r['tile'])} ({r['fraction_of_copy']:.0%} of copy)")
    print(f"\nexperts: d_model {args.d_model}, {args.experts} experts, top-{args.top_k}, "
          f"hidden {args.hidden}, {args.tokens} tokens")
    print(f"{'layer':42s} {'fwd ms':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} {'vs bf16':>8s} {'saved GiB':>10s}")
    for name, r in layer.items():
        if isinstance(r, dict):
            print(f"{name:42s} {r['forward_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} "
                  f"{r['fwd_bwd_tflops']:8.0f} {r['fwd_bwd_vs_bf16']:8.2f} "
                  f"{r['saved_activation_gib']:10.3f}")
    print(f"weight caches {layer['weight_cache_gib']:.3f} GiB, refresh "
          f"{layer['weight_cache_refresh_ms']:.2f} ms; codec {codec.packed_width(args.d_model)} "
          f"bytes/row = {codec.bytes_ratio(args.d_model):.1%} of BF16")
    print(f"(MFU reference: {BF16_PEAK / 1e12:.0f} TFLOP/s dense BF16)")


if __name__ == "__main__":
    main()
