"""The FP8 grouped GEMM kernels (``gemm="triton"``) under TRITON_INTERPRET=1 against the
emulated GEMM, alone (adding into its output, storing through TMA; the blockwise weight
gradients over tokens) and inside ``FP8GroupedExperts``,
``FP8Linear`` and ``FP8Linear.shared_input_forward`` for every FP8 recipe (outputs, input
and weight gradients); refusals on CPU.

The cases run in one child process (fp8_gemm_triton_cases.py) so the interpreter setting
never reaches this process; each case is its own test.
"""

import json
from pathlib import Path

import pytest
import torch
from moe_mxfp8 import FP8GroupedExperts, MXFP8Config, fp8_triton_available, quantize_fp8
from moe_mxfp8.fp8_gemm import FP8TileConfig, fp8_grouped_mm, triton_grouped_mm
from moe_testing import run_under_triton_interpreter
from torch import nn

pytest.importorskip("triton")

CASES_FILE = Path(__file__).with_name("fp8_gemm_triton_cases.py")
CASES = ([f"gemm/{kind}/{shape}/fast={fast}" for kind in ("rowwise", "blockwise")
          for shape in ("K200xN144", "K160xN128") for fast in (False, True)]
         + ["gemm/blockwise/k_step32", "gemm/blockwise/wide_tile", "gemm/rowwise/accumulate", "gemm/tma_store",
            "wgrad/blockwise"]
         + [f"{kind}/{r}" for kind in ("layer", "linear", "shared")
            for r in ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "fp8_blockwise_gw_fp8")])


@pytest.fixture(scope="module")
def results() -> dict:
    out = run_under_triton_interpreter(CASES_FILE, timeout=400)
    return json.loads(out.strip().splitlines()[-2])


@pytest.mark.slow
@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_triton_gemm_matches_the_emulation(results, case):
    assert case in results, f"case {case} did not run"
    assert results[case] == 0, results[case]


@pytest.mark.slow
@pytest.mark.interpreter
def test_every_case_is_listed(results):
    assert sorted(results) == sorted(CASES)


def test_triton_gemm_refusals():
    a = quantize_fp8(torch.randn(8, 32), (1, 128), pow2=False)
    b_rows = quantize_fp8(torch.randn(2, 16, 32))
    offsets = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="rowwise .* or blockwise"):
        fp8_grouped_mm(a, b_rows, offsets, torch.float32, "emulated", False)
    b_blocks = quantize_fp8(torch.randn(2, 16, 32), (128, 128), pow2=False)
    with pytest.raises(ValueError, match="rowwise scales only"):
        fp8_grouped_mm(a, b_blocks, offsets, torch.float32, "native", False)
    with pytest.raises(ValueError, match="gemm must be one of"):
        fp8_grouped_mm(a, b_blocks, offsets, torch.float32, "cutlass", False)
    with pytest.raises(ValueError, match="K step dividing 128"):
        triton_grouped_mm(a, b_blocks, offsets, torch.float32, False,
                          FP8TileConfig(16, 16, 48, 1, 1, 1, False))
    with pytest.raises(ValueError, match="offsets must be int32"):
        triton_grouped_mm(a, b_blocks, offsets.long(), torch.float32, False)


def test_tiles_the_gpu_cannot_hold_are_named(monkeypatch):
    """Triton knows a tile's shared memory only once compiled and refuses it at the launch;
    the error names the FP8TileConfig (a stand-in launch raises Triton's refusal here; the
    GPU test compiles real oversized tiles)."""
    import moe_mxfp8._fp8_gemm_kernels as kernels
    from triton.runtime.errors import OutOfResources

    class Refused:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(294912, 232448, "shared memory")
            return launch

    monkeypatch.setattr(kernels, "fp8_rows_kernel", Refused())
    a = quantize_fp8(torch.randn(8, 32))
    b = quantize_fp8(torch.randn(2, 16, 32))
    tiles = FP8TileConfig(256, 256, 128, 8, 8, 6, False)
    with pytest.raises(ValueError, match=r"tiles FP8TileConfig\(block_m=256, .* need shared memory 294912, "
                                         r"this GPU allows 232448: pass a smaller FP8TileConfig"):
        triton_grouped_mm(a, b, torch.tensor([4, 8], dtype=torch.int32), torch.bfloat16, False, tiles)


def test_triton_gemm_is_a_config_choice_for_every_fp8_recipe(monkeypatch):
    for recipe in ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise"):
        MXFP8Config(recipe=recipe, gemm="triton")
    with pytest.raises(ValueError, match="gemm must be one of .* for recipe mxfp8"):
        MXFP8Config(recipe="mxfp8", gemm="triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not fp8_triton_available(torch.device("cpu"))
    w = [nn.Parameter(torch.randn(2, 16, 32)) for _ in range(2)] + [nn.Parameter(torch.randn(2, 32, 16))]
    layer = FP8GroupedExperts(*w, recipe="fp8_blockwise", gemm="triton")
    with pytest.raises(RuntimeError, match="gemm='triton' needs Triton and a CUDA device"):
        layer(torch.randn(4, 32), torch.tensor([2, 4], dtype=torch.int32))
