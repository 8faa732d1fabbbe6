"""Reshard matrix (gloo): save on one layout and world size, load on another, exactly.

Layouts over ``world`` ranks: ``replicated`` (every rank holds everything), ``rows``
(near-equal dim-0 boxes, uneven when not divisible), ``skewed`` (rank r gets r+1
shares of dim 0), ``cols`` (last-dim boxes), ``flat`` (the distributed optimizer's
contiguous runs of the flattening, boundaries inside rows) and ``mixed`` (a
different kind per tensor). Oracle: each global tensor generated from a seed at
its full shape; every loaded local must equal its slice bit for bit.

Saves use both key-value layouts with two chunkings: tiny aligned chunks (every
shard boundary is a chunk boundary) and the defaults, where the tiny tensors are
one chunk shared by all writers (concurrent read-modify-write through
tensorstore's conditional writes).
"""

from __future__ import annotations

import math
from pathlib import Path

import moe_ckpt as mc
import numpy as np
import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed

SPECS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((8, 6), torch.float32),
    "u": ((7, 5), torch.bfloat16),  # 7 rows: uneven over 2 and 4 ranks
    "experts.w1": ((12, 4, 3), torch.float32),
    "v": ((10,), torch.bfloat16),
    "count": ((), torch.int64),
}
KINDS = ["replicated", "rows", "skewed", "cols", "flat", "mixed"]
MIXED = {"w": "flat", "u": "rows", "experts.w1": "skewed", "v": "replicated", "count": "flat"}
# Tiny aligned chunks (every shard boundary a chunk boundary) or the defaults
# (the tiny tensors are one chunk that all writers share), in both layouts.
ALIGNED = mc.StorageOptions(kvstore="ocdbt", target_chunk_bytes=16, min_chunk_bytes=0)
ALIGNED_FILE = mc.StorageOptions(kvstore="file", target_chunk_bytes=16, min_chunk_bytes=0)
SHARED = mc.StorageOptions(kvstore="file")
SHARED_OCDBT = mc.StorageOptions(kvstore="ocdbt")


def oracle(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def _bounds(n: int, world: int, weights: list[int]) -> list[int]:
    cum = np.cumsum([0, *weights])
    return [int(round(n * c / cum[-1])) for c in cum]


def shard(name: str, kind: str, world: int, rank: int, fill: bool):
    """This rank's ShardLike of ``name``: oracle values when ``fill``, zeros otherwise."""
    kind = MIXED[name] if kind == "mixed" else kind
    full = oracle(name)
    shape = tuple(full.shape)
    if kind == "replicated" or (not shape and kind != "flat"):
        local = full.clone() if fill else torch.zeros_like(full)
        return mc.Shard(local, shape)
    if kind == "flat":
        b = _bounds(math.prod(shape), world, [1] * world)
        local = full.reshape(-1)[b[rank] : b[rank + 1]].clone()
        return mc.FlatShard(local if fill else torch.zeros_like(local), shape, b[rank])
    dim = len(shape) - 1 if kind == "cols" else 0
    weights = [r + 1 for r in range(world)] if kind == "skewed" else [1] * world
    b = _bounds(shape[dim], world, weights)
    local = full.narrow(dim, b[rank], b[rank + 1] - b[rank]).clone()
    offset = tuple(b[rank] if d == dim else 0 for d in range(len(shape)))
    return mc.Shard(local if fill else torch.zeros_like(local), shape, offset)


def _expected(name: str, s) -> torch.Tensor:
    full = oracle(name)
    if hasattr(s, "flat_offset"):
        return full.reshape(-1)[s.flat_offset : s.flat_offset + s.local.numel()]
    return full[tuple(slice(o, o + n) for o, n in zip(s.global_offset, s.local.shape, strict=True))]


def save_layout(root: str, kind: str, options: mc.StorageOptions) -> None:
    world, rank = _world()
    tensors = {n: shard(n, kind, world, rank, fill=True) for n in SPECS}
    mc.save(
        Path(root) / f"w{world}-{kind}",
        tensors,
        {"layout": kind},
        step=world,
        rank_metadata={"rank": rank},
        options=options,
    )


def load_and_check(ckpt: Path, kind: str) -> None:
    world, rank = _world()
    targets = {n: shard(n, kind, world, rank, fill=False) for n in SPECS}
    manifest = mc.load(ckpt, targets)
    for name, s in targets.items():
        exp = _expected(name, s)
        assert s.local.dtype == exp.dtype and torch.equal(s.local, exp), (
            f"{ckpt.name} loaded as {kind} on {world} ranks: tensor {name} (rank {rank}) differs"
        )
    assert manifest.metadata["layout"] == ckpt.name.split("-", 1)[1]
    assert manifest.rank_metadata == [{"rank": r} for r in range(manifest.world_size)]


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _load_all(root: str, saved_by: list[int]) -> list[str]:
    checked = []
    for ckpt in sorted(Path(root).iterdir()):
        if int(ckpt.name.split("-")[0][1:]) in saved_by:
            for kind in KINDS:
                load_and_check(ckpt, kind)
                checked.append(f"{ckpt.name}->{kind}")
    return checked


def rank_fn_two(root: str) -> list[str]:
    """World 2: save rows/flat/cols; load everything world 1 saved, in every layout."""
    save_layout(root, "rows", ALIGNED)
    save_layout(root, "flat", SHARED)
    save_layout(root, "cols", ALIGNED_FILE)
    return _load_all(root, saved_by=[1])


def rank_fn_four(root: str) -> list[str]:
    """World 4: save rows/flat/skewed/mixed; load everything worlds 1 and 2 saved."""
    save_layout(root, "rows", ALIGNED)
    save_layout(root, "flat", ALIGNED)
    save_layout(root, "skewed", SHARED_OCDBT)
    save_layout(root, "mixed", SHARED)
    return _load_all(root, saved_by=[1, 2])


def rank_fn_back_to_two(root: str) -> list[str]:
    """World 2: load what 4 ranks saved; 4-way rows -> replicated -> save -> rows again."""
    checked = _load_all(root, saved_by=[4])
    world, rank = _world()
    replicated = {n: shard(n, "replicated", world, rank, fill=False) for n in SPECS}
    mc.load(Path(root) / "w4-rows", replicated)
    again = Path(root).parent / "again" / "w2-replicated"
    mc.save(
        again, replicated, {"layout": "replicated"}, rank_metadata={"rank": rank}, options=ALIGNED
    )
    for kind in ["rows", "flat"]:
        load_and_check(again, kind)
        checked.append(f"w4-rows->replicated->{again.name}->{kind}")
    return checked


@pytest.mark.slow
@pytest.mark.multiprocess
def test_reshard_matrix(tmp_path: Path):
    root = str(tmp_path / "ck")
    save_layout(root, "replicated", ALIGNED)  # world 1, this process
    checked = run_distributed(rank_fn_two, 2, root, timeout=120)[0]
    checked += run_distributed(rank_fn_four, 4, root, timeout=120)[0]
    checked += run_distributed(rank_fn_back_to_two, 2, root, timeout=120)[0]
    checked += _load_all(root, saved_by=[1, 2, 4])  # world 1 loads everything
    n = len(KINDS)  # loads per checkpoint; worlds 1, 2, 4 saved 1, 3 and 4 checkpoints
    assert len(checked) == n * 1 + n * (1 + 3) + (n * 4 + 2) + n * (1 + 3 + 4)
