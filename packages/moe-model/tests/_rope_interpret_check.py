"""Run by test_fused_rope.py in a subprocess with TRITON_INTERPRET=1 (set before Triton is
imported): the fused RoPE kernel on CPU against the eager ``apply_rope``, forward and
gradient, contiguous and strided inputs, FP32 and BF16."""

import torch
from moe_model.layers import apply_rope, apply_rope_reference, rope_tables


def main():
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        for B, S, H, Dh, strided in ((2, 19, 3, 16, True), (1, 5, 2, 12, False)):
            cos, sin = rope_tables(S, Dh, 10000.0, torch.device("cpu"))
            base = torch.randn(B, S, H, Dh, generator=g).to(dtype)
            x = base.transpose(1, 2) if strided else base.transpose(1, 2).contiguous()
            x = x.detach().requires_grad_(True)
            dy = torch.randn(B, H, S, Dh, generator=g).to(dtype)
            ref = apply_rope_reference(x, cos, sin)
            (ref_dx,) = torch.autograd.grad(ref, x, dy)
            out = apply_rope(x, cos, sin, backend="triton")
            assert out.grad_fn.name() == "FusedRopeBackward", out.grad_fn.name()
            (dx,) = torch.autograd.grad(out, x, dy)
            tag = f"{dtype} {B, S, H, Dh} strided={strided}"
            assert out.stride() == ref.stride(), f"layout {tag}: {out.stride()} vs {ref.stride()}"
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol, msg=lambda m, t=tag: f"fwd {t}: {m}")
            torch.testing.assert_close(dx, ref_dx, rtol=tol, atol=tol, msg=lambda m, t=tag: f"dx {t}: {m}")
    print("ok")


if __name__ == "__main__":
    main()
