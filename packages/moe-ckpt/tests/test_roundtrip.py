"""Single-process save/load: dtypes, sub-box and flat loads, validation, corruption."""

from __future__ import annotations

import json
from pathlib import Path

import moe_ckpt as mc
import pytest
import torch
from moe_ckpt.manifest import MANIFEST_NAME

KVSTORES = ["ocdbt", "file"]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(9, 7, generator=g),
        "bf": torch.randn(5, 3, 4, generator=g).bfloat16(),
        "h": torch.randn(6, generator=g).half(),
        "d": torch.randn(2, 2, generator=g).double(),
        "step": torch.tensor(1234567890123, dtype=torch.int64),
        "i32": torch.randint(-100, 100, (4, 3), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(3, 3, generator=g) > 0.5,
        "empty": torch.zeros(0, 4),
        "a/b.c d": torch.arange(4.0),  # names need not be path-safe
    }


def _opts(kvstore: str) -> mc.StorageOptions:
    return mc.StorageOptions(kvstore=kvstore, target_chunk_bytes=48, min_chunk_bytes=0)


@pytest.mark.parametrize("kvstore", KVSTORES)
def test_every_dtype_roundtrips_exactly_with_metadata(tmp_path: Path, kvstore: str):
    state = _state()
    meta = {"config": {"d_model": 8}, "data": {"position": 17}}
    mc.save(
        tmp_path / "ck", state, meta, step=5, rank_metadata={"rng": [1, 2]}, options=_opts(kvstore)
    )
    out = {k: torch.full_like(v, 7) for k, v in state.items()}
    manifest = mc.load(tmp_path / "ck", out)
    for k, v in state.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    assert (
        manifest.step == 5
        and manifest.metadata == meta
        and manifest.rank_metadata == [{"rng": [1, 2]}]
    )
    assert manifest.kvstore == kvstore and manifest.tensors["w"].chunk_shape == (1, 7)


@pytest.mark.parametrize("kvstore", KVSTORES)
def test_any_box_or_flat_run_loads_into_parameters(tmp_path: Path, kvstore: str):
    w = torch.randn(9, 7)
    mc.save(tmp_path / "ck", {"w": w}, options=_opts(kvstore))
    box = torch.nn.Parameter(torch.zeros(4, 3))  # in-place load must work on leaves
    flat = torch.zeros(30)
    mc.load(tmp_path / "ck", {"w": mc.Shard(box, (9, 7), (3, 2))})
    mc.load(tmp_path / "ck", {"w": mc.FlatShard(flat, (9, 7), 11)})
    assert torch.equal(box.detach(), w[3:7, 2:5])
    assert torch.equal(flat, w.reshape(-1)[11:41])
    assert mc.read_tensor(tmp_path / "ck", "w").equal(w)


