"""Launch shapes of the fused cross-entropy kernels, timed at the LM head's real shape.

    # one GPU: bench-1gpu's logits per microbatch, [8192, 100352] BF16
    tools/from_source.sh python3 tools/sweep_cross_entropy.py --out $OUT/sweep_cross_entropy.json

For each ``CrossEntropyConfig`` (vocabulary chunk per program, warps) it times moe_model's
four kernel variants: the forward, the forward that also records the largest logit other
than the target's, the backward, and the backward that also writes the FP8 head's rowwise
``dy`` codes (``moe_mxfp8.row_codes.RowCodes``, power-of-two scales, the
``fp8_rowwise_gw_hp`` recipe's). Every codes run is checked bit for bit against
``quantize_fp8`` of the gradient it wrote. TB/s counts the bytes read plus written (the
logits and, for the backward, the gradient and codes); the device copy of the logits,
measured in the same run, is the ceiling. The baseline the codes replace, also measured
in the run: the plain backward in its default shape, then ``quantize_fp8`` of its
gradient (rowwise, power-of-two scales). The kernel defaults
(``moe_model._cross_entropy_kernels._GPU``) are marked; a short table is printed and
``--out`` gets the JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from _bench import time_ms

GRID = [(1024, 2), (1024, 4), (2048, 2), (2048, 4), (2048, 8), (4096, 4), (4096, 8),
        (8192, 4), (8192, 8), (8192, 16), (16384, 8), (16384, 16)]
KINDS = ("forward", "forward_other_max", "backward", "backward_codes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="tokens per microbatch (bench-1gpu: 8192)")
    ap.add_argument("--vocab", type=int, default=100352, help="vocabulary (bench-1gpu: 100352)")
    ap.add_argument("--out", type=Path, help="JSON results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_cross_entropy.py times GPU kernels: no CUDA device")

    from moe_model._cross_entropy_kernels import (
        CrossEntropyConfig,
        cross_entropy_backward,
        cross_entropy_forward,
        default_cross_entropy_config,
    )
    from moe_mxfp8 import quantize_fp8
    from moe_mxfp8.row_codes import RowCodes

    device = torch.device("cuda")
    N, V = args.rows, args.vocab
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(N, V, device=device, generator=g) * 2).bfloat16()
    targets = torch.randint(0, V, (N,), device=device, generator=g)
    grad_out = torch.tensor(1 / N, device=device)
    encoder = RowCodes(True)
    _, row_max, logsum, other_max = cross_entropy_forward(logits, targets, other_max=True)

    logit_bytes = logits.numel() * logits.element_size()
    copy_ms = time_ms(lambda: logits.clone())
    copy_tbs = 2 * logit_bytes / copy_ms / 1e9
    moved = {"forward": logit_bytes, "forward_other_max": logit_bytes,
             "backward": 2 * logit_bytes, "backward_codes": 2 * logit_bytes + N * V}
    runs = {
        "forward": lambda cfg: cross_entropy_forward(logits, targets, config=cfg),
        "forward_other_max": lambda cfg: cross_entropy_forward(logits, targets, config=cfg, other_max=True),
        "backward": lambda cfg: cross_entropy_backward(logits, targets, row_max, logsum, grad_out, config=cfg),
        "backward_codes": lambda cfg: cross_entropy_backward(logits, targets, row_max, logsum, grad_out,
                                                             config=cfg, encoding=(encoder, other_max)),
    }

    def then_quantize():
        return quantize_fp8(runs["backward"](None)[0], (1, 0), True)

    then_quantize_ms = time_ms(then_quantize, warmup=2, iters=10, reps=5)
    then_quantize_tbs = (3 * logit_bytes + N * V + 4 * N) / then_quantize_ms / 1e9

    rows = []
    for block_v, warps in GRID:
        cfg = CrossEntropyConfig(block_v, warps)
        for kind in KINDS:
            default = default_cross_entropy_config(kind.removesuffix("_other_max"), device) == cfg
            ms = time_ms(lambda kind=kind, cfg=cfg: runs[kind](cfg), warmup=2, iters=10, reps=5)
            exact = None
            if kind == "backward_codes":
                grad, codes, scales = runs[kind](cfg)
                q = quantize_fp8(grad, (1, 0), True)
                exact = bool(torch.equal(codes, q.data.view(torch.uint8)) and torch.equal(scales, q.scale))
                del grad, codes, scales, q
            tbs = moved[kind] / ms / 1e9
            rows.append({"kind": kind, "block_v": block_v, "num_warps": warps, "ms": ms, "tb_s": tbs,
                         "of_copy": tbs / copy_tbs, "codes_exact": exact, "default": default})

    print(f"logits [{N}, {V}] BF16 on {torch.cuda.get_device_name()}; device copy {copy_tbs:.2f} TB/s")
    print(f"baseline: backward (default shape), then rowwise quantize_fp8: {then_quantize_ms:.3f} ms "
          f"({then_quantize_tbs:.2f} TB/s)")
    print(f"{'kernel':>18} {'block_v':>8} {'warps':>6} {'ms':>7} {'TB/s':>6} {'of copy':>8}  exact")
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        best = min(mine, key=lambda r: r["ms"])
        for r in mine:
            mark = ("default " if r["default"] else "") + ("best" if r is best else "")
            exact = "" if r["codes_exact"] is None else str(r["codes_exact"])
            print(f"{kind:>18} {r['block_v']:8d} {r['num_warps']:6d} {r['ms']:7.3f} {r['tb_s']:6.2f} "
                  f"{r['of_copy']:8.0%}  {exact:5} {mark}")
    if any(r["codes_exact"] is False for r in rows):
        print("MISMATCH: a launch shape wrote codes other than quantize_fp8's")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "rows": N, "vocab": V, "copy_tb_s": copy_tbs,
            "backward_then_quantize_ms": then_quantize_ms, "backward_then_quantize_tb_s": then_quantize_tbs,
            "results": rows,
        }, indent=2))


if __name__ == "__main__":
    main()
