"""The BF16-into-FP32 accumulation kernel: bit for bit ``add_`` (interpreter on CPU; GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moe_ddp.accumulate import accumulate_


def test_accumulate_kernel_under_interpreter_is_add():
    script = Path(__file__).with_name("_accumulate_interpret_check.py")
    done = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


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
