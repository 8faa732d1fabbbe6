"""Hugging Face export with a toy converter: shards, index, config, BF16, any layout."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import moe_ckpt as mc
import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed
from safetensors.torch import load_file


def toy_convert(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Stacked experts [E, F, D] become one tensor per expert, as HF MoE layouts store them."""
    if name.endswith("experts.w1"):
        prefix = name.removeprefix("model/").removesuffix("experts.w1")
        return [(f"{prefix}experts.{e}.gate_proj.weight", t[e]) for e in range(t.shape[0])]
    return [(name.removeprefix("model/"), t)]


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model/embed.weight": torch.randn(50, 8, generator=g),
        "model/layers.0.experts.w1": torch.randn(4, 6, 8, generator=g),
        "model/norm.weight": torch.randn(8, generator=g).bfloat16(),
    }


def save_sharded(path: str) -> None:
    """Two ranks: flat optimizer-style shards, expert boxes, replicated norm and extras."""
    rank = dist.get_rank()
    m = model_state()
    mc.save(
        path,
        {
            "model/embed.weight": mc.FlatShard(
                m["model/embed.weight"].reshape(-1)[rank * 200 : rank * 200 + 200],
                (50, 8),
                rank * 200,
            ),
            "model/layers.0.experts.w1": mc.Shard(
                m["model/layers.0.experts.w1"][rank * 2 : rank * 2 + 2], (4, 6, 8), (rank * 2, 0, 0)
            ),
            "model/norm.weight": m["model/norm.weight"],
            "optim/exp_avg/embed.weight": torch.zeros(50, 8),
            "step": torch.tensor(9),
        },
    )


@pytest.mark.multiprocess
def test_export_from_a_sharded_checkpoint(tmp_path: Path):
    ck = tmp_path / "ck"
    run_distributed(save_sharded, 2, str(ck), timeout=60)
    cfg = {"model_type": "toy_moe", "hidden_size": 8}
    out = mc.export_hf(
        ck,
        tmp_path / "hf",
        convert=toy_convert,
        select=lambda n: n.startswith("model/"),
        config=cfg,
        max_shard_bytes=300,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    loaded = {}
    for f in files:
        loaded.update(load_file(out / f))
    expected = dict(p for n, t in model_state().items() for p in toy_convert(n, t))
    assert set(loaded) == set(expected) == set(index["weight_map"])
    for k, t in expected.items():
        assert loaded[k].dtype == torch.bfloat16 and torch.equal(loaded[k], t.bfloat16()), k
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in expected.values())
    assert json.loads((out / "config.json").read_text()) == cfg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "hf"]  # no temp dir left
    with pytest.raises(FileExistsError):
        mc.export_hf(ck, out, convert=toy_convert, select=lambda n: True, config=cfg)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077], ids=["022", "002", "077"])
def test_export_files_get_the_mode_of_ordinary_files(tmp_path: Path, umask: int):
    """safetensors writes a 0600 temp file and renames it; the shards must still be
    readable like config.json and the index (0o666 less the umask)."""
    ck = tmp_path / "ck"
    mc.save(ck, model_state())
    old = os.umask(umask)
    try:
        out = mc.export_hf(
            ck,
            tmp_path / "hf",
            convert=toy_convert,
            select=lambda n: n.startswith("model/"),
            config={"model_type": "toy_moe"},
            max_shard_bytes=300,
        )
    finally:
        os.umask(old)
    config_mode = stat.S_IMODE((out / "config.json").stat().st_mode)
    assert config_mode == 0o666 & ~umask
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    for f in [*shards, out / "model.safetensors.index.json"]:
        assert stat.S_IMODE(f.stat().st_mode) == config_mode, (f.name, oct(f.stat().st_mode))
