"""Launch shapes of the local dispatcher's row kernels, timed at bench-1gpu's layer shapes.

    # one GPU: 8192 tokens, top-8 (65,536 rows), D 2048, BF16
    tools/from_source.sh python3 tools/sweep_dispatch_kernels.py --out $OUT/sweep_dispatch_kernels.json

For each ``LaunchShape`` (widest D block, tile elements, warps) of a grid it times four
moe_model kernels: the gather that also writes the rows' rowwise E4M3 codes
(``_gather_kernels.gather_rows_encoded``, the FP8 experts' input), the combine's weighted
sum (``gather_sum``: the combine's forward and the gather's backward), and the combine's
backward without and with the codes of the rows' gradient (``backward``,
``backward_codes``). The codes use ``moe_mxfp8.row_codes.RowCodes`` with power-of-two
scales (the ``fp8_rowwise_gw_hp`` recipe's). Every run is checked: rows bit for bit
against the default shape's, codes bit for bit against ``quantize_fp8`` of the rows the
run wrote, and the routing weights' gradient (FP32 dot products whose summation order
follows the shape) within the FP32 summation bound of an FP64 reference (``dw/bound`` at
most 1). TB/s counts the bytes that must move (rows read and written, the token-side
tensor read once, codes and scales written); the device copy of the ``[R, D]`` rows,
measured in the same run, is the ceiling. The baselines, also measured: the gather the
dispatcher runs without codes (``index_select``), and the passes the codes replace: that
gather or the combine's backward, each then ``quantize_fp8``. The defaults
(``_combine_kernels.default_launch``, ``_gather_kernels.GPU_LAUNCH``) are marked; a short
table is printed and ``--out`` gets the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from _bench import time_ms

GRIDS = {
    "gather_codes": list(itertools.product((512, 1024, 2048), (2048, 4096, 8192), (4, 8))),
    "gather_sum": list(itertools.product((128, 256, 512), (1024, 2048, 4096), (4, 8))),
    "backward": list(itertools.product((128, 256, 512), (2048, 4096, 8192), (4, 8))),
    "backward_codes": list(itertools.product((128, 256, 512), (2048, 4096, 8192), (4, 8))),
}


def dw_text(result: dict) -> str:
    """The weights' gradient's largest error over its bound, for kernels that write one."""
    return f"{result['dw_err']:.3f}" if "dw_err" in result else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per microbatch (bench-1gpu: 8192)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token (bench-1gpu: 8)")
    ap.add_argument("--d-model", type=int, default=2048, help="row width (bench-1gpu: 2048)")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_dispatch_kernels.py times GPU kernels: no CUDA device")

    from moe_model._combine_kernels import (
        LaunchShape,
        combine_backward,
        default_launch,
        weighted_gather_sum,
    )
    from moe_model._gather_kernels import GPU_LAUNCH, gather_rows_encoded
    from moe_mxfp8 import quantize_fp8
    from moe_mxfp8.row_codes import RowCodes

    device = torch.device("cuda")
    T, k, D = args.tokens, args.top_k, args.d_model
    R = T * k
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, D, device=device, generator=g).bfloat16()
    dy = torch.randn(T, D, device=device, generator=g).bfloat16()
    rows_out = torch.randn(R, D, device=device, generator=g).bfloat16()
    row_of_slot = torch.randperm(R, device=device, generator=g)
    token_of_row = torch.empty_like(row_of_slot)
    token_of_row[row_of_slot] = torch.arange(R, device=device) // k  # dropless: every row one slot's
    w = torch.rand(R, device=device, generator=g)
    encoder = RowCodes(True)
    copy_out = torch.empty_like(rows_out)
    copy_ms = time_ms(lambda: copy_out.copy_(rows_out))
    copy_tbs = 4 * R * D / copy_ms / 1e9

    def codes_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = quantize_fp8(rows, (1, 0), True)
        return q.data.view(torch.uint8), q.scale

    runs: dict[str, Callable[[LaunchShape | None], tuple]] = {
        "gather_codes": lambda s: gather_rows_encoded(x, token_of_row, None, encoder, launch=s),
        "gather_sum": lambda s: (weighted_gather_sum(rows_out, row_of_slot, T, w, launch=s),),
        "backward": lambda s: combine_backward(dy, rows_out, row_of_slot, w, None, R, launch=s),
        "backward_codes": lambda s: combine_backward(dy, rows_out, row_of_slot, w, None, R, encoder=encoder,
                                                     launch=s),
    }
    defaults = {"gather_codes": GPU_LAUNCH, **{kind: default_launch(kind) for kind in
                                                   ("gather_sum", "backward", "backward_codes")}}
    moved = {"gather_codes": 5 * R * D + 4 * R, "gather_sum": 2 * R * D + 2 * T * D + 4 * R,
             "backward": 4 * R * D + 2 * T * D + 8 * R, "backward_codes": 5 * R * D + 2 * T * D + 12 * R}
    # What every shape must reproduce: the default's rows and gradient rows bit for bit,
    # codes equal to quantize_fp8's of the rows the run wrote, and the routing weights'
    # gradient (FP32 dot products over D, summed in the block's order) within the FP32
    # summation bound (D - 1) * 2^-24 * sum |x * g| of the FP64 dot product: any summation
    # order meets it, a wrong or missing term does not.
    reference = {kind: run(None) for kind, run in runs.items()}
    expected_rows = x.index_select(0, token_of_row)
    products = rows_out.index_select(0, row_of_slot).double().view(T, k, D) * dy.double()[:, None, :]
    dw_exact = products.sum(-1)
    dw_bound = (D - 1) * 2.0 ** -24 * products.abs().sum(-1)
    del products

    def check(kind: str, out: tuple) -> dict[str, bool | float]:
        """``exact``: rows (and codes) bit for bit; ``dw_err``: the weights' gradient's
        largest error as a fraction of its bound (at most 1 where ``exact``)."""
        if kind == "gather_codes":
            rows, codes, scales = out
            want = codes_of(rows)
            return {"exact": bool(torch.equal(rows, expected_rows) and torch.equal(codes, want[0])
                                  and torch.equal(scales, want[1]))}
        ok = torch.equal(out[0], reference[kind][0])
        if kind == "backward_codes":
            want = codes_of(out[0])
            ok = ok and torch.equal(out[2], want[0]) and torch.equal(out[3], want[1])
        if not kind.startswith("backward"):
            return {"exact": bool(ok)}
        dw_err = float(((out[1].double() - dw_exact).abs() / dw_bound.clamp_min(1e-300)).max())
        return {"exact": bool(ok) and dw_err <= 1.0, "rows_exact": bool(ok), "dw_err": dw_err}

    baselines = {
        "gather alone (index_select)": (lambda: x.index_select(0, token_of_row), 4 * R * D),
        "gather, then quantize_fp8": (lambda: quantize_fp8(x.index_select(0, token_of_row), (1, 0), True),
                                      7 * R * D + 4 * R),
        "backward, then quantize_fp8": (lambda: quantize_fp8(runs["backward"](None)[0], (1, 0), True),
                                        7 * R * D + 2 * T * D + 12 * R),
    }
    base = {name: time_ms(fn, warmup=2, iters=10, reps=5) for name, (fn, _) in baselines.items()}

    results = []
    for kind, grid in GRIDS.items():
        for block_d, tile, warps in grid:
            shape = LaunchShape(block_d, tile, warps)
            ms = time_ms(lambda kind=kind, shape=shape: runs[kind](shape), warmup=2, iters=10, reps=5)
            tbs = moved[kind] / ms / 1e9
            results.append({"kind": kind, "block_d": block_d, "tile": tile, "num_warps": warps, "ms": ms,
                            "tb_s": tbs, "of_copy": tbs / copy_tbs, **check(kind, runs[kind](shape)),
                            "default": shape == defaults[kind]})

    print(f"{R} rows [{R}, {D}] BF16 from {T} tokens on {torch.cuda.get_device_name()}; "
          f"device copy {copy_tbs:.2f} TB/s")
    for name, ms in base.items():
        print(f"baseline: {name} (default shapes): {ms:.3f} ms ({baselines[name][1] / ms / 1e9:.2f} TB/s)")
    print(f"{'kernel':>15} {'block_d':>8} {'tile':>6} {'warps':>6} {'ms':>7} {'TB/s':>6} {'of copy':>8}  exact  dw/bound")
    for kind in GRIDS:
        mine = [r for r in results if r["kind"] == kind]
        best = min(mine, key=lambda r: r["ms"])
        for r in mine:
            mark = ("default " if r["default"] else "") + ("best" if r is best else "")
            print(f"{kind:>15} {r['block_d']:8d} {r['tile']:6d} {r['num_warps']:6d} {r['ms']:7.3f} "
                  f"{r['tb_s']:6.2f} {r['of_copy']:8.0%}  {r['exact']!s:5}  {dw_text(r):>8} {mark}")
    if not all(r["exact"] for r in results):
        print("MISMATCH: a launch shape wrote other rows than the default's, codes other than "
              "quantize_fp8's, or a weights' gradient outside the FP32 summation bound")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "tokens": T, "top_k": k, "d_model": D,
            "copy_tb_s": copy_tbs, "baselines_ms": base, "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
