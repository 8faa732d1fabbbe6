"""Run by test_fp8_experts_gradient_rows.py with TRITON_INTERPRET=1: moe_mxfp8's FP8
experts combined by moe_model's local dispatcher, whose fused combine backward writes the
experts' rowwise FP8 output gradient."""

import functools
from unittest import mock

import moe_mxfp8.fp8_experts as fp8_experts
import torch
from moe_model import GRADIENT_ROW_ENCODER, LocalDispatcher, dispatch
from moe_mxfp8 import FP8GroupedExperts
from moe_mxfp8.fp8 import quantize_fp8_reference
from torch import nn

_FUSED = functools.partial(dispatch.combine_backward, backend="triton")


def _double_in_place(grad):
    grad.mul_(2.0)


def grads(layer, disp, x, ids, w, dy, strip=False, hook=False):
    """Gradients of ``x``, the routing weights and the expert weights through dispatch ->
    experts -> combine, the ``dy`` quantisations the layer ran, and what the encoder
    received; ``strip``: the experts' output carries no encoder; ``hook``: a gradient hook
    on that output doubles its gradient in place."""
    quantized, received = [], []
    real = fp8_experts.quantize_fp8

    def spy(t, *args):
        quantized.append(t.shape)
        return real(t, *args)

    with mock.patch.object(fp8_experts, "quantize_fp8", spy), \
            mock.patch.object(dispatch, "combine_backward", _FUSED):
        rows, offsets, h = disp.dispatch(x, ids)
        out = layer(rows, offsets)
        if strip:
            delattr(out, GRADIENT_ROW_ENCODER)
        else:
            enc = getattr(out, GRADIENT_ROW_ENCODER)
            real_receive = enc.receive
            enc.receive = lambda *got: (received.append(got), real_receive(*got))
        if hook:
            out.register_hook(_double_in_place)
        y = disp.combine(out, w, h)
        got = torch.autograd.grad(y, (x, w, layer.w1, layer.w3, layer.w2), dy)
    return got, quantized, received


def main():
    g = torch.Generator().manual_seed(0)
    T, D, F, E, k = 12, 32, 16, 4, 2
    for recipe in ("fp8_rowwise_gw_hp", "fp8_rowwise"):
        w1, w3 = (nn.Parameter((torch.randn(E, F, D, generator=g) * 0.2).bfloat16()) for _ in range(2))
        w2 = nn.Parameter((torch.randn(E, D, F, generator=g) * 0.2).bfloat16())
        layer = FP8GroupedExperts(w1, w3, w2, recipe=recipe)
        x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g).requires_grad_()
        with torch.no_grad():
            w[3, 0] = 0.0  # a zero row of dy
            w[4, 1] = 1e-39  # BF16 subnormals in dy's row
        dy = torch.randn(T, D, generator=g).bfloat16()
        dy[5, 7] = 2e4  # one large element
        dy[6] = 0.0
        disp = LocalDispatcher(E)

        # the codes the combine hands over are quantize_fp8's of the gradient it wrote,
        # and the layer uses them instead of quantizing dy
        got, quantized, received = grads(layer, disp, x, ids, w, dy)
        assert len(received) == 1, recipe
        grad, codes, scales = received[0]
        ref = quantize_fp8_reference(grad, (1, 0), True)
        assert torch.equal(codes, ref.data.view(torch.uint8)), recipe
        assert torch.equal(scales, ref.scale), recipe
        amax = grad.float().abs().amax(1)
        assert (amax == 0).sum() == 3 and ((amax > 0) & (amax < torch.finfo(torch.float32).tiny)).any(), f"{recipe}: {amax}"
        rows_and_dy = (T * k, D)  # the forward quantizes the rows, of dy's shape
        assert quantized.count(rows_and_dy) == 1, f"{recipe}: dy quantized again: {quantized}"

        # the same gradients as the layer quantizing dy itself, bit for bit
        want, quantized, _ = grads(layer, disp, x, ids, w, dy, strip=True)
        assert quantized.count(rows_and_dy) == 2, quantized
        for name, a, b in zip(("x", "w", "w1", "w3", "w2"), got, want, strict=True):
            assert torch.equal(a, b), f"{recipe}: d{name} differs"

        # a hook editing the gradient in place: the codes are stale and not used
        hooked, quantized, received = grads(layer, disp, x, ids, w, dy, hook=True)
        assert len(received) == 1 and quantized.count(rows_and_dy) == 2, quantized
        doubled, _, _ = grads(layer, disp, x, ids, w, dy * 2, strip=True)
        for name, a, b in zip(("x", "w1", "w3", "w2"), (hooked[0], *hooked[2:]), (doubled[0], *doubled[2:]),
                              strict=True):
            assert torch.equal(a, b), f"{recipe}: d{name} with the hook differs"
    print("ok")


if __name__ == "__main__":
    main()
