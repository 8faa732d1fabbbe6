"""The fused SwiGLU kernels: under the Triton interpreter on CPU, and on a GPU at the
bench-1gpu expert shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import _triton_support
from moe_model.layers import swiglu, swiglu_reference
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_fused_swiglu_under_interpreter_matches_fp32_and_eager():
    run_under_triton_interpreter(Path(__file__).with_name("_swiglu_interpret_check.py"))


def test_cpu_inputs_take_the_eager_path():
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    out = swiglu(g, u)
    assert out.grad_fn.name() == swiglu_reference(g, u).grad_fn.name()


@pytest.mark.gpu
def test_fused_swiglu_on_gpu_matches_fp32_without_host_sync():
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (65536, 1024)
    g = (torch.randn(shape, device="cuda", generator=gen) * 3).bfloat16().requires_grad_(True)
    u = torch.randn(shape, device="cuda", generator=gen).bfloat16().requires_grad_(True)
    dh = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    results = {}

    def step():
        out = swiglu(g, u)
        results["out"] = out
        results["grads"] = torch.autograd.grad(out, (g, u), dh)

    assert_no_host_sync(step)
    assert results["out"].grad_fn.name() == "FusedSwiGLUBackward"
    g32, u32, dh32 = g.detach().float(), u.detach().float(), dh.float()
    s = torch.sigmoid(g32)
    exact = (g32 * s * u32, dh32 * u32 * s * (1 + g32 * (1 - s)), dh32 * g32 * s)
    # one round-to-nearest of the FP32 values: within half a BF16 step (2**-9 relative),
    # plus slack for the GPU's exp differing from the CPU's in the last FP32 bits
    for got, want in zip((results["out"], *results["grads"]), exact, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("bounded", [False, True])
def test_swiglu_backends(bounded):
    def make():
        g = torch.Generator().manual_seed(0)
        gate = (torch.randn(9, 24, generator=g) * 3).bfloat16().requires_grad_()
        up = torch.randn(9, 24, generator=g).bfloat16().requires_grad_()
        return (gate, up, torch.tensor([5])) if bounded else (gate, up)

    check_backend_api(_triton_support, swiglu, swiglu_reference, make)
