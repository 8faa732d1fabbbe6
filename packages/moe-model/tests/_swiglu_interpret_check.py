"""Run by test_fused_swiglu.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported): the fused SwiGLU kernels on CPU against FP32 arithmetic and the eager
``swiglu_reference``, forward and both gradients, FP32 and BF16, sizes that are not a
multiple of the kernel's block, and an empty input; with a row bound, rows past it are
neither read nor written."""

import torch
from moe_model.layers import swiglu, swiglu_reference


def main():
    gen = torch.Generator().manual_seed(0)
    # vs FP32 arithmetic: a few FP32 ulps (exp may differ in the last bit), or one BF16
    # step (the interpreter's BF16 conversion need not round to nearest; the GPU test
    # checks that); vs eager BF16 (which rounds silu(g) first): one BF16 step.
    for dtype, exact_tol, tol in ((torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2**-7, 1e-2)):
        for shape in ((37, 53), (3, 2048 + 5), (0, 16)):
            g = (torch.randn(shape, generator=gen) * 3).to(dtype).requires_grad_(True)
            u = torch.randn(shape, generator=gen).to(dtype).requires_grad_(True)
            dh = torch.randn(shape, generator=gen).to(dtype)
            out = swiglu(g, u, backend="triton")
            assert out.numel() == 0 or out.grad_fn.name() == "FusedSwiGLUBackward", out.grad_fn
            dg, du = torch.autograd.grad(out, (g, u), dh)
            # the kernel's arithmetic in FP32, rounded once
            g32, u32, dh32 = g.detach().float(), u.detach().float(), dh.float()
            s = torch.sigmoid(g32)
            exact = (g32 * s * u32, dh32 * u32 * s * (1 + g32 * (1 - s)), dh32 * g32 * s)
            tag = f"{dtype} {shape}"
            for name, got, want in zip(("h", "dg", "du"), (out, dg, du), exact, strict=True):
                assert got.dtype == dtype, f"{name} {tag}: dtype {got.dtype}"
                torch.testing.assert_close(got, want.to(dtype), rtol=exact_tol, atol=1e-6,
                                           msg=lambda m, n=name, t=tag: f"{n} {t} vs FP32: {m}")
            ref = swiglu_reference(g, u)
            ref_dg, ref_du = torch.autograd.grad(ref, (g, u), dh)
            for name, got, want in zip(("h", "dg", "du"), (out, dg, du), (ref, ref_dg, ref_du),
                                       strict=True):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol,
                                           msg=lambda m, n=name, t=tag: f"{n} {t} vs eager: {m}")
    check_row_bound(gen)
    print("ok")


def check_row_bound(gen):
    """With a row bound the kernels leave rows at or past it untouched (sentinels survive)
    and compute the live rows as without one; through autograd too."""
    from moe_model._swiglu_kernels import (
        _BLOCK,
        _grid,
        swiglu_backward_kernel,
        swiglu_forward_kernel,
    )

    shape, live = (37, 53), 20
    g = (torch.randn(shape, generator=gen) * 3).requires_grad_(True)
    u = torch.randn(shape, generator=gen).requires_grad_(True)
    dh = torch.randn(shape, generator=gen)
    rows = torch.tensor([live], dtype=torch.int32)
    n, width = g.numel(), shape[1]
    h, dg, du = (torch.full(shape, 7.0) for _ in range(3))
    swiglu_forward_kernel[_grid(n)](g.detach(), u.detach(), h, n, rows, width, HAS_BOUND=True, BLOCK=_BLOCK)
    swiglu_backward_kernel[_grid(n)](dh, g.detach(), u.detach(), dg, du, n, rows, width, HAS_BOUND=True,
                                     BLOCK=_BLOCK)
    out = swiglu(g, u, backend="triton")
    ref_dg, ref_du = torch.autograd.grad(out, (g, u), dh)
    for name, got, want in (("h", h, out), ("dg", dg, ref_dg), ("du", du, ref_du)):
        torch.testing.assert_close(got[:live], want[:live].detach(), msg=lambda m, n=name: f"{n} live rows: {m}")
        assert (got[live:] == 7.0).all(), f"{name}: a padding row was written"
    bounded = swiglu(g, u, rows, backend="triton")
    b_dg, b_du = torch.autograd.grad(bounded, (g, u), dh)
    for name, got, want in (("h", bounded, out), ("dg", b_dg, ref_dg), ("du", b_du, ref_du)):
        torch.testing.assert_close(got[:live], want[:live].detach(), msg=lambda m, n=name: f"{n} autograd: {m}")


if __name__ == "__main__":
    main()
