"""Fused (Triton) cross-entropy against ``F.cross_entropy`` on FP32 logits: the kernels
under the Triton interpreter on CPU, the CUDA path at the real vocabulary on a GPU; and
the CPU path of ``lm_loss_sum`` staying the plain ``F.cross_entropy`` call."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from moe_model import IGNORE_INDEX, _triton_support, lm_loss_sum, lm_loss_sum_reference
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


def test_cpu_path_is_the_reference_call():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 11, (2, 5), generator=g)
    targets[0, 1] = IGNORE_INDEX
    loss = lm_loss_sum(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    x = logits.detach().reshape(-1, 11).float().requires_grad_()
    ref = F.cross_entropy(x, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref, x)
    assert torch.equal(loss, ref) and torch.equal(grad, ref_grad.bfloat16().reshape(2, 5, 11))
    targets[1, 2] = 11
    with pytest.raises((IndexError, RuntimeError)):
        lm_loss_sum(logits, targets)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_importing_moe_model_does_not_need_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, moe_model\n"
            "print(float(moe_model.lm_loss_sum(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.interpreter
def test_cross_entropy_kernels_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_cross_entropy_interpret_check.py"))


@pytest.mark.gpu
def test_cuda_path_at_real_vocabulary():
    """V=100352, 8192 BF16 rows (as one microbatch of the 1-GPU preset), against the FP32
    reference; then forward+backward must not synchronise with the host."""
    V, B, S = 100352, 4, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(B, S, V, device="cuda", generator=g) * 2).bfloat16()
    logits[0, 1] += 1e4  # huge
    logits[0, 2] -= 1e4  # very negative
    logits.requires_grad_()
    targets = torch.randint(0, V, (B, S), device="cuda", generator=g)
    targets[:, -7:] = IGNORE_INDEX
    targets[1, 0] = V - 1
    scale = 1.0 / 3000  # grad_out != 1, as the trainer's division by the token count

    loss = lm_loss_sum(logits, targets)
    (grad,) = torch.autograd.grad(loss * scale, logits)
    assert grad.dtype == torch.bfloat16 and grad.shape == logits.shape
    x = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(x.reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="sum")
    (ref_grad,) = torch.autograd.grad(ref * scale, x)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-5, atol=0)
    del x, ref
    # the FP32 gradient rounded to BF16, up to one BF16 step
    torch.testing.assert_close(grad.float(), ref_grad.bfloat16().float(), rtol=2**-7, atol=1e-30)
    assert (grad[:, -7:] == 0).all()
    del grad, ref_grad

    def step():
        (lm_loss_sum(logits, targets) * scale).backward()

    assert_no_host_sync(step)
    assert logits.grad.isfinite().all()


def test_lm_loss_sum_backends():
    def make():
        g = torch.Generator().manual_seed(0)
        logits = torch.randn(2, 5, 11, generator=g).bfloat16().requires_grad_()
        targets = torch.randint(0, 11, (2, 5), generator=g)
        targets[0, 1] = IGNORE_INDEX
        return logits, targets

    check_backend_api(_triton_support, lm_loss_sum, lm_loss_sum_reference, make)
