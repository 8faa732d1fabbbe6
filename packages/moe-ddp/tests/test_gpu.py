"""On two GPUs (NCCL): BF16 model, buckets launched during backward, no host sync.

Run: tools/from_source.sh python3 -m pytest -p moe_testing.pytest_plugin packages/moe-ddp/tests -m multigpu
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP, is_sharded
from moe_testing import run_distributed
from torch import nn

pytestmark = pytest.mark.multigpu(2)

WIDTH, TOKENS, MICRO, MIN_SHARD = 256, 64, 3, 4096


def _model(device: torch.device) -> nn.Module:
    """Sharded and replicated tensors: big weights, a LayerNorm, a 7-wide head with a 7-element bias."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.LayerNorm(WIDTH),
              nn.Linear(WIDTH, 7)]
    return nn.Sequential(*layers).to(device=device, dtype=torch.bfloat16)


def _batch(rank: int, mb: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + mb)
    return (torch.randn(TOKENS, WIDTH, generator=g).to(device, torch.bfloat16),
            torch.randn(TOKENS, 7, generator=g).to(device, torch.bfloat16))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_global: int) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).sum() / n_global


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync_on_gpus(mode: str) -> bytes:
    rank, world, device = dist.get_rank(), dist.get_world_size(), _device()
    model, twin = _model(device), _model(device)
    local_sum = {n: torch.zeros(p.shape, device=device) for n, p in twin.named_parameters()}
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                        DDPConfig(mode=mode, bucket_cap_mb=1.0, min_shard_numel=MIN_SHARD))
    n_global = world * MICRO * TOKENS
    for window in range(2):  # the second window is the warmed-up steady state
        for mb in range(MICRO):
            x, y = _batch(rank, mb, device)
            last = mb == MICRO - 1
            if window == 1:  # this rank's own BF16 grads, summed in FP32 by the test
                _loss(twin, x, y, n_global).backward()
                for n, p in twin.named_parameters():
                    local_sum[n] += p.grad.float()
                    p.grad = None
            if window == 1 and last and device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                if last:
                    _loss(model, x, y, n_global).backward()
                    launched = ddp.launched_buckets
                    ddp.finish_grad_sync()
                else:
                    with ddp.no_sync():
                        _loss(model, x, y, n_global).backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        if window == 0:
            ddp.zero_grad()
    grads = {}
    for name, param, main_grad, _ in ddp:
        shard = mode == "reduce_scatter" and is_sharded(param.numel(), world, MIN_SHARD)
        grads[name] = (shard, (main_grad[rank] if shard else main_grad).cpu())
    buf = io.BytesIO()
    torch.save({"grads": grads, "launched": launched, "buckets": len(ddp.grad_buffers()),
                "local_sum": {n: t.cpu() for n, t in local_sum.items()}}, buf)
    return buf.getvalue()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_two_gpus_match_one_gpu_and_overlap_backward(mode):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = [torch.load(io.BytesIO(b))
               for b in run_distributed(_sync_on_gpus, 2, mode, backend=backend, timeout=180)]
    # Oracle: the sum over ranks of each rank's own FP32 sum of its BF16 grads (computed
    # with the same kernels in the same process, so only the reduction is under test).
    want = {n: sum(r["local_sum"][n] for r in results) for n in results[0]["local_sum"]}
    for rank, result in enumerate(results):
        assert result["launched"] == result["buckets"] > 1
        for name, (shard, got) in result["grads"].items():
            expect = want[name]
            if shard:
                expect = expect.reshape(2, -1)[rank]
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6, msg=name)
