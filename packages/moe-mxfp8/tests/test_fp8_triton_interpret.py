"""FP8 Triton kernels under TRITON_INTERPRET=1, bit-exact against the torch reference
(the fused SwiGLU kernels: to FP32 rounding of ``exp``).

As test_triton_interpret.py: the cases run in one child process (fp8_triton_cases.py)
so the interpreter setting never reaches this process; each case is its own test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CASES_FILE = Path(__file__).with_name("fp8_triton_cases.py")


@pytest.fixture(scope="module")
def results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(CASES_FILE)], capture_output=True, text=True,
                          env=env, timeout=300, check=False, cwd=CASES_FILE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _case_names() -> list[str]:
    names = []
    for name in ("rows/37x77", "rows/3x20x64", "tiles/40x300", "blocks/2x130x200"):
        for dname in ("f32", "bf16", "f16"):
            names += [f"quantize/{name}/{dname}/pow2={p}" for p in (True, False)]
    for dname in ("f32", "bf16", "f16"):
        names += [f"group_columns/{dname}/pow2={p}" for p in (True, False)]
    return names + [f"{k}/{d}" for k in ("swiglu", "swiglu_quantized") for d in ("f32", "bf16")]


@pytest.mark.parametrize("case", _case_names())
def test_kernel_matches_reference(results, case):
    assert case in results, f"case {case} did not run"
    assert results[case] == 0, results[case]


def test_every_case_is_listed(results):
    assert sorted(results) == sorted(_case_names())
