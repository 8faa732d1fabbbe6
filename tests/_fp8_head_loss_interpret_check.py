"""Run by test_fp8_head_loss.py with TRITON_INTERPRET=1: moe_mxfp8's FP8 head feeding
moe_model's fused cross-entropy, whose backward writes the head's rowwise FP8 ``dy``."""

from unittest import mock

import moe_mxfp8.fp8_linear as fp8_linear
import torch
from moe_model import GRADIENT_ROW_ENCODER, lm_loss_sum
from moe_mxfp8 import FP8Linear
from moe_mxfp8.fp8 import quantize_fp8_reference
from torch import nn


def _halve_in_place(grad):
    grad.mul_(0.5)


def grads(layer, x, targets, extra=False, strip=False, hook=False):
    """Input and weight gradients of ``lm_loss_sum(layer(x)) * 0.3``, and the row
    quantisations the layer ran; ``extra``: the logits also feed a second term;
    ``strip``: the layer's output carries no encoder; ``hook``: a gradient hook on the
    logits halves their gradient in place."""
    quantized = []
    real = fp8_linear.quantize_fp8

    def spy(t, *args):
        quantized.append(t.shape)
        return real(t, *args)

    with mock.patch.object(fp8_linear, "quantize_fp8", spy):
        logits = layer(x)
        if strip:
            delattr(logits, GRADIENT_ROW_ENCODER)
        if hook:
            logits.register_hook(_halve_in_place)
        loss = lm_loss_sum(logits, targets, backend="triton") * 0.3
        if extra:
            loss = loss + logits.float().square().sum() * 1e-3
        dx, dw = torch.autograd.grad(loss, (x, layer.weight))
    return dx, dw, quantized


def main():
    g = torch.Generator().manual_seed(0)
    V, D = 96, 32
    for recipe in ("fp8_rowwise_gw_hp", "fp8_rowwise"):
        w = nn.Parameter((torch.randn(V, D, generator=g) * 0.2).bfloat16())
        layer = FP8Linear(w, recipe=recipe)
        x = torch.randn(2, 6, D, generator=g).bfloat16().requires_grad_()
        targets = torch.randint(0, V, (2, 6), generator=g)
        targets[0, 2] = -100

        # the codes the cross-entropy hands over are quantize_fp8's of the gradient it wrote
        logits = layer(x)
        enc = getattr(logits, GRADIENT_ROW_ENCODER)
        received = []
        enc.receive = lambda *got, out=received: out.append(got)
        torch.autograd.grad(lm_loss_sum(logits, targets, backend="triton"), logits)
        grad, codes, scales = received[0]
        ref = quantize_fp8_reference(grad, (1, 0), True)
        assert torch.equal(codes, ref.data.view(torch.uint8)), recipe
        assert torch.equal(scales, ref.scale), recipe

        # the layer uses them instead of quantizing dy, and its gradients are unchanged
        dx, dw, quantized = grads(layer, x, targets)
        ref_dx, ref_dw, ref_quantized = grads(layer, x, targets, strip=True)
        assert torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw), recipe
        assert (12, V) in ref_quantized and (12, V) not in quantized, (recipe, quantized)
        # logits that also feed another term: the gradient the layer gets is a sum, so the
        # cross-entropy's codes are not used
        dx, dw, quantized = grads(layer, x, targets, extra=True)
        ref_dx, ref_dw, _ = grads(layer, x, targets, extra=True, strip=True)
        assert torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw), recipe
        assert (12, V) in quantized, (recipe, quantized)
        # a hook that edits the gradient in place makes the codes stale: not used either
        dx, dw, quantized = grads(layer, x, targets, hook=True)
        ref_dx, ref_dw, _ = grads(layer, x, targets, hook=True, strip=True)
        assert torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw), recipe
        assert not torch.equal(dx, grads(layer, x, targets)[0]), recipe  # the hook took effect
        assert (12, V) in quantized, (recipe, quantized)
    assert fp8_linear.GRADIENT_ROW_ENCODER == GRADIENT_ROW_ENCODER
    print("ok")


if __name__ == "__main__":
    main()
