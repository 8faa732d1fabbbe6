"""moe_mxfp8's FP8 experts between moe_model's local dispatcher's gather and combine: the
gather writes the experts' rowwise FP8 input rows and the fused combine backward their
rowwise FP8 output gradient, bit for bit the codes the experts would make, and no output
or gradient changes (interpreter on CPU; bench-1gpu's expert shapes on a GPU)."""

from pathlib import Path

import pytest
import torch
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.interpreter
def test_fp8_experts_take_their_codes_from_the_dispatcher():
    run_under_triton_interpreter(Path(__file__).with_name("_fp8_experts_gradient_rows_interpret_check.py"))


@pytest.mark.gpu
def test_gradient_codes_at_bench_shapes():
    """4096 tokens, top-8 of 64 experts, d_model 2048, hidden 1024, the Triton FP8 GEMMs:
    the codes and scales the gather and the combine write equal ``quantize_fp8``'s of the
    rows and of the gradient (zero and subnormal rows included), and the output and every
    gradient equal those without them (the routing weights' to rounding: see below)."""
    from moe_model import GRADIENT_ROW_ENCODER, INPUT_ROW_ENCODER, LocalDispatcher
    from moe_mxfp8 import FP8GroupedExperts, quantize_fp8
    from torch import nn

    T, D, F, E, k = 4096, 2048, 1024, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (nn.Parameter((torch.randn(E, F, D, device="cuda", generator=g) * 0.02).bfloat16())
              for _ in range(2))
    w2 = nn.Parameter((torch.randn(E, D, F, device="cuda", generator=g) * 0.02).bfloat16())
    layer = FP8GroupedExperts(w1, w3, w2, recipe="fp8_rowwise_gw_hp", gemm="triton",
                              fast_accum=("output", "grad_input"))
    layer.refresh_weight_cache()
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    weights, ids = torch.randn(T, E, device="cuda", generator=g).softmax(-1).topk(k, dim=-1)
    weights[7, 0], weights[8, 1] = 0.0, 1e-39  # a zero row, a row of BF16 subnormals
    weights.requires_grad_()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    disp = LocalDispatcher(E)

    inputs = getattr(layer, INPUT_ROW_ENCODER)

    def grads(plain):
        received = []
        if plain:
            rows, offsets, h = disp.dispatch(x, ids)
        else:
            real_input = inputs.receive
            inputs.receive = lambda *got: (received.append(got), real_input(*got))
            rows, offsets, h = disp.dispatch_encoded(x, ids, None, inputs)
            del inputs.receive
        out = layer(rows, offsets)
        enc = getattr(out, GRADIENT_ROW_ENCODER)
        if plain:
            delattr(out, GRADIENT_ROW_ENCODER)
        real = enc.receive
        enc.receive = lambda *got: (received.append(got), real(*got))
        y = disp.combine(out, weights, h)
        return (y, *torch.autograd.grad(y, (x, weights, w1, w3, w2), dy)), received

    got, received = grads(plain=False)
    assert len(received) == 2  # the rows, then the gradient
    for tensor, codes, scales in received:
        ref = quantize_fp8(tensor, (1, 0), True)
        assert torch.equal(codes, ref.data.view(torch.uint8))
        assert torch.equal(scales, ref.scale)
    amax = received[1][0].float().abs().amax(1)
    assert (amax == 0).any() and ((amax > 0) & (amax < torch.finfo(torch.float32).tiny)).any()
    del received, ref
    want, received = grads(plain=True)
    assert not received
    for name, a, b in zip(("y", "x", "w1", "w3", "w2"), (got[0], got[1], *got[3:]),
                          (want[0], want[1], *want[3:]), strict=True):
        assert torch.equal(a, b), f"{name} differs"
    # the encoding launch runs without FMA contraction: the routing weights' dot products
    # round apart
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5 * want[2].abs().max().item())


@pytest.mark.gpu
def test_gradient_codes_of_adversarial_rows():
    """The combine backward's codes and scales equal ``quantize_fp8``'s of the ``d_rows`` it
    wrote where tokens' gradients hold a NaN, an infinity, zeros only, FP32 extremes, and
    slots weigh zero, a subnormal or infinity (NaN rows from ``inf * 0``)."""
    from moe_model._combine_kernels import combine_backward
    from moe_mxfp8 import quantize_fp8
    from moe_mxfp8.row_codes import RowCodes

    g = torch.Generator(device="cuda").manual_seed(1)
    T, k, D = 64, 8, 2048
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy[1, 5], dy[2, 7], dy[3] = float("nan"), float("inf"), 0.0
    dy[4, 30], dy[5] = 3e38, dy[5] * 1e-36
    w = torch.rand(T * k, device="cuda", generator=g)
    w[6 * k], w[7 * k], w[8 * k], w[9 * k] = 0.0, 1e-39, float("inf"), 1e30
    dy[8, 3] = 0.0
    rows = torch.randn(T * k, D, device="cuda", generator=g).bfloat16()
    row_of_slot = torch.randperm(T * k, device="cuda", generator=g)
    enc = RowCodes(True)
    d_rows, _, codes, scales = combine_backward(dy, rows, row_of_slot, w, None, T * k, encoder=enc)
    ref = quantize_fp8(d_rows, (1, 0), True)
    assert d_rows.float().isnan().any(1).sum() >= 2 and d_rows.float().isinf().any()
    assert torch.equal(codes, ref.data.view(torch.uint8))
    assert torch.equal(scales.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))
