"""Run by test_fused_cross_entropy.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported, and never in the test process itself): the fused cross-entropy
kernels on CPU against ``F.cross_entropy`` on FP32 logits, loss and gradient; the
public ``lm_loss_sum(..., backend="triton")`` against ``lm_loss_sum_reference``; and a
``RowEncoder`` served by the backward against the gradient it writes."""

import torch
import torch.nn.functional as F
from moe_model._cross_entropy_kernels import (
    IGNORE_INDEX,
    CrossEntropyConfig,
    cross_entropy_backward,
    cross_entropy_forward,
    fused_cross_entropy_sum,
)
from moe_model.loss import lm_loss_sum, lm_loss_sum_reference
from moe_model.row_encoding import GRADIENT_ROW_ENCODER
from sign_peak_encoder import SignPeakEncoder, expected_codes


def reference(logits, targets, scale):
    x = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(x, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (grad,) = torch.autograd.grad(loss * scale, x)
    return loss.detach(), grad


def make_case(g, N, V, dtype):
    logits = torch.randn(N, V, generator=g) * 3
    logits[1] = logits[1] * 0.1 + 1e4  # huge: lse ~1e4, FP32 ulp ~1e-3 there
    logits[2] = logits[2] * 0.1 - 1e4  # very negative
    logits[3, : V // 2] = float("-inf")  # masked logits, whole first chunk -inf
    targets = torch.randint(0, V, (N,), generator=g)
    targets[0] = targets[5] = IGNORE_INDEX
    targets[3] = V - 1  # in the tail chunk, not -inf
    targets[4] = 0
    return logits.to(dtype).requires_grad_(), targets


def main():
    g = torch.Generator().manual_seed(0)
    # V=100, BLOCK_V=32: several chunks and a partial tail; 64/64: one full chunk; 37/128: one partial
    cases = ((torch.float32, 100, 32), (torch.bfloat16, 100, 32), (torch.float32, 64, 64),
             (torch.bfloat16, 37, 128))
    for dtype, V, block_v in cases:
        cfg = CrossEntropyConfig(block_v=block_v, num_warps=1)
        tag = f"{dtype} V={V} BLOCK_V={block_v}"
        logits, targets = make_case(g, 7, V, dtype)
        scale = 0.37  # grad_out != 1
        ref_loss, ref_grad = reference(logits, targets, scale)
        loss = fused_cross_entropy_sum(logits, targets, config=cfg)
        (grad,) = torch.autograd.grad(loss * scale, logits)
        assert loss.dtype == torch.float32 and grad.dtype == dtype, tag
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0,
                                   msg=lambda m, t=tag: f"loss {t}: {m}")
        if dtype == torch.float32:
            torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12,
                                       msg=lambda m, t=tag: f"grad {t}: {m}")
        else:  # the FP32 reference gradient rounded to BF16, up to one BF16 step
            torch.testing.assert_close(grad.float(), ref_grad.bfloat16().float(),
                                       rtol=2**-7, atol=1e-30,
                                       msg=lambda m, t=tag: f"grad {t}: {m}")
        assert (grad[0] == 0).all() and (grad[5] == 0).all(), f"ignored rows {tag}"
        # per-row losses as in F.cross_entropy(reduction="none")
        with torch.no_grad():
            rows, _, _ = cross_entropy_forward(logits, targets, config=cfg)
            ref_rows = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX,
                                       reduction="none")
            torch.testing.assert_close(rows, ref_rows, rtol=1e-6, atol=1e-6,
                                       msg=lambda m, t=tag: f"row losses {t}: {m}")

    # a non-contiguous (row-strided) view of the logits, and every row ignored
    logits = torch.randn(6, 80, generator=g)[:, :50].requires_grad_()
    targets = torch.randint(0, 50, (6,), generator=g)
    cfg = CrossEntropyConfig(block_v=16, num_warps=1)
    ref_loss, ref_grad = reference(logits, targets, 1.0)
    loss = fused_cross_entropy_sum(logits, targets, config=cfg)
    (grad,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12)
    ignored = torch.full((6,), IGNORE_INDEX)
    loss = fused_cross_entropy_sum(logits, ignored, config=cfg)
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.item() == 0 and (grad == 0).all(), "all rows ignored"

    # out-of-range ids: NaN loss and gradient row, no out-of-bounds read
    with torch.no_grad():
        bad = targets.clone()
        bad[1], bad[2] = 50, -3
        rows, m, ls = cross_entropy_forward(logits, bad, config=cfg)
        assert rows[1].isnan() and rows[2].isnan() and rows[[0, 3, 4, 5]].isfinite().all()
        grad, codes, scales = cross_entropy_backward(logits, bad, m, ls, torch.tensor(1.0), config=cfg)
        assert grad[1:3].isnan().all() and grad[[0, 3, 4, 5]].isfinite().all()
        assert codes is None and scales is None
    check_public_op(g)
    check_gradient_row_encoder(g)
    print("ok")


