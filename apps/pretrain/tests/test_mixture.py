"""Data mixtures (data.sources) and the vocabulary taken from the data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed
from pretrain.cli import main
from pretrain.config import config_toml, load_config
from pretrain.data import (
    BatchReader,
    MixtureSequences,
    open_data,
    prepare_data,
    resolve_vocab_size,
)
from pretrain.data.mixture import MIX_BLOCK, block_quotas
from pretrain.train import train

REL = 1e-5


def _two_sources(root: Path) -> tuple[Path, Path]:
    """Two byte-token directories whose tokens say where they come from (a: lowercase, b: digits)."""
    root.mkdir(parents=True, exist_ok=True)
    a, b = root / "a", root / "b"
    (root / "a.txt").write_bytes(bytes(range(97, 123)) * 200)  # 5200 bytes + EOS: 162 sequences of 33
    (root / "b.txt").write_bytes(bytes(range(48, 58)) * 130)  # 1300 bytes + EOS: 40 sequences
    prepare_data([root / "a.txt"], a)
    prepare_data([root / "b.txt"], b)
    return a, b


def _sources(a: Path, b: Path, wa: float = 1, wb: float = 3) -> str:
    return f'data.sources=[{{path="{a}", weight={wa}}}, {{path="{b}", weight={wb}}}]'


def test_block_quotas_follow_the_weights():
    assert block_quotas([1, 3]) == [MIX_BLOCK // 4, 3 * MIX_BLOCK // 4]
    assert block_quotas([1, 1, 1]) == [21846, 21845, 21845]
    assert block_quotas([0, 2.5]) == [0, MIX_BLOCK]
    with pytest.raises(ValueError, match="would get no samples"):
        block_quotas([1e-6, 1])


def test_every_batch_holds_the_sources_by_weight_and_each_runs_through_its_epochs(tmp_path):
    a, b = _two_sources(tmp_path)
    cfg = load_config("tiny", [_sources(a, b)])
    source = open_data(cfg.data, 32, 257, 0)
    assert isinstance(source, MixtureSequences) and source.n_sequences == 162 + 40
    reader = BatchReader(source, 7, 8, 8)
    from_b = []
    for step in range(1, 41):  # 320 samples: 80 of a, 240 of b (six epochs of b's 40)
        batch = reader.microbatch(step, 0).numpy()
        is_b = batch[:, 0] < 97
        assert is_b.sum() == 6, step  # 3/4 of every batch of 8
        for row, b_row in zip(batch, is_b, strict=True):  # each row from one source
            assert np.isin(row, [*(range(48, 58) if b_row else range(97, 123)), 256]).all()
        from_b += reader.sequence_ids(step, 0, 8)[is_b].tolist()
    offset = 162  # b's ids follow a's
    for epoch in range(6):
        assert sorted(from_b[epoch * 40:(epoch + 1) * 40]) == list(range(offset, offset + 40))
    assert from_b[:40] != from_b[40:80]  # a new permutation per epoch


def _mixture_rank(run_dir: str, overrides: list[str]) -> dict:
    """One rank of a 2-rank run: its microbatches of steps 1-4, then a short training run."""
    cfg = load_config("tiny", overrides + [f"run_dir={run_dir}"])
    resolve_vocab_size(cfg)
    dp = dist.get_world_size()
    reader = BatchReader(open_data(cfg.data, cfg.train.seq_len, cfg.model.vocab_size, 0), 0,
                         cfg.train.global_batch, cfg.train.micro_batch, dist.get_rank(), dp)
    batches = [torch.cat([reader.microbatch(s, m) for m in range(reader.n_microbatches)])
               for s in range(1, 5)]
    gathered = [None] * dp
    dist.all_gather_object(gathered, batches)
    return {"batches": [torch.cat([g[s] for g in gathered]) for s in range(4)],
            "records": train(cfg)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_mixture_is_the_same_on_1_and_2_ranks_and_after_a_resume(tmp_path, capsys):
    a, b = _two_sources(tmp_path / "data")
    overrides = [_sources(a, b), "checkpoint.every=2"]
    one = train(load_config("tiny", overrides + [f"run_dir={tmp_path / 'one'}"]))
    assert "model.vocab_size=320: the data's vocabulary of 257" in capsys.readouterr().out
    reader = BatchReader(open_data(load_config("tiny", overrides).data, 32, 320, 0), 0, 8, 8)
    two = run_distributed(_mixture_rank, 2, str(tmp_path / "two"), overrides, timeout=240)
    for step in range(4):
        assert torch.equal(two[0]["batches"][step], reader.microbatch(step + 1, 0))
    losses = [r["loss"] for r in one]
    assert [r["loss"] for r in two[0]["records"] or two[1]["records"]] == pytest.approx(losses, rel=REL)
    stopped = train(load_config("tiny", overrides + [f"run_dir={tmp_path / 'r'}", "train.stop_after=2"]))
    resumed = train(load_config("tiny", overrides + [f"run_dir={tmp_path / 'r'}"]))
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in stopped + resumed] == pytest.approx(losses, rel=REL)

    changed = [_sources(a, b, 1, 2), f"run_dir={tmp_path / 'r'}", "train.steps=6", "checkpoint.every=2"]
    assert main(["--config", "tiny", *changed]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain: error: checkpoint.resume: the checkpoint of step 4 was trained on "
                          f"data.sources=[{a} x1 (162 sequences), {b} x3 (40 sequences)], this run has "
                          f"[{a} x1 (162 sequences), {b} x2 (40 sequences)]")


def test_data_sources_from_toml_and_the_command_line(tmp_path):
    a, b = _two_sources(tmp_path)
    toml = tmp_path / "run.toml"
    toml.write_text(f'[[data.sources]]\npath = "{a}"\nweight = 1\n\n[[data.sources]]\npath = "{b}"\n')
    from_file = load_config(str(toml))
    from_line = load_config(None, [_sources(a, b, 1, 1.0)])
    assert from_file.data.sources == from_line.data.sources
    assert [(s.path, s.weight) for s in from_file.data.sources] == [(str(a), 1.0), (str(b), 1.0)]
    written = tmp_path / "resolved.toml"
    written.write_text(config_toml(from_file))
    assert load_config(str(written)).data.sources == from_file.data.sources


@pytest.mark.parametrize("override, message", [
    ('data.sources=[{path="A", weight=-1}, {path="B", weight=1}]',
     "data.sources[0].weight must be a finite number >= 0, got -1.0 (the command line)"),
    ('data.sources=[{path="A", weight=0}, {path="B", weight=0}]',
     "data.sources: every weight is 0 (the command line); at least one must be positive"),
    ('data.sources=[{path="A", wieght=1}]', "unknown key 'wieght' in data.sources[0]; it takes path, weight"),
    ('data.sources=[{path="A"}, "B"]', "data.sources[1] expects a table like {path = ...}, got 'B'"),
    ("data.sources=A:1", "data.sources expects a TOML array of tables such as"),
    ('data.sources=[{path="stdlib"}]', "data.sources[0].path must name a token directory, got 'stdlib'"),
])
def test_bad_mixtures_are_one_line_and_exit_2(tmp_path, capsys, override, message):
    assert main(["--config", "tiny", override, f"run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pretrain: error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_weights_in_a_file_are_named_with_the_file(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('[[data.sources]]\npath = "x"\nweight = -2\n')
    assert main(["--config", str(toml)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"pretrain: error: data.sources[0].weight must be a finite number >= 0, got -2.0 (file {toml})")


def test_path_and_sources_together_are_refused(tmp_path, capsys):
    assert main(["--config", "tiny", "data.path=x", 'data.sources=[{path="y"}]']) == 2
    assert "data.path='x' and data.sources are both set" in capsys.readouterr().err


def test_sources_of_two_tokenizers_are_refused_naming_both(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    a, _ = _two_sources(tmp_path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "w": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "w.txt").write_text("w w w\n" * 100)
    prepare_data([tmp_path / "w.txt"], tmp_path / "words", tmp_path / "tok.json", eos_id=0)
    assert main(["--config", "tiny", _sources(a, tmp_path / "words"), "model.vocab_size=512",
                 f"run_dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pretrain: error: data.sources: {a / 'tokens.json'} and "
                          f"{tmp_path / 'words' / 'tokens.json'} have vocab_size 257 and 2")
    assert err.endswith("a mixture's sources must share one tokenizer and vocabulary")


def test_the_vocabulary_defaults_to_the_data_rounded_to_64(tmp_path, capsys):
    a, _ = _two_sources(tmp_path)
    cfg = load_config("tiny", [f"data.path={a}"])
    assert resolve_vocab_size(cfg) == (f"model.vocab_size=320: the data's vocabulary of 257 "
                                       f"({a / 'tokens.json'}) rounded up to a multiple of 64")
    assert cfg.model.vocab_size == 320
    kept = load_config("tiny", [f"data.path={a}", "model.vocab_size=1000"])
    assert resolve_vocab_size(kept) is None and kept.model.vocab_size == 1000
    default = load_config("default")
    assert resolve_vocab_size(default) is None and default.model.vocab_size == 256
    assert main(["--config", "tiny", f"data.path={a}", "model.vocab_size=256",
                 f"run_dir={tmp_path / 'run'}"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"pretrain: error: {a / 'tokens.json'}: the data's vocab_size 257 exceeds model.vocab_size=256")
