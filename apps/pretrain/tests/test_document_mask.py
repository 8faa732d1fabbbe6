"""``data.document_mask``: the run's first loss equals the loss of every document on its own."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from moe_model import MoETransformer, flops_per_token, init_weights
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.data import BatchReader, open_data, resolve_vocab_size


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Byte data of short documents (end of text 256), so most windows hold several."""
    root = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": "".join(rng.choice(list("abcdefgh xyz"), int(n)))}) + "\n"
                              for n in rng.integers(3, 40, 120)))
    out = root / "tokens"
    assert main(["prepare-data", str(corpus), "--out", str(out), "--workers", "1"]) == 0
    return out


def _first_loss(run) -> float:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def _per_document_loss(overrides: list[str]) -> float:
    """The first step's loss with the run's initial weights, each document of each window
    run through the model alone."""
    cfg = load_config("tiny", overrides)
    resolve_vocab_size(cfg)
    m = MoETransformer(cfg.model)
    init_weights(m, cfg.model, cfg.seed)
    t = cfg.train
    reader = BatchReader(open_data(cfg.data, t.seq_len, cfg.model.vocab_size, cfg.seed), cfg.seed,
                         t.global_batch, t.micro_batch)
    total, split = 0.0, 0
    with torch.no_grad():
        for i in range(reader.n_microbatches):
            for row in reader.microbatch(1, i):
                starts = [0, *(j + 1 for j in range(t.seq_len - 1) if row[j] == 256), t.seq_len]
                split += len(starts) > 2
                for a, e in zip(starts, starts[1:], strict=False):
                    logits = m(row[a:e][None])[0]
                    total += F.cross_entropy(logits, row[a + 1:e + 1], reduction="sum").item()
    assert split > t.global_batch // 2  # most windows hold several documents
    return total / (t.global_batch * t.seq_len)


def test_the_loss_is_that_of_each_document_alone(documents, tmp_path):
    overrides = [f"data.path={documents}", "data.document_mask=true", "train.steps=3",
                 "optim.warmup_steps=1"]
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'masked'}", *overrides]) == 0
    want = _per_document_loss(overrides)
    assert _first_loss(tmp_path / "masked") == pytest.approx(want, rel=1e-5)
    # without the mask the loss is another (the test tells them apart)
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'plain'}", *overrides[:1], *overrides[2:]]) == 0
    assert abs(_first_loss(tmp_path / "plain") - want) > 1e-3


def test_flops_follow_the_mask():
    cfg = load_config("tiny")
    full = flops_per_token(cfg.model, 32)
    half = flops_per_token(cfg.model, 32, 0.5)
    attention = 6 * cfg.model.n_layers * 32 * cfg.model.n_heads * cfg.model.head_dim
    assert full - half == pytest.approx(attention / 2)


@pytest.mark.parametrize(("overrides", "status", "message"), [
    ([], 1, "data.document_mask=true needs data with documents; data.path=stdlib has none"),
    (["data.path=synthetic"], 1, "data.path=synthetic has none"),
    (["parallel.pp=2"], 2, "data.document_mask with parallel.pp > 1 is not supported"),
])
def test_data_without_documents_is_refused_in_one_line(tmp_path, capsys, overrides, status, message):
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'run'}", "data.document_mask=true",
                 *overrides]) == status
    err = capsys.readouterr().err
    assert err.startswith("pretrain: error: ") and err.count("\n") == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_a_token_directory_without_eos_is_refused(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "d" / "a.bin")
    (tmp_path / "d" / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'run'}", "data.document_mask=true",
                 f"data.path={tmp_path / 'd'}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records no eos_id" in err
    assert not (tmp_path / "run").exists()
