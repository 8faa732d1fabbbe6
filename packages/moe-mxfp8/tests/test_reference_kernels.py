"""The reference switch: ``use_reference_kernels(True)`` sends every op to its eager path."""

import moe_mxfp8
import pytest
import torch
from moe_mxfp8 import quantize, use_reference_kernels
from moe_mxfp8._triton_support import reference_kernels_enabled
from moe_mxfp8.format import uses_triton
from moe_testing import check_reference_switch


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_mxfp8._triton_support)


def test_switch_overrides_an_explicit_triton_backend():
    t = torch.zeros(4, 32)
    assert uses_triton(t, "triton")
    with use_reference_kernels(True):
        assert not uses_triton(t, "triton")
        assert not uses_triton(t, "auto")
        # the call takes the reference: no Triton interpreter is needed on CPU
        x = torch.randn(4, 32)
        got = quantize(x, axis=-1, backend="triton")
    want = quantize(x, axis=-1, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not reference_kernels_enabled()


@pytest.mark.gpu
def test_on_gpu_the_switch_launches_no_triton_kernel_and_matches_the_kernels():
    import moe_mxfp8
    from moe_mxfp8 import quantize_fp8
    from moe_testing import launched_triton_kernels

    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    out = {}

    def run(tag: str) -> None:
        out[tag] = (*quantize(x, axis=-1), *quantize(x, axis=-2), quantize_fp8(x).data)

    assert launched_triton_kernels(lambda: run("fused"), moe_mxfp8)
    with use_reference_kernels(True):
        launched = launched_triton_kernels(lambda: run("reference"), moe_mxfp8)
    assert not launched, sorted(launched)
    for got, want in zip(out["reference"], out["fused"], strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
