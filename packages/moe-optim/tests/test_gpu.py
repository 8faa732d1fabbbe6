"""On two GPUs (NCCL): the step matches a single-GPU oracle and never synchronises the host.

Run: tools/from_source.sh python3 -m pytest -p moe_testing.pytest_plugin packages/moe-optim/tests -m multigpu
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from moe_optim import DistributedOptimizer, MuonConfig, OptimConfig, ParamRule
from moe_testing import run_distributed
from torch import nn

pytestmark = pytest.mark.multigpu(2)

SHAPES = {"attn.weight": (256, 128), "experts.w1": (8, 64, 128), "norm.weight": (128,),
          "odd.weight": (33, 7)}
MUON = ParamRule(lambda n, p: p.ndim >= 2 and not n.startswith("odd"), algorithm="muon")


def _values(name: str, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(sum(map(ord, name)) * 1000 + step)
    return torch.randn(SHAPES[name], generator=g).to(device)


def _device() -> torch.device:
    return torch.device("cuda", dist.get_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _step_on_gpus(kind: str) -> bytes:
    device = _device()
    params = {n: nn.Parameter(_values(n, 0, device)) for n in SHAPES}
    grads = [(n, p, torch.zeros(p.shape, device=device), dist.group.WORLD) for n, p in params.items()]
    cfg = OptimConfig(min_shard_numel=64, max_grad_norm=1.0,
                      muon=MuonConfig(ns_dtype="float32", lr=0.02))
    opt = DistributedOptimizer(grads, cfg, norm_group=dist.group.WORLD,
                               rules=[MUON] if kind == "muon" else [])
    for step in range(1, 4):
        for n, _, g, _ in grads:
            g.copy_(_values(n, step, device))
        if step == 3 and device.type == "cuda":  # warmed up: the steady state
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            stats = opt.step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
    buf = io.BytesIO()
    torch.save({n: p.detach().cpu() for n, p in params.items()} | {"skipped": bool(stats.skipped)}, buf)
    return buf.getvalue()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_two_gpus_match_one_gpu_without_host_sync(kind):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    results = [torch.load(io.BytesIO(b)) for b in run_distributed(_step_on_gpus, 2, kind,
                                                                  backend=backend, timeout=180)]
    for r in results:
        assert r.pop("skipped") is False
    # The oracle: the same optimizer on one GPU, no replica group.
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    params = {n: nn.Parameter(_values(n, 0, device)) for n in SHAPES}
    grads = [(n, p, torch.zeros(p.shape, device=device), None) for n, p in params.items()]
    cfg = OptimConfig(max_grad_norm=1.0, muon=MuonConfig(ns_dtype="float32", lr=0.02))
    opt = DistributedOptimizer(grads, cfg, norm_group=None, rules=[MUON] if kind == "muon" else [])
    for step in range(1, 4):
        for n, _, g, _ in grads:
            g.copy_(_values(n, step, device))
        opt.step()
    for r in results:
        for n, p in params.items():
            torch.testing.assert_close(r[n], p.detach().cpu(), rtol=1e-5, atol=1e-6, msg=n)
