"""The BF16-into-FP32 accumulation kernel: bit for bit ``add_`` (interpreter on CPU; GPU);
``backend`` picks between it and ``accumulate_reference_``."""

from __future__ import annotations

from pathlib import Path

import moe_ddp
import pytest
import torch
from moe_ddp import use_reference_kernels
from moe_ddp.accumulate import accumulate_, accumulate_reference_
from moe_testing import check_backend_api, run_under_triton_interpreter


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def _operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 50, generator=g), (torch.randn(150, generator=g) * 1e-3).bfloat16()


@pytest.mark.slow
@pytest.mark.interpreter
def test_accumulate_kernel_under_interpreter_is_add():
    run_under_triton_interpreter(Path(__file__).with_name("_accumulate_interpret_check.py"))


def test_reference_is_add():
    dst, src = _operands()
    want = dst + src.view(3, 50).float()
    accumulate_reference_(dst, src)
    assert torch.equal(dst, want)


def test_accumulate_keeps_the_backend_contract():
    check_backend_api(moe_ddp._triton_support, accumulate_, accumulate_reference_, _operands,
                      out=lambda result, args: args[0])  # in place: what it wrote


def test_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="source elements"):
        accumulate_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="source elements"):
        accumulate_reference_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_accumulate_on_gpu_is_add():
    dst = torch.randn(64 * 2**20 + 3, device="cuda")
    src = torch.randn(dst.shape, device="cuda").bfloat16()
    ref = dst.clone().add_(src)
    accumulate_(dst, src)
    torch.testing.assert_close(dst, ref, rtol=0, atol=0)
