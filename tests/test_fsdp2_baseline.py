"""tools/fsdp2_baseline.py on two gloo ranks against single-process training.

FSDP2 (``fully_shard`` per block and root, FP32 on CPU) with gradient
accumulation over two microbatches per rank must give the loss and the updated
weights of one process running the same global batch with ``torch.optim.AdamW``:
same model init, data, loss normalisation, optimizer policy (stated literally in
tests/adamw_oracle.py), clipping, LR schedule, router bias step.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from moe_model import MoETransformer, init_weights
from moe_testing import load_script, run_distributed
from pretrain.config import load_config
from pretrain.runtime import distributed

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fsdp2_baseline.py"
ORACLE = Path(__file__).resolve().parent / "adamw_oracle.py"
OVERRIDES = ["data.path=synthetic", "train.global_batch=4", "train.micro_batch=1",
             "train.steps=2", "model.bias_update_rate=0.01", "model.z_loss_coef=0.001",
             "optim.warmup_steps=0", "optim.lr=0.01", "optim.expert_lr_mult=0.5"]


def _tool():
    return load_script(TOOL)


def _fsdp2_steps() -> dict:
    tool = _tool()
    cfg = load_config("tiny", OVERRIDES)
    with distributed("cpu"):
        trainer = tool.build_fsdp2_trainer(cfg, device=torch.device("cpu"))
        losses = [trainer.train_step(s).record["loss"] for s in (1, 2)]
        weights = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
        biases = [layer.router.expert_bias.clone() for _, layer in trainer.model.moe_layers()]
    return {"losses": losses, "weights": weights, "biases": biases}


def _single_process_steps() -> dict:
    """The oracle: one process, the whole global batch, plain torch AdamW (tests/adamw_oracle.py)."""
    return load_script(ORACLE).single_process_steps("tiny", OVERRIDES)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp2_two_ranks_match_single_process_adamw():
    ranks = run_distributed(_fsdp2_steps, 2, timeout=240)
    oracle = _single_process_steps()
    for result in ranks:
        for ours, ref in zip(result["losses"], oracle["losses"], strict=True):
            assert abs(ours - ref) <= 1e-5 * abs(ref)
        assert result["weights"].keys() == oracle["weights"].keys()
        for name, ref in oracle["weights"].items():
            torch.testing.assert_close(result["weights"][name], ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        for ours, ref in zip(result["biases"], oracle["biases"], strict=True):
            assert torch.equal(ours, ref)
    cfg = load_config("tiny", OVERRIDES)
    initial = MoETransformer(cfg.model)
    init_weights(initial, cfg.model, cfg.seed)
    moved = [not torch.equal(p, oracle["weights"][n]) for n, p in initial.named_parameters()]
    assert all(moved)  # two updates reached every parameter


def _fsdp2_bf16_steps() -> list[float]:
    tool = _tool()
    cfg = load_config("tiny", [*OVERRIDES, "train.device=cuda", "model.d_model=128",
                               "model.head_dim=32", "model.expert_hidden=128"])
    with distributed("cuda"):
        trainer = tool.build_fsdp2_trainer(cfg)
        return [trainer.train_step(s).record["loss"] for s in (1, 2)]


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_fsdp2_runs_bf16_over_nccl():
    """The GPU path (BF16 parameters, FP32 reduce, NCCL): finite losses, equal on both ranks."""
    first, second = run_distributed(_fsdp2_bf16_steps, 2, backend="nccl", timeout=240)
    assert first == second and all(math.isfinite(x) for x in first)
