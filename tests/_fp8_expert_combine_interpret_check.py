"""Run by test_fp8_expert_combine.py with TRITON_INTERPRET=1: moe_mxfp8's FP8 experts
between moe_model's local dispatcher and its fused combine, whose backward writes the
experts' rowwise FP8 output gradient."""

import functools
from unittest import mock

import moe_mxfp8.fp8_experts as fp8_experts
import torch
from moe_model import GRADIENT_ROW_ENCODER, LocalDispatcher, dispatch
from moe_mxfp8 import FP8GroupedExperts
from moe_mxfp8.fp8 import quantize_fp8_reference
from torch import nn


def grads(layer, disp, x, ids, w, r, extra=False, strip=False):
    """Gradients of ``sum(combine(experts(dispatch(x))) * r)`` for ``x``, the routing
    weights and the expert weights, and the shapes the experts quantized rowwise;
    ``extra``: the expert output also feeds a second term; ``strip``: it carries no
    encoder."""
    quantized = []
    real = fp8_experts.quantize_fp8

    def spy(t, *args):
        quantized.append(tuple(t.shape))
        return real(t, *args)

    with mock.patch.object(fp8_experts, "quantize_fp8", spy):
        rows, offsets, h = disp.dispatch(x, ids)
        out = layer(rows, offsets)
        if strip:
            delattr(out, GRADIENT_ROW_ENCODER)
        loss = (disp.combine(out, w, h).float() * r).sum()
        if extra:
            loss = loss + out.float().square().sum() * 1e-3
        got = torch.autograd.grad(loss, (x, w, layer.w1, layer.w3, layer.w2))
    return got, quantized, rows.shape


def main():
    g = torch.Generator().manual_seed(0)
    T, D, F, E, k = 12, 32, 48, 4, 2
    combine_bwd = dispatch.combine_backward
    dispatch.combine_backward = functools.partial(combine_bwd, backend="triton")
    try:
        for recipe in ("fp8_rowwise_gw_hp", "fp8_rowwise"):
            w1, w3 = (nn.Parameter((torch.randn(E, F, D, generator=g) * 0.2).bfloat16()) for _ in range(2))
            w2 = nn.Parameter((torch.randn(E, D, F, generator=g) * 0.2).bfloat16())
            layer = FP8GroupedExperts(w1, w3, w2, recipe=recipe, gemm="triton")
            disp = LocalDispatcher(E, None)
            x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
            w = torch.rand(T, k, generator=g).requires_grad_()
            r = torch.randn(T, D, generator=g)
            r[3] = 0.0  # a token whose gradient is zero

            # the codes the combine hands over are quantize_fp8's of the gradient it wrote
            rows, offsets, h = disp.dispatch(x, ids)
            out = layer(rows, offsets)
            enc = getattr(out, GRADIENT_ROW_ENCODER)
            received = []
            enc.receive = lambda *got, into=received: into.append(got)
            torch.autograd.grad((disp.combine(out, w, h).float() * r).sum(), out)
            d_rows, codes, scales = received[0]
            ref = quantize_fp8_reference(d_rows, (1, 0), True)
            assert torch.equal(codes, ref.data.view(torch.uint8)), recipe
            assert torch.equal(scales, ref.scale), recipe

            # the experts use them instead of quantizing dy, and every gradient is unchanged
            got, quantized, shape = grads(layer, disp, x, ids, w, r)
            want, want_quantized, _ = grads(layer, disp, x, ids, w, r, strip=True)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), recipe
            assert want_quantized.count(tuple(shape)) == 2 and quantized.count(tuple(shape)) == 1, (
                recipe, quantized)
            # the output also feeds another term: the gradient the experts get is a sum
            got, quantized, _ = grads(layer, disp, x, ids, w, r, extra=True)
            want, _, _ = grads(layer, disp, x, ids, w, r, extra=True, strip=True)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), recipe
            assert quantized.count(tuple(shape)) == 2, (recipe, quantized)
        # a blockwise recipe scales dy in 1x128 tiles: no encoder
        assert not hasattr(FP8GroupedExperts(w1, w3, w2, recipe="fp8_blockwise", gemm="triton")(rows, offsets),
                           GRADIENT_ROW_ENCODER)
        with torch.no_grad():
            assert not hasattr(layer(rows, offsets), GRADIENT_ROW_ENCODER)
    finally:
        dispatch.combine_backward = combine_bwd
    print("ok")


if __name__ == "__main__":
    main()
