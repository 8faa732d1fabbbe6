"""Run by test_fused_cross_entropy.py in a subprocess with TRITON_INTERPRET=1 (set before
Triton is imported, and never in the test process itself): the fused cross-entropy
kernels on CPU against ``F.cross_entropy`` on FP32 logits, loss and gradient; and the
public ``lm_loss_sum(..., backend="triton")`` against ``lm_loss_sum_reference``."""

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
        grad = cross_entropy_backward(logits, bad, m, ls, torch.tensor(1.0), config=cfg)
        assert grad[1:3].isnan().all() and grad[[0, 3, 4, 5]].isfinite().all()
    check_public_op(g)
    print("ok")


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
