"""MultiGroupDDP + DistributedOptimizer: the GradSource checks end to end (gloo, 2 ranks).

A cross-package test (neither package's tests may import the other).
Oracle: torch.optim.AdamW on the sum of both ranks' gradients.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP
from moe_optim import AdamWConfig, DistributedOptimizer, OptimConfig
from moe_testing import run_distributed
from torch import nn

ADAMW = AdamWConfig(lr=1e-1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(rank + 1))


def _model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 2, bias=False)  # weight [2, 64]: owner-major [G, numel/G] for G = 2


def _run(ddp_min: int, opt_min: int) -> bytes:
    model = _model()
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                        DDPConfig(mode="reduce_scatter", min_shard_numel=ddp_min))
    config = OptimConfig(adamw=ADAMW, min_shard_numel=opt_min, max_grad_norm=None)
    try:
        opt = DistributedOptimizer(ddp, config, norm_group=dist.group.WORLD)
    except ValueError as e:
        result = {"error": str(e)}
    else:
        model(_inputs(dist.get_rank())).sum().backward()  # buckets launch: in flight
        try:
            opt.step()
        except RuntimeError as e:
            early = str(e)
        else:
            early = "accepted"
        ddp.finish_grad_sync()
        opt.step()
        ddp.zero_grad()
        result = {"early": early, "weight": model.weight.detach().clone()}
    buf = io.BytesIO()
    torch.save(result, buf)
    return buf.getvalue()


@pytest.mark.multiprocess
def test_min_shard_numel_mismatch_and_unsynced_steps_are_refused():
    for raw in run_distributed(_run, 2, 32, 4096, timeout=120):
        message = torch.load(io.BytesIO(raw)).get("error", "accepted")
        assert "'weight'" in message and "min_shard_numel=4096" in message, message
    model = _model()
    sum(model(_inputs(r)).sum() for r in range(2)).backward()
    torch.optim.AdamW(model.parameters(), lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                      weight_decay=ADAMW.weight_decay).step()
    for raw in run_distributed(_run, 2, 32, 32, timeout=120):
        result = torch.load(io.BytesIO(raw))
        assert "finish_grad_sync()" in result["early"], result["early"]
        torch.testing.assert_close(result["weight"], model.weight.detach(), rtol=1e-6, atol=1e-7)
