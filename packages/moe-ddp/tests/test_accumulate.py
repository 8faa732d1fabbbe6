"""The BF16-into-FP32 accumulation kernel: bit for bit ``add_`` (interpreter on CPU; GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_ddp.accumulate import accumulate_
from moe_testing import run_under_triton_interpreter


@pytest.mark.slow
@pytest.mark.interpreter
def test_accumulate_kernel_under_interpreter_is_add():
    run_under_triton_interpreter(Path(__file__).with_name("_accumulate_interpret_check.py"))


def test_size_mismatch_is_refused():
    with pytest.raises(ValueError, match="source elements"):
        accumulate_(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_accumulate_on_gpu_is_add():
    dst = torch.randn(64 * 2**20 + 3, device="cuda")
    src = torch.randn(dst.shape, device="cuda").bfloat16()
    ref = dst.clone().add_(src)
    accumulate_(dst, src)
    torch.testing.assert_close(dst, ref, rtol=0, atol=0)
