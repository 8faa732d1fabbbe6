"""moe_mxfp8's FP8 experts wired into moe_model's weight-gradient kernel, across packages."""

from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter


@pytest.mark.interpreter
def test_fp8_experts_hand_merged_kernel_weight_gradients_to_the_sink():
    run_under_triton_interpreter(Path(__file__).with_name("fp8_later_wgrad_case.py"), timeout=300)
