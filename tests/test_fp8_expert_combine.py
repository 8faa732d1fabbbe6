"""FP8 routed experts (moe_mxfp8) under moe_model's local dispatcher: the fused combine's
backward writes the experts' rowwise FP8 output gradient, bit for bit the codes the
experts would make, and no gradient changes (interpreter on CPU; bench-1gpu's shapes on
a GPU)."""

from pathlib import Path

import pytest
import torch
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.interpreter
def test_fp8_experts_take_their_gradient_codes_from_the_combine():
    run_under_triton_interpreter(Path(__file__).with_name("_fp8_expert_combine_interpret_check.py"))


@pytest.mark.gpu
def test_gradient_codes_at_bench_shapes():
    """8192 tokens, top-8 of 64 experts, d_model 2048 (one bench-1gpu microbatch's layer):
    the codes and scales the combine writes equal ``quantize_fp8``'s of the gradient (with
    a zero token, a subnormal one, a huge element), and every gradient equals the one
    computed without them: bit for bit, but for the routing weights' (the combine kernel
    runs without FMA contraction when it writes codes, and sums over D in its own order)."""
    from moe_model import GRADIENT_ROW_ENCODER, LocalDispatcher
    from moe_mxfp8 import FP8GroupedExperts, quantize_fp8
    from torch import nn

    T, D, F, E, k = 8192, 2048, 1024, 64, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w3 = (nn.Parameter((torch.randn(E, F, D, device="cuda", generator=g) * 0.02).bfloat16())
              for _ in range(2))
    w2 = nn.Parameter((torch.randn(E, D, F, device="cuda", generator=g) * 0.02).bfloat16())
    layer = FP8GroupedExperts(w1, w3, w2, recipe="fp8_rowwise_gw_hp", gemm="triton",
                              fast_accum=("output", "grad_input"))
    disp = LocalDispatcher(E, None)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices
    w = torch.rand(T, k, device="cuda", generator=g).softmax(1).requires_grad_()
    dy = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    dy[3] = 0.0
    dy[4] = dy[4] * 1e-39  # subnormal
    dy[5, 9] = -1e30

    def run(strip: bool):
        rows, offsets, h = disp.dispatch(x, ids)
        out = layer(rows, offsets)
        received = []
        if strip:
            delattr(out, GRADIENT_ROW_ENCODER)
        else:
            enc = getattr(out, GRADIENT_ROW_ENCODER)
            real = enc.receive
            enc.receive = lambda *got: (received.append(got), real(*got))
        y = disp.combine(out, w, h)
        grads = torch.autograd.grad(y, (x, w, w1, w3, w2), dy)
        return grads, received

    grads, received = run(strip=False)
    d_rows, codes, scales = received[0]
    ref = quantize_fp8(d_rows, (1, 0), True)
    assert torch.equal(codes, ref.data.view(torch.uint8))
    assert torch.equal(scales, ref.scale)
    del d_rows, codes, scales, ref, received
    want, _ = run(strip=True)
    for name, a, b in zip(("x", "w", "w1", "w3", "w2"), grads, want, strict=True):
        if name == "w":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())
        else:
            assert torch.equal(a, b), name
