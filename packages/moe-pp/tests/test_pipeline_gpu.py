"""On two GPUs with NCCL: the pipelined step equals the unsplit model, and does not sync the host.

NCCL runs a rank pair's sends and receives first in, first out, so this is where
a message-order mistake would deadlock (gloo matches by tag and would not show
it). The run_distributed timeout turns a deadlock into a failure.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, lm_loss_sum, wire_model
from moe_pp import SCHEDULES, PipelineConfig, build_pipeline
from moe_testing import run_distributed
from torch import nn

CFG = dict(vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
           n_experts=8, top_k=2, expert_hidden=64, lb_loss_coef=0.1)
MICRO_BATCH, SEQ, N_MICRO = 2, 32, 4
TOL = 1e-5


def _batch(device: torch.device):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, CFG["vocab_size"], (N_MICRO * MICRO_BATCH, SEQ + 1), generator=g)
    tokens = tokens.to(device)
    chunks = tokens.split(MICRO_BATCH)
    return [c[:, :-1] for c in chunks], [c[:, 1:] for c in chunks], tokens[:, 1:].numel()


def _model(device: torch.device, n_global: int) -> MoETransformer:
    cfg = MoEConfig(**CFG)
    model = MoETransformer(cfg).to(device)
    init_weights(model, cfg, seed=1)
    wire_model(model, ModelWiring(aux_loss_scale=1.0 / n_global))
    return model


def _equivalence_on_gpus() -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    inputs, targets, n_global = _batch(device)
    oracle = _model(device, n_global)
    for x, y in zip(inputs, targets, strict=True):
        (lm_loss_sum(oracle(x), y) / n_global).backward()
    ref = {n: p.grad for n, p in oracle.named_parameters()}
    worst = {}
    for virtual, schedule in itertools.product((1, 2), SCHEDULES):
        pipe = build_pipeline(
            _model(device, n_global), PipelineConfig(schedule=schedule, virtual_stages=virtual),
            N_MICRO, loss_fn=lm_loss_sum, activation_shape=(MICRO_BATCH, SEQ, CFG["d_model"]),
            activation_dtype=torch.float32,
        )
        pipe.step(inputs, targets, loss_scale=1.0 / n_global)
        worst[f"{schedule}/v{virtual}"] = max(
            ((p.grad - ref[n]).abs().max() / ref[n].abs().max()).item()
            for n, p in pipe.module.named_parameters()
        )
    return worst


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_pp2_on_two_gpus_matches_unsplit_model():
    for rank, worst in enumerate(run_distributed(_equivalence_on_gpus, 2, backend="nccl",
                                                 timeout=300)):
        for case, diff in worst.items():
            assert diff < TOL, f"rank {rank} {case}: max relative gradient difference {diff:.2e}"


class ToyPipelineModel(nn.Module):
    """embed -> blocks -> norm -> head with dense blocks: no host sync of its own."""

    def __init__(self, vocab: int = 64, dim: int = 64, n_blocks: int = 4) -> None:
        super().__init__()
        self.embed: nn.Module | None = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict(
            {str(i): nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for i in range(n_blocks)}
        )
        self.norm: nn.Module | None = nn.LayerNorm(dim)
        self.head: nn.Module | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = h + block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def _steps_without_host_sync() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (N_MICRO, MICRO_BATCH, SEQ + 1), device=device)
    inputs, targets = list(tokens[..., :-1]), list(tokens[..., 1:])

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")

    for virtual, schedule in itertools.product((1, 2), SCHEDULES):
        pipe = build_pipeline(
            ToyPipelineModel().to(device), PipelineConfig(schedule=schedule, virtual_stages=virtual),
            N_MICRO, loss_fn=loss_fn, activation_shape=(MICRO_BATCH, SEQ, 64),
            activation_dtype=torch.float32,
        )
        pipe.step(inputs, targets)  # warm-up: communicators, allocator
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            pipe.step(inputs, targets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_pipeline_step_does_not_sync_the_host():
    run_distributed(_steps_without_host_sync, 2, backend="nccl", timeout=300)
