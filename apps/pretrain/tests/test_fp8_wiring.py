"""moe_mxfp8's FP8 experts wired into moe_model's weight-gradient kernel, across packages;
the app's note on eager FP8 layers."""

from pathlib import Path

import pytest
from moe_testing import run_under_triton_interpreter


@pytest.mark.interpreter
def test_fp8_experts_hand_merged_kernel_weight_gradients_to_the_sink():
    run_under_triton_interpreter(Path(__file__).with_name("fp8_later_wgrad_case.py"), timeout=300)


FP8 = ["mxfp8.targets=[experts,attn.w?,head]", "mxfp8.recipe=fp8_rowwise_gw_hp", "mxfp8.gemm=triton",
       "mxfp8.dense_gemm=native"]


@pytest.mark.parametrize(("overrides", "device", "noted"), [
    (FP8, "cuda", True),
    (FP8 + ["train.cuda_graphs=true"], "cuda", False),  # replayed already
    (FP8, "cpu", False),  # no graphs on a CPU
    (FP8 + ["parallel.pp=2"], "cuda", False),  # a layout that cannot replay its steps
    (["mxfp8.targets=[experts]", "mxfp8.recipe=fp8_rowwise"], "cuda", False),  # emulated GEMMs: no graphs
    (["mxfp8.targets=[experts]", "mxfp8.recipe=mxfp8"], "cuda", False),
    ([], "cuda", False),
])
def test_eager_fp8_layers_on_a_gpu_get_a_note_naming_cuda_graphs(overrides, device, noted):
    import torch
    from pretrain.config import load_config
    from pretrain.train import fp8_eager_note

    note = fp8_eager_note(load_config("tiny", overrides), torch.device(device))
    if noted:
        assert note == ("note: mxfp8.recipe=fp8_rowwise_gw_hp launches many small kernels; replaying the step "
                        "from CUDA graphs (train.cuda_graphs=true) hides their launch cost")
    else:
        assert note is None
