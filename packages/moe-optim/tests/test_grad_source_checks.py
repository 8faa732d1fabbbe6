"""The optimizer checks the GradSource contract where the source states it.

A source may say whether its main grads are reduced (``synced``) and which tensors it
reduced only shard-wise (``grad_is_sharded``); moe_ddp's ``MultiGroupDDP`` does. A step
on unreduced gradients, or a tensor the source shards but the optimizer keeps
replicated, would let the replicas diverge without an error. Oracle:
``torch.optim.AdamW`` in one process on the full gradient.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from moe_optim import AdamWConfig, DistributedOptimizer, OptimConfig, Shard
from moe_testing import run_distributed
from torch import nn

ADAMW = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class _Source:
    """One parameter and its FP32 main grad, with the optional members of ``GradSource``.

    ``sharded``: the main grad is owner-major ``[G, numel/G]``, only this rank's row
    reduced (the other rows NaN, so reading them would show).
    """

    def __init__(self, param: nn.Parameter, grad: torch.Tensor, group: dist.ProcessGroup | None,
                 sharded: bool) -> None:
        self.param, self.group, self.sharded = param, group, sharded
        self.synced = True
        if sharded:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            self.main_grad = torch.full((size, param.numel() // size), float("nan"))
            self.main_grad[rank] = grad.reshape(size, -1)[rank]
        else:
            self.main_grad = grad.clone()

    def __iter__(self):
        yield "w", self.param, self.main_grad, self.group

    def grad_is_sharded(self, param: nn.Parameter) -> bool:
        assert param is self.param
        return self.sharded


def _weight_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)  # [G, numel/G] for G=2


def _adamw_reference(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    param = nn.Parameter(weight.clone())
    param.grad = grad.clone()
    torch.optim.AdamW([param], lr=ADAMW.lr, betas=ADAMW.betas, eps=ADAMW.eps,
                      weight_decay=ADAMW.weight_decay).step()
    return param.detach()


def _sharded_source_and_optimizer(min_shard_numel: int) -> bytes:
    weight, grad = _weight_and_grad()
    source = _Source(nn.Parameter(weight.clone()), grad, dist.group.WORLD, sharded=True)
    config = OptimConfig(adamw=ADAMW, max_grad_norm=None, min_shard_numel=min_shard_numel)
    try:
        opt = DistributedOptimizer(source, config, norm_group=dist.group.WORLD)
    except ValueError as e:
        result = {"error": str(e)}
    else:
        stats = opt.step()
        result = {"weight": source.param.detach().clone(), "norm": float(stats.grad_norm)}
    buf = io.BytesIO()  # bytes: tensors cannot travel back once the rank has exited
    torch.save(result, buf)
    return buf.getvalue()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_tensor_the_source_shards_cannot_be_kept_replicated():
    """Weight ``[2, 64]`` on 2 ranks: its owner-major main grad has the parameter's own
    shape, so only the source's statement shows that the other row is not reduced."""
    weight, grad = _weight_and_grad()
    for raw in run_distributed(_sharded_source_and_optimizer, 2, 4096, timeout=60):
        message = torch.load(io.BytesIO(raw)).get("error", "accepted")
        assert "'w'" in message and "OptimConfig.min_shard_numel=4096" in message, message
        assert "reduce-scatters" in message and "min_shard_numel is at most 128" in message, message
    want = _adamw_reference(weight, grad)
    for raw in run_distributed(_sharded_source_and_optimizer, 2, 128, timeout=60):
        result = torch.load(io.BytesIO(raw))
        assert "error" not in result, result
        torch.testing.assert_close(result["weight"], want, rtol=1e-6, atol=1e-7)
        assert abs(result["norm"] - float(grad.norm())) <= 1e-6 * float(grad.norm())


def test_a_step_before_the_source_is_synced_is_refused_and_changes_nothing():
    weight, grad = _weight_and_grad()
    source = _Source(nn.Parameter(weight.clone()), grad, None, sharded=False)
    opt = DistributedOptimizer(source, OptimConfig(adamw=ADAMW, max_grad_norm=None), norm_group=None)
    before = {k: s.local.clone() for k, s in opt.sharded_state().items()}
    source.synced = False
    for call in (opt.step, opt.update):
        with pytest.raises(RuntimeError, match=r"synced=False.*call its finish_grad_sync\(\)"):
            call()
    assert all(torch.equal(s.local, before[k]) for k, s in opt.sharded_state().items())
    assert torch.equal(source.param.detach(), weight)
    # Resuming loads state before any step: no gradient is read, so no sync is needed.
    opt.load_sharded_state({k: Shard(before[k].clone(), s.global_shape, s.flat_offset)
                            for k, s in opt.sharded_state().items()})
    source.synced = True
    opt.step()
    torch.testing.assert_close(source.param.detach(), _adamw_reference(weight, grad), rtol=1e-6, atol=1e-7)
    assert int(opt.step_count) == 1
