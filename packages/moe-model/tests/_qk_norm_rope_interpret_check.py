"""Run by test_fused_qk_norm_rope.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported): the fused QK-norm + RoPE kernels on CPU against the two kernels they
replace run one after the other (RMSNorm's, then RoPE's) and against the eager reference,
forward, dx and dweight, FP32 and BF16, a head dim whose half is not a power of two, and
the output gradient as attention's backward gives it (a transposed view) or contiguous."""

import torch
from _rms_norm_interpret_check import _round_bf16_to_nearest_even, close
from moe_model.layers import (
    RMSNorm,
    apply_rope,
    apply_rope_reference,
    qk_norm_rope,
    rms_norm,
    rms_norm_reference,
    rope_tables,
)

EPS = 1e-6


def fused(x, w, cos, sin, g):
    x, w = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
    out = qk_norm_rope(x, w, EPS, cos, sin, backend="triton").transpose(1, 2)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def two_kernels(x, w, cos, sin, g):
    x, w = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
    out = apply_rope(rms_norm(x, w, EPS, backend="triton").transpose(1, 2), cos, sin, backend="triton").transpose(1, 2)
    out.backward(g)
    return out.detach(), x.grad, w.grad


def eager(x, w, cos, sin, g):
    norm = RMSNorm(x.shape[-1], EPS)
    norm.weight = torch.nn.Parameter(w.detach().clone())
    x = x.detach().requires_grad_()
    out = apply_rope_reference(rms_norm_reference(x, norm.weight, norm.eps).transpose(1, 2), cos, sin).transpose(1, 2)
    out.backward(g)
    return out.detach(), x.grad, norm.weight.grad


def main():
    _round_bf16_to_nearest_even()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for B, S, H, Dh in ((2, 7, 3, 16), (1, 5, 2, 12)):
            cos, sin = rope_tables(S, Dh, 10000.0, torch.device("cpu"))
            x = (torch.randn(B, S, H, Dh, generator=gen) * 3).to(dtype)
            w = (1 + 0.3 * torch.randn(Dh, generator=gen)).to(dtype)
            for strided in (True, False):
                g = torch.randn(B, H, S, Dh, generator=gen).to(dtype)
                g = g.transpose(1, 2) if strided else g.transpose(1, 2).contiguous()
                tag = f"{dtype} {(B, S, H, Dh)} strided={strided}"
                got = fused(x, w, cos, sin, g)
                exact = dtype == torch.float32
                for name, a, b in zip(("out", "dx", "dw"), got, two_kernels(x, w, cos, sin, g), strict=True):
                    close(a, b, f"{name} vs the two kernels, {tag}", exact)
                # eager BF16 rounds RoPE's backward twice (each path's gradient, then their
                # BF16 sum) where the kernels round once: a BF16 step or two apart
                for name, a, b in zip(("out", "dx", "dw"), got, eager(x, w, cos, sin, g), strict=True):
                    if exact:
                        close(a, b, f"{name} vs eager, {tag}", exact)
                    else:
                        scale = b.float().abs().max().item()
                        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-7 * scale,
                                                   msg=lambda m, n=name, t=tag: f"{n} vs eager, {t}: {m}")
                assert got[0].is_contiguous() and got[1].is_contiguous(), tag
    print("ok")


if __name__ == "__main__":
    main()
