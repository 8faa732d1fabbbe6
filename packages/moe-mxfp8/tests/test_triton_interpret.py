"""Triton kernels under TRITON_INTERPRET=1, bit-exact against the torch reference.

The cases run in one child process (triton_cases.py) so the interpreter setting
never reaches this process; each case is reported as its own test.
"""

import json
from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter

pytest.importorskip("triton")

CASES_FILE = Path(__file__).with_name("triton_cases.py")


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_under_triton_interpreter(CASES_FILE, timeout=300)
    return json.loads(out.strip().splitlines()[-2])


def _case_names() -> list[str]:
    names = []
    shapes = {"37x77": 2, "5x3x45": 3, "3x33x65": 3, "64x96": 2}
    for sname, ndim in shapes.items():
        for dname in ("f32", "bf16", "f16"):
            for axis in range(ndim):
                names += [f"quantize/{sname}/{dname}/axis{axis}",
                          f"dequantize/{sname}/{dname}/axis{axis}"]
            names += [f"both/{sname}/{dname}", f"quantize_dequantize/{sname}/{dname}"]
    # Non-default launch shapes (triton_cases.TILE_CASES): steps, stages, warps, cut tiles.
    tiles = [f"tiles/{kind}/{i}" for i, kind in enumerate(["rows", "rows", "cols", "cols", "both", "both"])]
    return names + ["block_size_16", "codec", "empty"] + tiles


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
