"""An FP8 LM head (moe_mxfp8) trained through the fused cross-entropy (moe_model): the
cross-entropy's backward writes the head's rowwise FP8 output gradient, bit for bit the
codes the head would make, and the head's gradients do not change (interpreter on CPU;
the real vocabulary on a GPU)."""

from pathlib import Path

import pytest
import torch
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.interpreter
def test_fp8_head_takes_its_gradient_codes_from_the_cross_entropy():
    run_under_triton_interpreter(Path(__file__).with_name("_fp8_head_loss_interpret_check.py"))


@pytest.mark.gpu
def test_gradient_codes_at_the_real_vocabulary():
    """[8192, 100352] BF16 logits of a bench-1gpu microbatch: the codes and scales the
    cross-entropy writes equal ``quantize_fp8``'s of its gradient (the GPU's ``exp``
    included), and the head's input gradient equals the one without them."""
    from moe_model import GRADIENT_ROW_ENCODER, lm_loss_sum
    from moe_mxfp8 import FP8Linear, quantize_fp8
    from torch import nn

    V, D, M = 100352, 2048, 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    w = nn.Parameter((torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16())
    head = FP8Linear(w, recipe="fp8_rowwise_gw_hp", gemm="triton",
                     fast_accum=("output", "grad_input"))
    x = torch.randn(4, M // 4, D, device="cuda", generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (4, M // 4), device="cuda", generator=g)
    targets[:, -5:] = -100
    targets[1, 7] = V  # out of range: a NaN row, its codes and scale NaN too
    logits = head(x)
    with torch.no_grad():  # sharp rows: p_t rounds to 1, another logit holds the amax
        logits[0, torch.arange(8), targets[0, :8]] = 60.0
    received = []
    enc = getattr(logits, GRADIENT_ROW_ENCODER)
    enc.receive = lambda *got, out=received: out.append(got)
    torch.autograd.grad(lm_loss_sum(logits, targets) / 3000, logits, retain_graph=True)
    grad, codes, scales = received[0]
    ref = quantize_fp8(grad, (1, 0), True)
    assert torch.equal(codes, ref.data.view(torch.uint8))
    assert torch.equal(scales.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0)) and scales.isnan().sum() == 1
    del grad, codes, scales, ref
    received.clear()

    head.weight.requires_grad_(False)
    targets[1, 7] = 0
    (dx,) = torch.autograd.grad(lm_loss_sum(head(x), targets) / 3000, x)
    logits = head(x)
    delattr(logits, GRADIENT_ROW_ENCODER)
    (ref_dx,) = torch.autograd.grad(lm_loss_sum(logits, targets) / 3000, x)
    assert torch.equal(dx, ref_dx)
