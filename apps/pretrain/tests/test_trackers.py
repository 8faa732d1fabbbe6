"""TensorBoard and Weights & Biases (offline) log the same scalars as ``metrics.jsonl``; their
install hints name commands that exist."""

from __future__ import annotations

import json
import math
import struct
import sys
import tomllib
import zlib
from pathlib import Path

import pytest
from pretrain.cli import main
from pretrain.metrics import INSTALL_HINTS, open_trackers

ROOT = Path(__file__).resolve().parents[3]


def _jsonl_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    """step -> the record's numbers (flags as 0/1), as metrics.jsonl holds them."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record.pop("step")
        out[step] = {k: float(v) for k, v in record.items() if isinstance(v, (bool, int, float))}
    return out


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte file header
    (``:W&B``, magic, version), then 32 KiB blocks of LevelDB-log records (CRC32, length,
    type: full, first, middle, last), a block's tail shorter than a header being padding."""
    data = path.read_bytes()
    ident, _magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and version == 0, (ident, version)
    block, header = 32768, 7
    records, pending, pos = [], b"", 7
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        payload = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:  # zero fill at the end of the file
            break
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def _wandb_history(run_dir: Path) -> dict[int, dict[str, float]]:
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history = {}
    for raw in _wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                 for item in record.history.item}
        step = items.pop("_step")
        history[step] = {k: float(v) for k, v in items.items() if not k.startswith("_")}
    return history


def _tensorboard_scalars(run_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


def _assert_same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]], rel: float):
    assert sorted(got) == sorted(want)
    for step, scalars in want.items():
        assert sorted(got[step]) == sorted(scalars), step
        for key, value in scalars.items():
            assert got[step][key] == pytest.approx(value, rel=rel, abs=1e-30), (step, key)


@pytest.mark.timeout(300)
def test_wandb_offline_and_tensorboard_log_the_scalars_of_metrics_jsonl(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["--config", "tiny", f"run_dir={run}", "metrics.tensorboard=true", "metrics.wandb=true",
            "metrics.wandb_mode=offline", "metrics.wandb_project=tests", "train.stop_after=2",
            "train.steps=3"]
    assert main(args) == 0
    assert main(args[:-2] + ["train.steps=3"]) == 0  # resumed: the same W&B run goes on
    assert "Traceback" not in capsys.readouterr().err
    want = _jsonl_scalars(run)
    assert sorted(want) == [1, 2, 3] and {"loss", "lr", "grad_norm", "skipped"} <= set(want[1])
    assert len(list(run.glob("wandb/offline-run-*"))) == 2  # one folder per process, one run id
    assert len({p.name.rsplit("-", 1)[1] for p in run.glob("wandb/offline-run-*")}) == 1
    history: dict[int, dict[str, float]] = {}
    for folder in sorted(run.glob("wandb/offline-run-*")):
        sub = tmp_path / folder.name
        (sub / "wandb").mkdir(parents=True)
        (sub / "wandb" / folder.name).symlink_to(folder)
        history.update(_wandb_history(sub))
    _assert_same(history, want, rel=1e-12)  # JSON both ways: exact
    _assert_same(_tensorboard_scalars(run), want, rel=1e-6)  # TensorBoard keeps float32


def test_install_hints_name_extras_the_workspace_and_the_app_define():
    """``uv sync --extra X`` at the workspace root installs the app's extra X; pip installs
    the package itself."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    app = tomllib.loads((ROOT / "apps/pretrain/pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    for package, hint in INSTALL_HINTS.items():
        assert hint == f"uv sync --extra {package}, or pip install {package}"
        assert root[package] == [f"pretrain[{package}]"]
        assert [r.split(">")[0] for r in app[package]] == [package]


@pytest.mark.parametrize("module, option", [("wandb", "metrics.wandb"),
                                            ("torch.utils.tensorboard", "metrics.tensorboard")])
def test_a_missing_tracker_is_one_warning_naming_its_install_command(
        tmp_path, monkeypatch, capsys, module, option):
    from pretrain.metrics import WandbOptions

    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    trackers = open_trackers(tmp_path, tensorboard=option == "metrics.tensorboard",
                             wandb=WandbOptions(None, None, "offline", {})
                             if option == "metrics.wandb" else None)
    assert [type(t).__name__ for t in trackers] == ["JsonlTracker"]
    package = option.split(".")[1]
    assert capsys.readouterr().err.strip() == (
        f"pretrain: warning: {option}=true but {package} is not installed (install it: "
        f"uv sync --extra {package}, or pip install {package}); logging to metrics.jsonl "
        "without it")
    for tracker in trackers:
        tracker.close()


def test_non_finite_values_are_left_out_like_the_jsonl_nulls():
    from pretrain.metrics import scalar_fields

    assert scalar_fields({"step": 3, "loss": math.nan, "grad_norm": math.inf, "skipped": True,
                          "lr": 1e-3, "expert_load": [[1, 2]]}) == {"skipped": 1, "lr": 1e-3}
