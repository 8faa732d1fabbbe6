"""FP8 Triton kernels under TRITON_INTERPRET=1, bit-exact against the torch reference
(the fused SwiGLU kernels: to FP32 rounding of ``exp``); the FP8 row codec's kernels also
at adversarial rows and packed bytes (zeros, max magnitudes, subnormal and non-finite
scales).

As test_triton_interpret.py: the cases run in one child process (fp8_triton_cases.py)
so the interpreter setting never reaches this process; each case is its own test.
"""

import json
from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")

CASES_FILE = Path(__file__).with_name("fp8_triton_cases.py")


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_under_triton_interpreter(CASES_FILE, timeout=300)
    return json.loads(out.strip().splitlines()[-2])


def _case_names() -> list[str]:
    names = []
    for name in ("rows/37x77", "rows/3x20x64", "tiles/40x300", "blocks/2x130x200"):
        for dname in ("f32", "bf16", "f16"):
            names += [f"quantize/{name}/{dname}/pow2={p}" for p in (True, False)]
    for dname in ("f32", "bf16", "f16"):
        names += [f"group_columns/{dname}/pow2={p}" for p in (True, False)]
    names += [f"group_column_blocks/{dname}/pow2={p}" for dname in ("f32", "bf16", "f16")
              for p in (True, False)]
    names += ["group_columns/many_experts", "group_column_blocks/many_experts", "wide_rows"]
    names += [f"weight_{kind}/{dname}" for kind in ("rowwise", "blocks") for dname in ("f32", "bf16", "f16")]
    names += [f"codec/{way}/{dname}" for dname in ("f32", "bf16", "f16") for way in ("encode", "decode")]
    names += [f"row_encoding/{d}/pow2={p}" for d in ("f32", "bf16") for p in (True, False)]
    return names + ["small_tiles", "swiglu_quantized/launch_shapes"] + [
        f"{k}/{d}" for k in ("swiglu", "swiglu_quantized") for d in ("f32", "bf16")]


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("case", _case_names())
def test_kernel_matches_reference(results, case):
    assert case in results, f"case {case} did not run"
    assert results[case] == 0, results[case]


@pytest.mark.slow
@pytest.mark.interpreter
def test_every_case_is_listed(results):
    assert sorted(results) == sorted(_case_names())
