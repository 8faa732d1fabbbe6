"""Held-out evaluation (data.val_path, eval.every, eval.tokens).

The oracle for one process is the plain model's forward and ``F.cross_entropy`` over the
windows cut from the raw ``.bin`` with numpy; every layout must give that process's value
(the same windows, whatever the split), and evaluating must leave training untouched.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_model import documents_from_eos
from moe_testing import run_distributed
from pretrain.cli import main
from pretrain.config import load_config, validate_layout
from pretrain.data import prepare_data
from pretrain.evaluate import eval_every, eval_rows
from pretrain.graphs import launch_fingerprint
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog
from pretrain.plot import plot_run
from pretrain.runtime import distributed
from pretrain.train import train
from pretrain.trainer import Trainer

REL = 1e-5
SEQ = 32  # the tiny preset's train.seq_len
N_WINDOWS = 11  # not a multiple of any layout's dp * micro_batch: the last round is padded


def _text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 6))) for _ in range(40)]
    return " ".join(rng.choice(words) for _ in range(n_words))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """Byte-token directories: training text and held-out text of the same kind."""
    root = tmp_path_factory.mktemp("data")
    (root / "train.txt").write_text(_text(1, 3000))
    (root / "val").mkdir()
    for i in range(12):  # documents of about 100 tokens: several in a window
        (root / "val" / f"{i:02d}.txt").write_text(_text(2 + i, 25))
    prepare_data([root / "train.txt"], root / "train")
    prepare_data([root / "val"], root / "val_tokens")
    return root / "train", root / "val_tokens"


def _overrides(data: tuple[Path, Path], *more: str) -> list[str]:
    train_dir, val_dir = data
    return [f"data.path={train_dir}", f"data.val_path={val_dir}", "model.vocab_size=320",
            f"eval.tokens={N_WINDOWS * SEQ + 5}", "checkpoint.final=false", *more]


def _trainer(overrides: list[str]) -> Trainer:
    cfg = load_config("tiny", overrides)
    return Trainer(cfg, build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu"),
                   torch.device("cpu"))


class _NoStop:
    requested = False

    def describe(self) -> str:
        return ""


def _oracle(val_dir: Path, model: torch.nn.Module, n_windows: int, eos: int | None = None) -> float:
    """Mean next-token cross entropy of the first ``n_windows`` windows, in one forward
    (``eos``: attention inside the documents that end with it)."""
    tokens = np.fromfile(val_dir / "part-00000.bin", dtype=np.uint16).astype(np.int64)
    windows = torch.from_numpy(np.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(n_windows)]))
    inputs = windows[:, :-1]
    documents = None if eos is None else documents_from_eos(inputs, eos)
    with torch.no_grad():
        logits = model(inputs, documents=documents)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(),
                           windows[:, 1:].reshape(-1)).item()


def test_eval_rows_hold_each_window_once_on_every_layout():
    for dp, mb in [(1, 2), (2, 2), (4, 1), (2, 3)]:
        rows = [np.concatenate(eval_rows(N_WINDOWS, dp, r, mb)) for r in range(dp)]
        assert len({len(r) for r in rows}) == 1  # every rank runs as many microbatches
        ids = np.concatenate(rows)
        assert sorted(ids[ids >= 0].tolist()) == list(range(N_WINDOWS))
        assert (ids[ids < 0] == -1).all()


@pytest.mark.parametrize("more", [[], ["data.document_mask=true"], ["model.recompute=block"]],
                         ids=["causal", "document_mask", "recompute"])
def test_one_process_eval_is_the_plain_models_loss_on_the_first_windows(data, more):
    with distributed("cpu"):
        trainer = _trainer(_overrides(data, *more))
        try:
            assert trainer.evaluator.n_windows == N_WINDOWS  # eval.tokens // seq_len
            ours = trainer.evaluate().item() / trainer.evaluator.n_tokens
            expected = _oracle(data[1], trainer.model, N_WINDOWS, trainer.document_eos)
            if trainer.document_eos is not None:  # the mask matters on these windows
                assert abs(_oracle(data[1], trainer.model, N_WINDOWS) - expected) > 1e-3
        finally:
            trainer.close()
    assert ours == pytest.approx(expected, rel=REL)


def test_eval_tokens_is_capped_by_the_file(data):
    n_tokens = (data[1] / "part-00000.bin").stat().st_size // 2
    with distributed("cpu"):
        trainer = _trainer(_overrides(data, "eval.tokens=100000000"))
        try:
            assert trainer.evaluator.n_windows == (n_tokens - 1) // SEQ
        finally:
            trainer.close()


def _eval_on_layout(overrides: list[str]) -> dict:
    """The untrained weights' held-out loss, then two steps evaluated after each."""
    trainer = _trainer([*overrides, "train.steps=2", "eval.every=1", "optim.warmup_steps=1"])
    try:
        initial = trainer.evaluate().item() / trainer.evaluator.n_tokens
        records = trainer.fit(MetricsLog([]), _NoStop())
    finally:
        trainer.close()
    return {"initial": initial, "val_loss": [r["val_loss"] for r in records],
            "loss": [r["loss"] for r in records]}


