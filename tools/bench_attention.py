"""The attention block per SDPA kernel (``MoEConfig.attention_backend``), on one GPU.

    tools/from_source.sh python3 tools/bench_attention.py --out $OUT/bench_attention.json

Shape (the bench presets' attention): micro batch 2 x 4096 tokens, d_model 2048, 16
query heads and 4 KV heads of 128, causal, QK-norm and RoPE, BF16. Per backend
(``flash``, ``cudnn``, and ``auto``, PyTorch's own choice):

- the SDPA call alone on the module's own q/k/v layout (forward, then forward+backward),
  as ms and TFLOP/s of the causal attention FLOPs (4*B*H*S^2*Dh/2 forward, 2.5x
  that backward);
- the whole attention module (norms, projections, RoPE, SDPA) forward+backward;
- the tensors it keeps for the backward and its backward's peak above them;
- the largest relative error (norm of the difference over the reference's norm) of
  the output and every gradient against the same module in FP32 on PyTorch's math
  kernel.

Device times are taken with a sleep kernel ahead so the host's launches never
hold the device (a training step keeps the host ahead); a timed backward returns its
gradients (``torch.autograd.grad``) instead of adding them into existing ``.grad``
tensors, an accumulation the training step does not run. Compared with ``flash`` in
the same run; the table is printed last, the JSON holds every number.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench import time_ms
from moe_model import MoEConfig
from moe_model.layers import Attention, apply_rope, rope_tables, sdpa_priority
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = ("flash", "cudnn", "auto")
def device_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Mean device time per call with the host ahead of the device."""
    return time_ms(fn, warmup=3, iters=iters, reps=1, host_ahead=True)


def sdpa_inputs(module: Attention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v exactly as the module hands them to SDPA (same strides)."""
    B, S, _ = x.shape
    H, K, Dh = module.n_heads, module.n_kv_heads, module.head_dim
    with torch.no_grad():
        q = module.q_norm(module.wq(x).view(B, S, H, Dh)).transpose(1, 2)
        k = module.k_norm(module.wk(x).view(B, S, K, Dh)).transpose(1, 2)
        v = module.wv(x).view(B, S, K, Dh).transpose(1, 2)
        cos, sin = rope_tables(S, Dh, module.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return tuple(t.detach().requires_grad_() for t in (q, k, v))


def time_sdpa(sdpa: Callable[..., torch.Tensor], qkv: tuple[torch.Tensor, ...]
              ) -> tuple[str, float, float, float]:
    """(autograd node of the kernel that ran, forward ms, forward+backward ms, forward FLOPs)."""
    out = sdpa(*qkv)
    g_out = torch.randn_like(out)
    B, H, S, Dh = qkv[0].shape
    fwd = device_ms(lambda: sdpa(*qkv))
    both = device_ms(lambda: torch.autograd.grad(sdpa(*qkv), qkv, g_out))
    return out.grad_fn.name(), fwd, both, 4 * B * H * S * S * Dh / 2


def measure(backend: str, ref: Attention, x32: torch.Tensor, g32: torch.Tensor,
            gold: list[torch.Tensor]) -> dict[str, float | str]:
    module = copy.deepcopy(ref).to(torch.bfloat16)
    module.backend = backend
    x, g = x32.bfloat16(), g32.bfloat16()
    priority = sdpa_priority(backend, x.device)
    order = list(priority) if priority is not None else None

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if order is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(order, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    kernel, fwd, both, flops = time_sdpa(sdpa, sdpa_inputs(module, x))
    xr = x.detach().requires_grad_()
    block = device_ms(lambda: torch.autograd.grad(module(xr), [xr, *module.parameters()], g))

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    xr = x.detach().requires_grad_()
    y = module(xr)
    kept = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    y.backward(g)
    backward_peak = torch.cuda.max_memory_allocated() - base - kept
    got = [y.float(), xr.grad.float(), *(p.grad.float() for p in module.parameters())]
    error = max(float((a - b).norm() / b.norm()) for a, b in zip(got, gold, strict=True))
    return {"backend": backend, "kernel": kernel, "sdpa_fwd_ms": fwd, "sdpa_bwd_ms": both - fwd,
            "sdpa_fwd_tflops": flops / fwd / 1e9, "sdpa_bwd_tflops": 2.5 * flops / (both - fwd) / 1e9,
            "block_fwd_bwd_ms": block, "kept_mib": kept / 2**20,
            "backward_peak_over_kept_mib": backward_peak / 2**20, "max_rel_error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    cfg = MoEConfig(d_model=2048, n_heads=16, n_kv_heads=4, head_dim=128)
    torch.manual_seed(0)
    ref = Attention(cfg).cuda()
    for p in ref.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    x32 = torch.randn(args.micro_batch, args.seq_len, cfg.d_model, device="cuda")
    g32 = torch.randn_like(x32)
    xr = x32.detach().requires_grad_()
    with sdpa_kernel([SDPBackend.MATH]):
        y = ref(xr)
        y.backward(g32)
    gold = [y.detach(), xr.grad, *(p.grad.detach().clone() for p in ref.parameters())]
    for p in ref.parameters():
        p.grad = None
    rows = [measure(b, ref, x32, g32, gold) for b in BACKENDS]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "micro_batch": args.micro_batch, "seq_len": args.seq_len, "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    base = rows[0]
    print(f"\nattention, B={args.micro_batch} S={args.seq_len} H=16/4 Dh=128 causal, "
          f"{report['device']}, torch {report['torch']}")
    print("| backend | kernel | SDPA fwd ms (TF/s) | SDPA bwd ms (TF/s) | block fwd+bwd ms | vs flash "
          "| kept MiB | bwd peak over kept MiB | max rel err vs FP32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backend']} | {r['kernel']} | {r['sdpa_fwd_ms']:.3f} ({r['sdpa_fwd_tflops']:.0f}) | "
              f"{r['sdpa_bwd_ms']:.3f} ({r['sdpa_bwd_tflops']:.0f}) | {r['block_fwd_bwd_ms']:.3f} | "
              f"{base['block_fwd_bwd_ms'] / r['block_fwd_bwd_ms']:.2f}x | {r['kept_mib']:.1f} | "
              f"{r['backward_peak_over_kept_mib']:.1f} | {r['max_rel_error']:.2e} |")


if __name__ == "__main__":
    main()
