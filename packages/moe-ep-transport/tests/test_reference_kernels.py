"""The reference switch: ``use_reference_kernels(True)`` sends ``ops`` to its PyTorch path."""

import pytest
import torch
from moe_ep_transport import triton_available, use_reference_kernels
from moe_ep_transport._triton_support import fused_kernels_enabled, reference_kernels_enabled

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


def test_call_form_holds_and_context_form_restores():
    use_reference_kernels(True)
    with use_reference_kernels(False):
        assert not reference_kernels_enabled()
    assert reference_kernels_enabled()
    use_reference_kernels(False)
    assert not reference_kernels_enabled()
