"""The reference switch: ``use_reference_kernels(True)`` sends accumulation to ``add_``."""

import pytest
import torch
from moe_ddp import triton_available, use_reference_kernels
from moe_ddp._triton_support import fused_kernels_enabled, reference_kernels_enabled
from moe_ddp.accumulate import accumulate_

CUDA = torch.device("cuda")  # a device object only: no GPU is touched


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


@pytest.mark.skipif(not triton_available(), reason="needs Triton installed")
def test_switch_sends_cuda_tensors_to_the_reference():
    assert fused_kernels_enabled(CUDA)
    with use_reference_kernels(True):
        assert not fused_kernels_enabled(CUDA)
    assert fused_kernels_enabled(CUDA)
    assert not fused_kernels_enabled(torch.device("cpu"))


def test_switch_overrides_a_forced_kernel():
    dst, src = torch.ones(3, 5), torch.full((15,), 0.5, dtype=torch.bfloat16)
    with use_reference_kernels(True):
        accumulate_(dst, src, fused=True)  # a CPU tensor: the kernel would need the interpreter
    torch.testing.assert_close(dst, torch.full((3, 5), 1.5), rtol=0, atol=0)


def test_call_form_holds_and_context_form_restores():
    use_reference_kernels(True)
    with use_reference_kernels(False):
        assert not reference_kernels_enabled()
    assert reference_kernels_enabled()
    use_reference_kernels(False)
    assert not reference_kernels_enabled()


@pytest.mark.gpu
def test_on_gpu_the_switch_launches_no_triton_kernel_and_matches_the_kernel():
    import moe_ddp
    from moe_testing import launched_triton_kernels

    src = torch.randn(64, 300, device="cuda").bfloat16()
    dst = {tag: torch.randn(64, 300, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
           for tag in ("fused", "reference")}
    assert launched_triton_kernels(lambda: accumulate_(dst["fused"], src), moe_ddp)
    with use_reference_kernels(True):
        launched = launched_triton_kernels(lambda: accumulate_(dst["reference"], src), moe_ddp)
    assert not launched, sorted(launched)
    assert torch.equal(dst["reference"], dst["fused"])
