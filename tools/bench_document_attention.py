"""Document-masked attention per kernel (``data.document_mask``), on one GPU.

    tools/from_source.sh python3 tools/bench_document_attention.py --out $OUT/bench_document_attention.json

Shape (bench-1gpu's attention): micro batch 2 x 4096 tokens, 16 query heads and 4 KV
heads of 128, BF16. Document layouts: ``one`` (a single document per window: the
causal mask), and windows cut into documents of random lengths averaging 1024 and
256 tokens (seeded). Kernels:

- ``causal``: plain causal SDPA, ignoring the documents (the cost without the mask);
- ``flex``: ``moe_model.DocumentMask`` with FlexAttention (compiled; what CUDA runs);
- ``sdpa``: ``moe_model.DocumentMask`` with SDPA and a dense boolean mask;
- ``flash_varlen``: ``flash_attn.flash_attn_varlen_func`` over the documents as
  sequences, when the ``flash-attn`` package imports (not a dependency).

Per kernel and layout: the mask's build time (per batch, shared by the layers),
the attention call's forward and forward+backward device times, and the largest
relative error of the output against an FP32 per-document reference (the dense
mask on PyTorch's math kernel). Last, ``flex_recompiles``: the frames TorchDynamo
compiled for three more batches' masks (new document-id tensors, as training builds
one per microbatch): 0 means a new batch reuses the compiled kernel. The table is printed last, the JSON holds every number.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from moe_model import DocumentMask
from torch.nn.attention import SDPBackend, sdpa_kernel

SLEEP_CYCLES = int(4e8)  # GPU cycles ahead of a timed loop: longer than its launches take
LAYOUTS = {"one": None, "mean_1024": 1024, "mean_256": 256}


def device_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Mean device time per call with the host ahead of the device."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def document_ids(batch: int, seq_len: int, mean: int | None, seed: int) -> torch.Tensor:
    """``[B, S]`` document numbers, lengths drawn geometric with the given mean."""
    if mean is None:
        return torch.zeros(batch, seq_len, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=g) < 1.0 / mean
    starts[:, 0] = False
    return torch.cumsum(starts.int(), dim=1, dtype=torch.int32)


def flash_varlen(ids: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    B, S = ids.shape
    lengths = torch.cat([torch.unique_consecutive(row, return_counts=True)[1] for row in ids])
    cu = F.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32).cuda()
    longest = int(lengths.max())

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        flat = [t.transpose(1, 2).reshape(B * S, t.shape[1], t.shape[3]) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu, cu, longest, longest, causal=True)
        return out.view(B, S, q.shape[1], q.shape[3]).transpose(1, 2)

    return attend


def kernels(ids: torch.Tensor) -> dict[str, tuple[Callable[[], object], Callable[..., torch.Tensor]]]:
    """name -> (build the per-batch mask, attention given q, k, v)."""
    out: dict[str, tuple[Callable[[], object], Callable[..., torch.Tensor]]] = {
        "causal": (lambda: None, lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)),
    }
    for name in ("flex", "sdpa"):
        mask = DocumentMask(ids, kernel=name)
        out[name] = (lambda name=name: DocumentMask(ids, kernel=name), mask.attend)
    varlen = flash_varlen(ids)
    if varlen is not None:
        out["flash_varlen"] = (lambda: flash_varlen(ids), varlen)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    B, S, H, K, Dh = args.micro_batch, args.seq_len, 16, 4, 128
    torch.manual_seed(0)
    q32 = torch.randn(B, H, S, Dh, device="cuda")
    k32, v32 = (torch.randn(B, K, S, Dh, device="cuda") for _ in range(2))
    qkv = [t.bfloat16().requires_grad_() for t in (q32, k32, v32)]
    rows = []
    for layout, mean in LAYOUTS.items():
        ids = document_ids(B, S, mean, seed=1).cuda()
        n_docs = int(sum(len(torch.unique(row)) for row in ids))
        with sdpa_kernel([SDPBackend.MATH]):
            gold = DocumentMask(ids, kernel="sdpa").attend(q32, k32, v32)
        for name, (build, attend) in kernels(ids).items():
            out = attend(*qkv)
            g = torch.randn_like(out)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            build()
            torch.cuda.synchronize()
            build_ms = (time.perf_counter() - t0) * 1e3
            fwd = device_ms(lambda attend=attend: attend(*qkv))
            both = device_ms(lambda attend=attend, g=g: torch.autograd.grad(attend(*qkv), qkv, g))
            reference = gold if name != "causal" else F.scaled_dot_product_attention(
                q32, k32, v32, is_causal=True, enable_gqa=True)
            error = float((out.float() - reference).norm() / reference.norm())
            rows.append({"layout": layout, "documents": n_docs, "kernel": name,
                         "mask_build_ms": build_ms, "fwd_ms": fwd, "fwd_bwd_ms": both,
                         "max_rel_error": error})
    from torch._dynamo.utils import counters

    compiled = counters["frames"]["ok"]
    for seed in (2, 3, 4):
        mask = DocumentMask(document_ids(B, S, 512, seed).cuda(), kernel="flex")
        torch.autograd.grad(mask.attend(*qkv), qkv, torch.ones_like(qkv[0]))
    torch.cuda.synchronize()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "micro_batch": B, "seq_len": S, "heads": H, "kv_heads": K, "head_dim": Dh,
              "results": rows, "flex_recompiles": counters["frames"]["ok"] - compiled}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\ndocument-masked attention, B={B} S={S} H={H}/{K} Dh={Dh} BF16, {report['device']}, "
          f"torch {report['torch']}")
    print("| layout | documents | kernel | mask build ms | fwd ms | fwd+bwd ms | rel err vs FP32 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['documents']} | {r['kernel']} | {r['mask_build_ms']:.2f} | "
              f"{r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {r['max_rel_error']:.2e} |")
    print(f"flex: frames compiled for three new batches' masks: {report['flex_recompiles']}")


if __name__ == "__main__":
    main()
