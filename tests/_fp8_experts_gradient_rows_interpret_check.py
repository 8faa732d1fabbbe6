"""Run by test_fp8_experts_gradient_rows.py with TRITON_INTERPRET=1: moe_mxfp8's FP8
experts between moe_model's local dispatcher's gather, which writes the experts' rowwise
FP8 input rows, and its combine, whose fused backward writes their rowwise FP8 output
gradient."""

import functools
from unittest import mock

import moe_mxfp8.fp8_experts as fp8_experts
import torch
from moe_model import GRADIENT_ROW_ENCODER, INPUT_ROW_ENCODER, LocalDispatcher, dispatch
from moe_mxfp8 import FP8GroupedExperts
from moe_mxfp8.fp8 import quantize_fp8_reference
from torch import nn

_FUSED = functools.partial(dispatch.combine_backward, backend="triton")
_FUSED_GATHER = functools.partial(dispatch.gather_rows, backend="triton")


def _double_in_place(grad):
    grad.mul_(2.0)


def grads(layer, disp, x, ids, w, dy, strip=False, hook=False, plain_gather=False):
    """Output and gradients of ``x``, the routing weights and the expert weights through
    dispatch -> experts -> combine, the quantisations the layer ran, what the gradient's
    encoder received and the rows' codes the gather handed over; ``strip``: the experts'
    output carries no encoder; ``hook``: a gradient hook on that output doubles its
    gradient in place; ``plain_gather``: the dispatcher is not given the experts' input
    encoder."""
    quantized, received, gathered = [], [], []
    real = fp8_experts.quantize_fp8

    def spy(t, *args):
        quantized.append(t.shape)
        return real(t, *args)

    inputs = getattr(layer, INPUT_ROW_ENCODER)
    real_input_receive = inputs.receive
    inputs.receive = lambda *got: (gathered.append(got), real_input_receive(*got))
    with mock.patch.object(fp8_experts, "quantize_fp8", spy), \
            mock.patch.object(dispatch, "combine_backward", _FUSED), \
            mock.patch.object(dispatch, "gather_rows", _FUSED_GATHER):
        if plain_gather:
            rows, offsets, h = disp.dispatch(x, ids)
        else:
            rows, offsets, h = disp.dispatch_encoded(x, ids, None, inputs)
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
    del inputs.receive
    return (y, *got), quantized, received, gathered


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

        # the codes the gather and the combine hand over are quantize_fp8's of the rows and
        # of the gradient they wrote, and the layer uses them instead of quantizing either
        got, quantized, received, gathered = grads(layer, disp, x, ids, w, dy)
        assert len(received) == 1 and len(gathered) == 1, recipe
        for tensor, codes, scales in (received[0], gathered[0]):
            ref = quantize_fp8_reference(tensor, (1, 0), True)
            assert torch.equal(codes, ref.data.view(torch.uint8)), recipe
            assert torch.equal(scales, ref.scale), recipe
        amax = received[0][0].float().abs().amax(1)
        assert (amax == 0).sum() == 3 and ((amax > 0) & (amax < torch.finfo(torch.float32).tiny)).any(), \
            f"{recipe}: {amax}"
        rows_and_dy = (T * k, D)  # the rows' shape and dy's
        assert quantized.count(rows_and_dy) == 0, f"{recipe}: quantized again: {quantized}"

        # the same output and gradients as the layer quantizing both itself, bit for bit
        want, quantized, received, gathered = grads(layer, disp, x, ids, w, dy, strip=True, plain_gather=True)
        assert quantized.count(rows_and_dy) == 2 and not received and not gathered, quantized
        for name, a, b in zip(("y", "x", "w", "w1", "w3", "w2"), got, want, strict=True):
            assert torch.equal(a, b), f"{recipe}: {name} differs"

        # a hook editing the gradient in place: the codes are stale and not used
        hooked, quantized, received, _ = grads(layer, disp, x, ids, w, dy, hook=True)
        assert len(received) == 1 and quantized.count(rows_and_dy) == 1, quantized
        doubled, _, _, _ = grads(layer, disp, x, ids, w, dy * 2, strip=True)
        for i, name in ((1, "x"), (3, "w1"), (4, "w3"), (5, "w2")):
            assert torch.equal(hooked[i], doubled[i]), f"{recipe}: d{name} with the hook differs"
    print("ok")


if __name__ == "__main__":
    main()
