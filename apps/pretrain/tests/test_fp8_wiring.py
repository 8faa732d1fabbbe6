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


def _train_low_precision(recipe: str, steps: int) -> tuple[list[float], dict, dict]:
    """Losses, expert parameters and main weights of ``steps`` steps of a BF16-compute tiny
    model whose experts are low-precision (``recipe``), on one CPU process."""
    import torch
    from pretrain.config import load_config, validate_layout
    from pretrain.mesh import build_mesh
    from pretrain.runtime import distributed
    from pretrain.trainer import Trainer

    cfg = load_config("tiny", ["mxfp8.targets=[experts]", f"mxfp8.recipe={recipe}",
                               "model.expert_hidden=192", "train.compute_dtype=bfloat16"])
    with distributed("cpu"):
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
        losses = [trainer.train_step(step).record["loss"] for step in range(1, steps + 1)]
        experts = {n: p for n, p in trainer.model.named_parameters() if ".experts." in n}
        mains = {k.removeprefix("main/"): s.local.clone()
                 for k, s in trainer.optimizer.sharded_state().items() if k.startswith("main/")}
        trainer.close()
    return losses, experts, mains


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "fp8_blockwise_gw_fp8", "mxfp8"])
def test_low_precision_experts_are_their_own_fp32_main_weights_and_train_the_same(recipe, monkeypatch):
    """On one rank the low-precision experts' weights stay FP32 and are the optimizer's main
    weights (no BF16 copy beside them), and train bit for bit as BF16 expert weights
    rebuilt from separate main weights do: the caches derive from the same BF16 values."""
    import pretrain.build
    import torch

    losses, experts, mains = _train_low_precision(recipe, 3)
    assert experts and all(p.dtype == torch.float32 for p in experts.values())
    monkeypatch.setattr(pretrain.build, "expert_weight_in_fp32", lambda *args: False)
    bf16_losses, bf16_experts, bf16_mains = _train_low_precision(recipe, 3)
    assert all(p.dtype == torch.bfloat16 for p in bf16_experts.values())
    assert losses == bf16_losses
    assert mains.keys() == bf16_mains.keys()
    for name in mains:
        assert torch.equal(mains[name], bf16_mains[name]), name
    for name, p in experts.items():
        assert torch.equal(p.detach().view(-1), mains[name]), name


def test_which_expert_weights_stay_fp32():
    """Targeted experts whose main weight the rank holds whole: not when the optimizer shards
    it over two EP-DP replicas, and never a dense weight or an untargeted expert layer."""
    from pretrain.optimizer import MIN_SHARD_NUMEL, expert_weight_in_fp32

    big, small = 64 * MIN_SHARD_NUMEL, MIN_SHARD_NUMEL // 2
    assert expert_weight_in_fp32("blocks.1.mlp.experts.w1", big, ("experts",), 1)
    assert not expert_weight_in_fp32("blocks.1.mlp.experts.w1", big, ("experts",), 2)
    assert expert_weight_in_fp32("blocks.1.mlp.experts.w1", small, ("experts",), 2)  # replicated
    assert not expert_weight_in_fp32("blocks.1.attn.wq.weight", big, ("experts", "attn.w?"), 1)
    assert not expert_weight_in_fp32("blocks.1.mlp.experts.w2", big, ("blocks.0.*",), 1)
    assert not expert_weight_in_fp32("blocks.1.mlp.experts.w2", big, (), 1)