def check_gradient_row_encoder(g):
    """The scales the backward writes are the amax of the stored gradient rows, bit for
    bit, whichever element holds it: the target's (ordinary rows), another logit's (the
    target holds nearly all the mass, so ``p_t - 1`` rounds to 0; the target is the
    largest logit by a hair), zero for ignored rows, NaN for an out-of-range target; the
    gradient is the one written without an encoder; ``lm_loss_sum`` serves the logits'
    ``GRADIENT_ROW_ENCODER`` and only on exactly that tensor."""
    for dtype, V, block_v in ((torch.bfloat16, 100, 32), (torch.float32, 37, 16)):
        cfg = CrossEntropyConfig(block_v=block_v, num_warps=1)
        tag = f"{dtype} V={V}"
        logits, targets = make_case(g, 12, V, dtype)
        with torch.no_grad():
            logits[6, targets[6]] = 60.0  # p_t rounds to 1: another logit holds the amax
            logits[7] = torch.linspace(-1, 1, V, dtype=dtype)
            targets[7] = V - 1  # the largest logit, the next one a hair below
            logits[8] = 0.0
            logits[8, targets[8]] = 40.0  # and every other logit holds the amax
            targets[9] = V  # out of range: NaN row and scale
        enc = SignPeakEncoder()
        loss = fused_cross_entropy_sum(logits, targets, config=cfg, encoder=enc)
        (grad,) = torch.autograd.grad(loss * 0.37, logits)
        plain = fused_cross_entropy_sum(logits, targets, config=cfg)
        (plain_grad,) = torch.autograd.grad(plain * 0.37, logits)
        assert torch.equal(grad[:9], plain_grad[:9]) and loss.isnan() and plain.isnan(), tag
        assert len(enc.received) == 1, tag
        got_grad, codes, scales = enc.received[0]
        assert got_grad is grad and codes.dtype == torch.uint8 and scales.shape == (12, 1), tag
        amax, code = expected_codes(grad)
        finite = torch.ones(12, dtype=torch.bool)
        finite[9] = False
        assert torch.equal(scales[finite], amax[finite]), f"{tag}: {scales.flatten()} vs {amax.flatten()}"
        assert torch.equal(codes[finite], code[finite]), tag
        assert scales[9].isnan() and (scales[[0, 5]] == 0).all() and (codes[[0, 5]] == 0).all(), tag
        assert grad[6, targets[6]] == 0 and amax[6] > 0, f"{tag}: the other logit's amax case"
        assert (codes[8] == 3).sum() == V - 1, tag

    # through lm_loss_sum: the attribute on the logits it is given, nothing on a copy
    logits, targets = make_case(g, 8, 100, torch.bfloat16)
    logits_BSV = logits.detach().view(2, 4, 100).requires_grad_()
    enc = SignPeakEncoder()
    setattr(logits_BSV, GRADIENT_ROW_ENCODER, enc)
    (grad,) = torch.autograd.grad(lm_loss_sum(logits_BSV, targets.view(2, 4), backend="triton"), logits_BSV)
    assert len(enc.received) == 1 and enc.received[0][0].data_ptr() == grad.data_ptr()
    assert torch.equal(enc.received[0][2], expected_codes(grad.view(8, 100))[0])
    lm_loss_sum(logits_BSV * 1, targets.view(2, 4), backend="triton").backward()
    assert len(enc.received) == 1, "a tensor computed from the logits carries no encoder"


def check_public_op(g):
    """``lm_loss_sum(..., backend="triton")`` (default tiles, [B, S, V] logits) against
    ``lm_loss_sum_reference``, with the tolerances above."""
    for dtype in (torch.float32, torch.bfloat16):
        logits, targets = make_case(g, 8, 100, dtype)
        logits_BSV, targets_BS = logits.detach().view(2, 4, 100).requires_grad_(), targets.view(2, 4)
        loss = lm_loss_sum(logits_BSV, targets_BS, backend="triton")
        assert loss.grad_fn.name() == "_FusedCrossEntropySumBackward", loss.grad_fn.name()
        (grad,) = torch.autograd.grad(loss, logits_BSV)
        ref = lm_loss_sum_reference(logits_BSV, targets_BS)
        (ref_grad,) = torch.autograd.grad(ref, logits_BSV)
        torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-6, atol=0)
        if dtype == torch.float32:
            torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-12)
        else:  # the reference's BF16 gradient is the FP32 one rounded: up to one BF16 step
            torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-30)


if __name__ == "__main__":
    main()