def test_validation_names_the_tensor(tmp_path: Path):
    mc.save(tmp_path / "ck", {"w": torch.zeros(4, 4), "b": torch.zeros(3)})
    with pytest.raises(mc.MissingTensorError, match="'nope' is not in checkpoint"):
        mc.load(tmp_path / "ck", {"nope": torch.zeros(4, 4)})
    with pytest.raises(mc.TensorMismatchError, match=r"'w'.*\(4, 4\).*\(4, 5\)"):
        mc.load(tmp_path / "ck", {"w": mc.Shard(torch.zeros(4, 5), (4, 5))})
    with pytest.raises(mc.TensorMismatchError, match="'b'.*float32.*bfloat16"):
        mc.load(tmp_path / "ck", {"b": torch.zeros(3, dtype=torch.bfloat16)})
    with pytest.raises(FileExistsError):
        mc.save(tmp_path / "ck", {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="'g'.*cover 8 of its 16"):
        mc.save(tmp_path / "gap", {"g": mc.Shard(torch.zeros(2, 4), (4, 4))})
    assert not (tmp_path / "gap").exists() and len(list(tmp_path.iterdir())) == 1


def test_a_name_too_long_for_a_file_name_is_refused_by_the_file_layout_only(tmp_path: Path):
    name = "opt state[adam].m " + "x" * 250  # 268 characters, 276 bytes percent-encoded
    with pytest.raises(ValueError, match=r"'opt state\[adam\].m x+'\.\.\. is 276 bytes .* 'file' layout"):
        mc.save(tmp_path / "f", {name: torch.arange(3.0)}, options=mc.StorageOptions(kvstore="file"))
    assert not (tmp_path / "f").exists()
    mc.save(tmp_path / "o", {name: torch.arange(3.0)})  # ocdbt: keys are not file names
    assert torch.equal(dict(mc.read_tensors(tmp_path / "o", [name]))[name], torch.arange(3.0))


def test_uncommitted_or_foreign_directories_are_refused(tmp_path: Path):
    mc.save(tmp_path / "ck", {"w": torch.zeros(2)})
    partial = tmp_path / ".ck.partial-0123abcd"
    (tmp_path / "ck").rename(partial)
    with pytest.raises(mc.IncompleteCheckpointError, match="partial"):
        mc.load(partial, {"w": torch.zeros(2)})
    partial.rename(tmp_path / "ck")
    manifest = tmp_path / "ck" / MANIFEST_NAME
    obj = json.loads(manifest.read_text())
    obj["format_version"] = 99
    manifest.write_text(json.dumps(obj))
    with pytest.raises(mc.CheckpointError, match="format_version 99"):
        mc.load(tmp_path / "ck", {"w": torch.zeros(2)})
    manifest.unlink()
    with pytest.raises(mc.IncompleteCheckpointError, match="manifest.json is missing"):
        mc.load(tmp_path / "ck", {"w": torch.zeros(2)})


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_flipped_byte_in_a_chunk_file_names_the_tensor(tmp_path: Path):
    state = {"emb": torch.randn(64, 32), "norm": torch.randn(32)}
    mc.save(
        tmp_path / "ck", state, options=mc.StorageOptions(kvstore="file", target_chunk_bytes=1024)
    )
    chunk = tmp_path / "ck" / "arrays" / "emb" / "c" / "5" / "0"
    _flip_byte(chunk, 100)
    mc.load(tmp_path / "ck", {"norm": torch.empty(32)})  # other tensors still load
    with pytest.raises(mc.ChecksumError, match=r"tensor 'emb'.*piece at \(40, 0\)"):
        mc.load(tmp_path / "ck", {"emb": torch.empty(64, 32)})
    with pytest.raises(
        mc.ChecksumError, match="'emb'"
    ):  # also when only part of the piece is wanted
        mc.load(tmp_path / "ck", {"emb": mc.Shard(torch.empty(1, 2), (64, 32), (41, 3))})


def test_flipped_byte_in_an_ocdbt_data_file_names_the_tensor(tmp_path: Path):
    state = {"big": torch.randn(256, 256), "small": torch.randn(4)}
    mc.save(tmp_path / "ck", state, options=mc.StorageOptions(kvstore="ocdbt"))
    data_files = sorted(
        (tmp_path / "ck" / "ocdbt" / "rank0" / "d").iterdir(), key=lambda p: p.stat().st_size
    )
    largest = data_files[-1]
    assert largest.stat().st_size > 256 * 256 * 4  # the big tensor's bytes live here
    _flip_byte(largest, largest.stat().st_size // 2)
    with pytest.raises(mc.CheckpointError, match="tensor 'big'"):
        mc.load(tmp_path / "ck", {"big": torch.empty(256, 256)})


def test_deleted_chunk_is_detected(tmp_path: Path):
    mc.save(tmp_path / "ck", {"w": torch.randn(8, 8)}, options=_opts("file"))
    (tmp_path / "ck" / "arrays" / "w" / "c" / "3" / "0").unlink()
    with pytest.raises(mc.ChecksumError, match="'w'.*piece at \\(3, 0\\)"):
        mc.load(tmp_path / "ck", {"w": torch.empty(8, 8)})


def test_a_torch_optimizer_state_dict_round_trips_nested_with_its_values(tmp_path):
    """A model's and an AdamW's ``state_dict()`` side by side (int keys, param_groups with
    floats, tuples, bools and None): the optimizer resumes exactly as torch's own
    ``load_state_dict`` of the original state would."""

    def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * (seed + 1), betas=(0.8, 0.9))
        for _ in range(seed + 1):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        return model, opt

    model, opt = trained(0)
    mc.save(tmp_path / "ck", {"model": model.state_dict(), "optim": opt.state_dict()}, step=1)
    manifest = mc.open_checkpoint(tmp_path / "ck")
    assert "optim/state/0/exp_avg" in manifest.tensors
    assert manifest.values["optim/param_groups/0/betas"] == [0.8, 0.9]
    other_model, other = trained(1)  # different weights, moments, step count and lr
    target = {"model": other_model.state_dict(), "optim": other.state_dict()}
    mc.load(tmp_path / "ck", target)
    other.load_state_dict(target["optim"])
    assert target["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)  # a tuple again
    for a, b in zip(model.parameters(), other_model.parameters(), strict=True):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), other.state_dict()
    assert want["param_groups"] == got["param_groups"]
    for i, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got["state"][i][key]), (i, key)


@pytest.mark.parametrize("state, message", [
    ({"optim": {"state": {0: {"fn": print}}}}, r"state\['optim'\]\['state'\]\[0\]\['fn'\]: a builtin_function_or_method"),
    ({"a": {"b": [torch.ones(1), object()]}}, r"state\[.a.\]\[.b.\]\[1\]: a object is neither"),
    ({"a": {(1, 2): torch.ones(1)}}, r"state\['a'\]: key \(1, 2\) must be"),
    ({"a": {"b/c": torch.ones(1)}}, r"state\['a'\]\['b/c'\]: a nested key cannot hold '/'"),
    ({"a/b": torch.ones(1), "a": {"b": torch.ones(1)}}, r"its name 'a/b' is also another entry's"),
])
def test_state_that_cannot_be_stored_is_refused_naming_its_path(tmp_path, state, message):
    with pytest.raises((TypeError, ValueError), match=message):
        mc.save(tmp_path / "ck", state)
    assert not (tmp_path / "ck").exists()


def test_a_value_missing_from_the_checkpoint_is_named(tmp_path):
    mc.save(tmp_path / "ck", {"w": torch.ones(2)})
    with pytest.raises(mc.MissingTensorError, match="value 'lr' is not in checkpoint"):
        mc.load(tmp_path / "ck", {"w": torch.zeros(2), "lr": 0.1})
