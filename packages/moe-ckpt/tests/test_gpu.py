"""GPU: device tensors in and out, pinned async snapshots, NCCL training collectives."""

from __future__ import annotations

from pathlib import Path

import moe_ckpt as mc
import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed


@pytest.mark.gpu
def test_device_tensors_roundtrip_and_async_snapshot(tmp_path: Path):
    g = torch.Generator(device="cuda").manual_seed(0)
    live = {
        "w": torch.randn(1024, 512, device="cuda", generator=g),
        "b": torch.randn(4096, device="cuda", generator=g).bfloat16(),
    }
    expected = {k: v.clone() for k, v in live.items()}
    with mc.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, live)
        for v in live.values():  # queued after the snapshot copies: must not leak into them
            v.mul_(0).add_(float("nan"))
        ckpt.wait()
        out = {
            k: mc.FlatShard(torch.empty(v.numel(), device="cuda", dtype=v.dtype), tuple(v.shape), 0)
            for k, v in expected.items()
        }
        ckpt.load(out)
    for k, v in expected.items():
        assert torch.equal(out[k].local.view(v.shape), v), k


def rank_nccl_training_with_async_saves(root: str) -> None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank)
    full = torch.arange(8 * 1024, dtype=torch.float32, device=device).view(8, 1024)
    local = full[rank * 4 : rank * 4 + 4].clone()
    with mc.Checkpointer(root, mc.CheckpointerConfig(keep_last=1)) as ckpt:
        for step in range(3):
            ckpt.save(step, {"w": mc.Shard(local, (8, 1024), (rank * 4, 0))})
            for _ in range(50):  # NCCL collectives on the default group meanwhile
                x = torch.ones(1 << 20, device=device)
                dist.all_reduce(x)
                assert x[0].item() == 2.0
            local.add_(1)
        whole = torch.zeros(8, 1024, device=device)
        manifest = ckpt.load({"w": whole})
    assert manifest.step == 2 and torch.equal(whole, full + 2)


@pytest.mark.multiprocess
@pytest.mark.multigpu(2)
def test_async_saves_beside_nccl_collectives(tmp_path: Path):
    run_distributed(
        rank_nccl_training_with_async_saves, 2, str(tmp_path), backend="nccl", timeout=180
    )