# global-batch load balancing trains like one process when each rank runs one microbatch
# (the one process then runs the whole batch as one): the EP2 case, as in test_layouts
ONE_MICROBATCH = ["model.lb_loss_granularity=global_batch", "train.micro_batch=8"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("n_procs, layout, reference", [
    (2, [], []),
    (2, ["parallel.ep=2", "model.lb_loss_granularity=global_batch", "train.micro_batch=4"],
     ONE_MICROBATCH),
    (2, ["parallel.pp=2"], []),
    (4, ["parallel.pp=2", "parallel.pp_schedule=gpipe"], []),
], ids=["dp2", "ep2", "pp2", "dp2xpp2"])
def test_every_layout_evaluates_as_one_process(data, n_procs, layout, reference):
    """The untrained weights' held-out loss equals the one process's (and that the
    oracle's); after each of two training steps, the records' too."""
    with distributed("cpu"):
        one = _eval_on_layout(_overrides(data, *reference))
    ranks = run_distributed(_eval_on_layout, n_procs, _overrides(data, *layout), timeout=240)
    for ours in ranks:  # every rank reads the same sums
        assert ours["initial"] == pytest.approx(one["initial"], rel=REL)
        assert ours["loss"] == pytest.approx(one["loss"], rel=REL)
        assert ours["val_loss"] == pytest.approx(one["val_loss"], rel=REL)
    assert one["val_loss"][1] < one["initial"]


def _state(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {f"model.{n}": t.detach().clone()
             for n, t in [*trainer.model.named_parameters(), *trainer.model.named_buffers()]}
    for key, shard in trainer.optimizer.sharded_state().items():  # main weights, moments, step
        state[f"optim.{key}"] = shard.local.detach().clone()
    return state


def test_evaluation_leaves_training_bit_identical(data):
    """Weights, router biases, optimizer moments and the records of the following steps
    equal a run's without evaluation, bit for bit; the model's launch fingerprint (what
    a captured CUDA graph replays against) is unchanged by an evaluation."""
    runs = {}
    with distributed("cpu"):
        for evaluate in (True, False):
            trainer = _trainer(_overrides(data, "train.steps=3", "model.bias_update_rate=0.01",
                                          f"eval.every={1 if evaluate else 0}"))
            try:
                before = launch_fingerprint(trainer.model)
                records = trainer.fit(MetricsLog([]), _NoStop())
                assert launch_fingerprint(trainer.model) == before
                runs[evaluate] = records, _state(trainer)
            finally:
                trainer.close()
    (records, state), (plain_records, plain_state) = runs[True], runs[False]
    assert [r["step"] for r in records if "val_loss" in r] == [1, 2, 3]
    assert not any("val_loss" in r for r in plain_records)
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load", "skipped")
    assert [[r[k] for k in keys] for r in records] == [[r[k] for k in keys] for r in plain_records]
    assert state.keys() == plain_state.keys()
    for name, value in plain_state.items():
        assert torch.equal(state[name], value), name


def test_metrics_progress_and_plot_show_the_validation_loss(data, tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    records = train(load_config("tiny", _overrides(data, "train.steps=5", "eval.every=2",
                                                   f"run_dir={run}")))
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 5]  # and at the end
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        assert ("val_loss" in line) == (line["step"] in (2, 4, 5))
        if "val_loss" in line:
            assert line["val_ppl"] == pytest.approx(math.exp(line["val_loss"]), rel=1e-12)
    out = capsys.readouterr().out
    assert f"val_loss {lines[1]['val_loss']:.4f}" in out
    assert f"validation loss {lines[-1]['val_loss']:.4f} (step 5)" in out

    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_run(run)
    lines_by_label = {line.get_label(): line for line in figures[0].axes[0].get_lines()}
    validation = lines_by_label["validation loss (data.val_path)"]
    assert list(validation.get_xdata()) == [2, 4, 5]
    assert list(validation.get_ydata()) == [line["val_loss"] for line in lines if "val_loss" in line]


def test_a_stop_request_evaluates_the_last_step(data):
    class StopNow(_NoStop):
        requested = True

        def describe(self) -> str:
            return "a test's stop"

    with distributed("cpu"):
        trainer = _trainer(_overrides(data, "train.steps=10", "eval.every=5"))
        try:
            records = trainer.fit(MetricsLog([]), StopNow())
        finally:
            trainer.close()
    assert len(records) == 1 and "val_loss" in records[0]


def test_the_default_is_every_tenth_of_the_run(data):
    assert eval_every(load_config("tiny", _overrides(data, "train.steps=250"))) == 25
    assert eval_every(load_config("tiny", _overrides(data, "train.steps=4"))) == 1
    assert eval_every(load_config("tiny", _overrides(data, "eval.every=0"))) == 0
    assert eval_every(load_config("tiny", ["train.steps=250"])) == 0  # no data.val_path


def _one_line_error(capsys, code: int, args: list[str]) -> str:
    assert main(args) == code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_validation_data_of_another_tokenizer_or_vocabulary_is_refused(data, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    train_dir, val_dir = data
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "w": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "w.txt").write_text("w w w\n" * 100)
    prepare_data([tmp_path / "w.txt"], tmp_path / "words", tmp_path / "tok.json", eos_id=0)
    run = tmp_path / "run"
    err = _one_line_error(capsys, 1, ["--config", "tiny", f"data.path={train_dir}",
                                      f"data.val_path={tmp_path / 'words'}", f"run_dir={run}"])
    assert err.startswith(f"pretrain: error: {tmp_path / 'words' / 'tokens.json'} (tokenizer 'tok.json'")
    assert f"does not match the training data's {train_dir / 'tokens.json'} (tokenizer 'bytes'" in err
    assert not run.exists()

    # the same tokenizer with another vocabulary
    bigger = tmp_path / "bigger"
    bigger.mkdir()
    for f in val_dir.iterdir():
        (bigger / f.name).write_bytes(f.read_bytes())
    sidecar = json.loads((bigger / "tokens.json").read_text())
    (bigger / "tokens.json").write_text(json.dumps({**sidecar, "vocab_size": 300}))
    err = _one_line_error(capsys, 1, ["--config", "tiny", f"data.path={train_dir}",
                                      f"data.val_path={bigger}", f"run_dir={run}"])
    assert "vocab_size 300) does not match" in err and "vocab_size 257)" in err
    assert not run.exists()

    err = _one_line_error(capsys, 1, ["--config", "tiny", f"data.val_path={val_dir}", f"run_dir={run}"])
    assert "data.val_path=" in err and "not data.path='stdlib'" in err
    assert not run.exists()


def test_token_files_without_a_tokenizer_record_compare_by_vocabulary(tmp_path):
    """Files from other tools carry only dtype and vocab_size: both sides ``unknown``."""
    for name, n in (("train", 2000), ("val", 500)):
        (tmp_path / name).mkdir()
        np.random.default_rng(n).integers(0, 300, n, dtype=np.uint16).tofile(tmp_path / name / "a.bin")
        (tmp_path / name / "tokens.json").write_text('{"dtype": "uint16", "vocab_size": 300}')
    records = train(load_config("tiny", [f"data.path={tmp_path / 'train'}", "train.steps=1",
                                         "optim.schedule=constant",
                                         f"data.val_path={tmp_path / 'val'}", "eval.tokens=64",
                                         f"run_dir={tmp_path / 'run'}", "checkpoint.final=false"]))
    assert math.isfinite(records[0]["val_loss"])


@pytest.mark.parametrize("args, message", [
    (["eval.every=3"], "eval.every=3 needs data.val_path"),
    (["eval.every=-1"], "eval.every must be >= 0 or none, got -1"),
    (["data.val_path=x", "eval.tokens=31"], "eval.tokens=31 holds no window of train.seq_len=32 tokens"),
    (["eval.tokens=0"], "eval.tokens must be positive, got 0"),
])
def test_bad_eval_keys_are_one_line_and_exit_2(capsys, args, message):
    assert _one_line_error(capsys, 2, ["--config", "tiny", *args]).endswith(message)


def test_eval_prompts_are_completed_at_each_evaluation(data, tmp_path, capsys):
    """``eval.prompts``: greedy completions at the evaluation steps, in samples.jsonl and
    printed, equal to moe_model.generate on the final weights at the last one."""
    run = tmp_path / "run"
    cfg = load_config("tiny", _overrides(data, "train.steps=4", "eval.every=2", f"run_dir={run}",
                                         "checkpoint.final=true", "eval.max_new_tokens=5",
                                         "eval.prompts=the,of a"))
    train(cfg)
    lines = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [(x["step"], x["prompt"]) for x in lines] == [(2, "the"), (2, "of a"), (4, "the"), (4, "of a")]
    out = capsys.readouterr().out
    assert f"sample (step 4): 'the' -> {lines[2]['completion']!r}" in out
    # the last completions are what the final checkpoint's weights generate
    from moe_model import generate
    from pretrain.inference import load_checkpoint_model
    from pretrain.tokenizer_files import data_tokenizer, load_tokenizer
    loaded = load_checkpoint_model(run / "checkpoints" / "step_0000000004", torch.device("cpu"),
                                   torch.float32)
    tok = load_tokenizer(data_tokenizer(cfg.data)["json"], "test")
    for line in lines[2:]:
        ids = torch.tensor([tok.encode(line["prompt"]).ids])
        new = generate(loaded.model, ids, 5)[0].tolist()
        eos = data_tokenizer(cfg.data).get("eos_id")
        new = new[:new.index(eos)] if eos in new else new
        assert line["completion"] == tok.decode(new)


@pytest.mark.parametrize("args, message", [
    (["eval.prompts=hello"], "set data.val_path"),
    (["eval.prompts=hello", "data.val_path=x", "eval.every=0"], "set data.val_path (and eval.every > 0)"),
    (["eval.prompts=hello", "data.val_path=x", "parallel.pp=2"],
     "eval.prompts needs the whole model on each rank: parallel.pp=1"),
    (["eval.max_new_tokens=0"], "eval.max_new_tokens must be positive, got 0"),
])
def test_eval_prompts_without_evaluations_are_refused(capsys, args, message, tmp_path):
    err = _one_line_error(capsys, 2, ["--config", "tiny", f"run_dir={tmp_path / 'r'}", *args])
    assert message in err
