"""``pretrain config`` and ``run_dir/config.toml``: every key of every config dataclass, with
its type, default and description, in a file that loads back to the same config."""

from __future__ import annotations

import dataclasses
import re
import tomllib
import typing
from dataclasses import dataclass

import pytest
from pretrain.cli import main
from pretrain.config import PretrainConfig, config_toml, load_config
from pretrain.config_reference import annotated_toml, field_descriptions, type_name


def _dataclasses_under(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) for every config dataclass reachable from ``cls``: nested
    sections and the element tables of list fields (``data.sources[].``)."""
    found = [(prefix, cls)]
    for name, tp in typing.get_type_hints(cls).items():
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            found += _dataclasses_under(tp, f"{prefix}{name}.")
        elif typing.get_origin(tp) in (list, tuple) and args and dataclasses.is_dataclass(args[0]):
            found += _dataclasses_under(args[0], f"{prefix}{name}[].")
    return found


def _listed_keys(text: str) -> dict[str, str]:
    """Dotted key -> its line in an annotated TOML text (set, commented out, element field)."""
    keys, section = {}, ""
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(.+)\]", line):
            section = m[1] + "."
        elif m := re.match(r"(?:# )?(\w+) = ", line):
            keys[section + m[1]] = line
        elif m := re.match(r"#   (\w+)\[\]\.(\w+): ", line):
            keys[f"{section}{m[1]}[].{m[2]}"] = line
    return keys


def test_pretrain_config_lists_every_field_of_every_config_dataclass(capsys):
    assert main(["config", "--config", "tiny", "train.steps=7"]) == 0
    listed = _listed_keys(capsys.readouterr().out)
    classes = _dataclasses_under(PretrainConfig)
    assert {c.__name__ for _, c in classes} >= {
        "PretrainConfig", "MoEConfig", "MXFP8Config", "ParallelConfig", "TrainConfig",
        "OptimConfig", "DataConfig", "DataSource", "CheckpointConfig", "MetricsConfig"}
    expected = []
    for prefix, cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue  # a section: its fields are listed under it
            key = prefix + f.name
            expected.append(key)
            assert key in listed, key
            description = field_descriptions(cls)[f.name]
            assert description, f"{cls.__name__}.{f.name} has no description comment"
            assert f"{type_name(hints[f.name])}, default " in listed[key]
            assert listed[key].endswith(description) or f"{description} (set by" in listed[key]
    assert sorted(listed) == sorted(expected)
    assert listed["train.steps"] == ("steps = 7  # int, default 300: optimizer steps (the LR "
                                     "schedule spans them) (set by the command line)")
    assert listed["train.stop_after"].startswith("# stop_after =   # int | none, default none: ")


@pytest.mark.parametrize("overrides", [
    [],
    ["train.stop_after=3", "data.seed=5", "model.capacity_factor=1.25", "mxfp8.targets=experts",
     "optim.schedule=wsd", "run_dir=some where/\"quoted\""],
    ['data.sources=[{path="a", weight=3}, {path="b", weight=0.5}]', "data.verify=false"],
])
def test_the_annotated_file_loads_back_to_the_same_config(tmp_path, overrides):
    cfg = load_config("tiny", overrides)
    path = tmp_path / "config.toml"
    path.write_text(config_toml(cfg))
    assert load_config(str(path)) == cfg
    assert set(_listed_keys(path.read_text())) >= {"train.stop_after", "data.seed", "run_dir"}


def test_a_run_writes_every_key_into_its_config_toml(tmp_path):
    assert main(["--config", "tiny", f"run_dir={tmp_path}", "train.steps=1", "optim.warmup_steps=0"]) == 0
    text = (tmp_path / "config.toml").read_text()
    reference = load_config("tiny", [f"run_dir={tmp_path}", "train.steps=1", "optim.warmup_steps=0"])
    assert set(_listed_keys(text)) == set(_listed_keys(config_toml(reference)))
    assert load_config(str(tmp_path / "config.toml")) == reference


@dataclass
class _Inner:
    # --- a ruler is no description
    plain: int = 1  # trailing
    # above, first line
    # above, second line
    both: float | None = 2.0  # and trailing
    # only above
    unset: str | None = None


@dataclass
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    top: bool = True  # a top-level key


def test_descriptions_join_the_comment_block_above_and_the_trailing_comment():
    assert field_descriptions(_Inner) == {
        "plain": "trailing", "both": "above, first line above, second line and trailing",
        "unset": "only above"}


def test_none_over_a_non_none_default_is_written_and_read_back_as_none():
    obj = _Outer(_Inner(both=None))
    text = annotated_toml(obj)
    assert text.splitlines() == [
        "top = true  # bool, default true: a top-level key",
        "",
        "[inner]",
        "plain = 1  # int, default 1: trailing",
        'both = "none"  # float | none, default 2.0: above, first line above, second line and trailing',
        "# unset =   # str | none, default none: only above",
    ]
    assert tomllib.loads(text) == {"top": True, "inner": {"plain": 1, "both": "none"}}
