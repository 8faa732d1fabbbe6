"""Run by test_fused_rms_norm.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported, and never in the test process itself): the fused RMSNorm kernels on CPU
against ``rms_norm_reference`` (the code every non-CUDA input runs), forward,
dx and dweight, over dtypes, widths, odd row counts, strided views and recompute; and the
residual add fused into it (``add_rms_norm``) against the add and the norm apart.

The interpreter rounds FP32 -> BF16 by truncation where a GPU rounds to nearest even
(``fptrunc``); ``_round_bf16_to_nearest_even`` patches the interpreter's cast so the
kernels' rounding can be compared with torch's bit for bit.
"""

import functools

import numpy as np
import torch
import triton.language as tl
from moe_model import layers
from moe_model._rms_norm_kernels import _rows_layout
from moe_model.layers import RMSNorm, rms_norm_reference
from moe_model.recompute import recompute_block
from triton.runtime import interpreter

# the public ops, made to run their kernels
rms_norm = functools.partial(layers.rms_norm, backend="triton")
add_rms_norm = functools.partial(layers.add_rms_norm, backend="triton")

EPS = 1e-6


def _round_bf16_to_nearest_even() -> None:
    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # no NaNs here
            return interpreter.TensorHandle(out, dst_type.scalar)
        return cast(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl
    interpreter.InterpreterBuilder.create_fp_trunc = cast_impl


def close(a, b, what, exact):
    """``exact``: FP32 inputs, so FP32 reassociation only (relative to the tensor's scale).
    Otherwise (16-bit inputs) an element may round the other way where the reference's
    FP32 value sits next to a rounding boundary: 1 ulp of BF16 at most, and rarely."""
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a, b = a.float(), b.float()
    scale = b.abs().max().item() if b.numel() else 0.0
    if exact:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")
        return
    torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")
    same = torch.isclose(a, b, rtol=1e-6, atol=1e-6 * scale).float().mean().item()
    assert same > 0.9, f"{what}: only {same:.3f} of the elements match the reference"


def reference(x, w, dy):
    norm = RMSNorm(x.shape[-1], EPS)
    norm.weight = torch.nn.Parameter(w.detach().clone())
    xr = x.detach().clone().requires_grad_()
    y = rms_norm_reference(xr, norm.weight, norm.eps)
    y.backward(dy)
    return y.detach(), xr.grad, norm.weight.grad


def fused(x, w, dy):
    x = x.detach().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = rms_norm(x, w, EPS)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def check(x, w, dy, tag):
    exact = x.dtype == w.dtype == torch.float32
    for name, a, b in zip(("y", "dx", "dw"), fused(x, w, dy), reference(x, w, dy), strict=True):
        close(a, b, f"{name} {tag}", exact)


def make(g, shape, x_dtype, w_dtype):
    x = (torch.randn(shape, generator=g) * 3).to(x_dtype)
    w = (1 + 0.5 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    dy = torch.randn(shape, generator=g).to(out_dtype)
    return x, w, dy


def main():
    _round_bf16_to_nearest_even()
    g = torch.Generator().manual_seed(0)
    # widths: a block norm, a head, a non-power of two; odd row counts (several programs,
    # partial row blocks, backward programs with a short last chunk)
    # (FP32 at Dh = 128: the QK-norm cases below)
    cases = [((7, 2048), torch.float32, torch.float32), ((3, 13, 96), torch.float32, torch.float32),
             ((5, 2048), torch.bfloat16, torch.bfloat16),
             ((37, 128), torch.bfloat16, torch.bfloat16), ((37, 96), torch.bfloat16, torch.float32),
             ((37, 128), torch.float32, torch.bfloat16), ((21, 32), torch.float16, torch.float32)]
    for shape, x_dtype, w_dtype in cases:
        x, w, dy = make(g, shape, x_dtype, w_dtype)
        check(x, w, dy, f"{shape} x {x_dtype} w {w_dtype}")

    # QK-norm inputs: q of a fused projection [B, S, (H + 2K) Dh] (rows over two strides),
    # q through a transpose (three strides), a gradient through a transpose
    B, S, H, K, Dh = 2, 5, 3, 1, 128
    for dtype in (torch.float32, torch.bfloat16):
        qkv = (torch.randn(B, S, (H + 2 * K) * Dh, generator=g) * 3).to(dtype)
        q = qkv[..., : H * Dh].view(B, S, H, Dh)
        qt = (torch.randn(B, H, S, Dh, generator=g) * 3).to(dtype).transpose(1, 2)
        for name, xv in (("fused-qkv view", q), ("transposed", qt)):
            assert not xv.is_contiguous()
            assert _rows_layout(xv)[0].data_ptr() == xv.data_ptr(), f"{name}: copied"
            w = (1 + 0.5 * torch.randn(Dh, generator=g)).to(dtype)
            dy = torch.randn(B, H, S, Dh, generator=g).to(dtype).transpose(1, 2)
            check(xv, w, dy, f"{name} {dtype}")
    # last dimension strided, and four leading dimensions that do not merge: copies
    x = (torch.randn(6, 40, generator=g) * 3).t()
    check(x, torch.randn(6, generator=g), torch.randn(40, 6, generator=g), "stride(-1) != 1")
    x = torch.randn(2, 3, 4, 5, 32, generator=g).permute(3, 1, 0, 2, 4)
    assert _rows_layout(x)[0].data_ptr() != x.data_ptr()
    check(x, torch.randn(32, generator=g), torch.randn(x.shape, generator=g), "4 leading dims")

    # deterministic dweight; no rows; a frozen weight
    x, w, dy = make(g, (37, 96), torch.bfloat16, torch.float32)
    assert torch.equal(fused(x, w, dy)[2], fused(x, w, dy)[2]), "dweight not deterministic"
    y, dx, dw = fused(torch.randn(0, 64), torch.randn(64), torch.randn(0, 64))
    assert y.shape == dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64))
    xg = x.detach().requires_grad_()
    rms_norm(xg, w, EPS).backward(dy)
    close(xg.grad, reference(x, w, dy)[1], "dx, frozen weight", exact=False)

    # the residual add fused into the norm: h = x + b and norm(h) with h's two gradients
    # (its later uses' and the norm's) summed in the norm's backward, against the add and
    # the fused norm apart (autograd sums the two gradients): equal bit for bit
    for shape, dtype, w_dtype in (((7, 2048), torch.bfloat16, torch.bfloat16), ((3, 13, 96), torch.float32,
                                   torch.float32), ((37, 128), torch.bfloat16, torch.float32), ((0, 64),
                                   torch.bfloat16, torch.bfloat16)):
        x, w, dy = make(g, shape, dtype, w_dtype)
        b = (torch.randn(shape, generator=g) * 3).to(dtype)
        dh = torch.randn(shape, generator=g).to(dtype)
        results = []
        for together in (True, False):
            xg, bg, wg = (t.detach().clone().requires_grad_() for t in (x, b, w))
            if together:
                h, y = add_rms_norm(xg, bg, wg, EPS)
            else:
                h = xg + bg
                y = rms_norm(h, wg, EPS)
            torch.autograd.backward((h, y), (dh, dy))
            results.append((h.detach(), y.detach(), xg.grad, bg.grad, wg.grad))
        for what, got, want in zip(("h", "y", "dx", "dbranch", "dw"), *results, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), f"add_rms_norm {what} {shape} {dtype}"

    # as in the block: x not a leaf, and the branch computed from x, so x's gradient
    # buffer also receives the branch's backward (the same dx tensor went to both edges)
    x0, w, dy = make(g, (9, 96), torch.bfloat16, torch.bfloat16)
    proj, dh = torch.randn(96, 96, generator=g).bfloat16() * 0.1, torch.randn(9, 96, generator=g).bfloat16()
    results = []
    for together in (True, False):
        x0g, wg = x0.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        x = x0g * 1.5
        branch = x @ proj
        h, y = add_rms_norm(x, branch, wg, EPS) if together else (x + branch, None)
        y = rms_norm(h, wg, EPS) if y is None else y
        torch.autograd.backward((h, y), (dh, dy))
        results.append((x0g.grad, wg.grad))
    for what, got, want in zip(("dx", "dw"), *results, strict=True):
        assert torch.equal(got, want), f"add_rms_norm in a graph: {what}"

    # activation recompute: moe_model.recompute's whole-block and selective checkpointing
    x, w, dy = make(g, (2, 9, 128), torch.bfloat16, torch.bfloat16)
    want = fused(x, w, dy)
    for selective in (False, True):
        name = "selective" if selective else "block"
        xg, wg = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
        y = recompute_block(lambda t, wg=wg: rms_norm(t, wg, EPS) * 2, xg, selective)
        y.backward(dy)
        for got, ref, what in ((y.detach(), want[0] * 2, "y"), (xg.grad, 2 * want[1], "dx"),
                               (wg.grad, 2 * want[2], "dw")):
            assert torch.equal(got, ref), f"{what} under {name} recompute"
    print("ok")


if __name__ == "__main__":
    main()
