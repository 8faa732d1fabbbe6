"""Sampling (``pretrain generate``) and a complete export: tokenizer, generation config, and
``transformers`` using the folder alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from moe_model import generate
from pretrain.cli import main
from pretrain.inference import load_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

transformers = pytest.importorskip("transformers")

WORDS = "the of and to in is was for on that with as by at from it an were are which this".split()
PROMPT = "the city was"


def _bpe_tokenizer(path: Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(0)
    tok.train_from_iterator([" ".join(rng.choice(WORDS, 100)) for _ in range(30)], trainer)
    tok.save(str(path))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """prepare-data --tokenizer (training and held-out text) -> a tiny run that evaluates and
    samples -> its last checkpoint."""
    root = tmp_path_factory.mktemp("path")
    _bpe_tokenizer(root / "bpe.json")
    corpus = root / "corpus.jsonl"
    rng = np.random.default_rng(1)
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, int(n)))}) + "\n"
                              for n in rng.integers(5, 60, 200)))
    held_out = root / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, int(n)))}) + "\n"
                                for n in rng.integers(5, 60, 40)))
    tokens, val_tokens = root / "tokens", root / "val_tokens"
    for source, out in ((corpus, tokens), (held_out, val_tokens)):
        assert main(["prepare-data", str(source), "--out", str(out), "--tokenizer",
                     str(root / "bpe.json"), "--workers", "1"]) == 0
    run = root / "run"
    assert main(["--config", "tiny", f"run_dir={run}", f"data.path={tokens}", "train.steps=6",
                 "checkpoint.every=6", f"data.val_path={val_tokens}", "eval.every=3",
                 "eval.tokens=256", "eval.prompts=the city", "eval.max_new_tokens=4"]) == 0
    evaluated = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                 if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6]
    assert all(np.isfinite(r["val_loss"]) for r in evaluated)
    assert len((run / "samples.jsonl").read_text().splitlines()) == 2
    return root, run / "checkpoints" / "step_0000000006"


def test_generate_greedy_equals_transformers_on_the_export(trained, tmp_path, capsys):
    root, checkpoint = trained
    out = tmp_path / "hf"
    assert main(["export-hf", str(checkpoint), str(out), "--dtype", "float32"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=20, min_new_tokens=20, suppress_tokens=None)
    loaded, _ = load_model(checkpoint, torch.device("cpu"), torch.float32)
    got = generate(loaded.model, prompt, 20)  # no end of text: 20 tokens each
    assert torch.equal(got, want[:, prompt.shape[1]:])

    # the command, from the checkpoint and from the export: the same text transformers
    # writes (both stop at the end-of-text id generation_config.json names)
    stopping = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=20)
    text = PROMPT + tok.decode(stopping[0, prompt.shape[1]:], skip_special_tokens=True)
    for source in (checkpoint, out):
        capsys.readouterr()
        assert main(["generate", str(source), "--prompt", PROMPT, "--max-new-tokens", "20"]) == 0
        assert capsys.readouterr().out == text + "\n"


def test_sampling_is_seeded(trained, capsys):
    _, checkpoint = trained
    args = ["generate", str(checkpoint), "--prompt", PROMPT, "--temperature", "1.5", "--top-k", "50"]
    texts = []
    for seed in (1, 1, 2):
        assert main([*args, "--seed", str(seed)]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2]


PIPELINE = """
import sys, transformers
out = sys.argv[1]
tok = transformers.AutoTokenizer.from_pretrained(out)
assert tok.eos_token == "<|endoftext|>", tok.eos_token
pipe = transformers.pipeline("text-generation", model=out)
text = pipe("the city was", max_new_tokens=8, do_sample=False)[0]["generated_text"]
assert text.startswith("the city was") and len(text) > len("the city was"), text
print(repr(text))
"""


@pytest.mark.slow  # (a fresh interpreter importing transformers: ~50 s on two loaded cores)
def test_the_export_works_from_its_folder_alone(trained, tmp_path):
    """prepare-data --tokenizer -> train with evaluation -> export-hf -> pipeline, with the
    data, the run and the tokenizer file moved away and the folder moved: nothing outside it
    is read."""
    root, checkpoint = trained
    out = tmp_path / "hf"
    assert main(["export-hf", str(checkpoint), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["max_position_embeddings"] == 32  # the tiny preset's train.seq_len
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == \
        Tokenizer.from_file(str(root / "bpe.json")).token_to_id("<|endoftext|>")
    alone = tmp_path / "elsewhere" / "model"
    alone.parent.mkdir()
    shutil.copytree(out, alone)
    shutil.rmtree(out)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    hidden = root.with_name(root.name + "_hidden")  # the corpus, tokens, tokenizer file and run
    root.rename(hidden)
    try:
        done = subprocess.run([sys.executable, "-c", PIPELINE, str(alone)],
                              cwd=tmp_path / "elsewhere", env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        hidden.rename(root)
    assert done.returncode == 0, done.stderr[-2000:]


def test_byte_data_exports_a_byte_level_tokenizer(tmp_path):
    """The built-in corpus (bytes, no tokenizer file): the export's tokenizer gives the UTF-8
    bytes as ids, as the run saw them."""
    run = tmp_path / "run"
    assert main(["--config", "tiny", f"run_dir={run}", "train.steps=3", "optim.warmup_steps=1",
                 "checkpoint.every=3"]) == 0
    out = tmp_path / "hf"
    assert main(["export-hf", str(run / "checkpoints" / "step_0000000003"), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return 'é'\n"
    assert tok(text).input_ids == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_a_checkpoint_without_a_tokenizer(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["--config", "tiny", f"run_dir={run}", "data.path=synthetic", "train.steps=3",
                 "optim.warmup_steps=1", "checkpoint.every=3"]) == 0
    checkpoint = run / "checkpoints" / "step_0000000003"
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no tokenizer; name one with --tokenizer" in err
    out = tmp_path / "hf"
    assert main(["export-hf", str(checkpoint), str(out)]) == 0
    assert "records no tokenizer" in capsys.readouterr().out
    assert not (out / "tokenizer.json").exists() and (out / "generation_config.json").is_file()
    # --tokenizer supplies one (here: the byte-level tokenizer of a byte-data export)
    bytes_json = tmp_path / "bytes.json"
    from pretrain.tokenizer_files import byte_level_tokenizer

    bytes_json.write_text(byte_level_tokenizer(None))
    assert main(["generate", str(checkpoint), "--prompt", "ab", "--max-new-tokens", "3",
                 "--tokenizer", str(bytes_json)]) == 0
    assert capsys.readouterr().out.startswith("ab")


@pytest.mark.parametrize(("args", "status", "message"), [
    (["--max-new-tokens", "0"], 2, "--max-new-tokens must be >= 1"),
    (["--temperature", "-1"], 2, "--temperature must be >= 0"),
    (["--top-k", "0"], 2, "--top-k must be >= 1"),
    (["--tokenizer", "NOPE"], 1, "--tokenizer NOPE: cannot read"),
])
def test_generate_refusals_are_one_line(trained, capsys, args, status, message):
    _, checkpoint = trained
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", "the", *args]) == status
    err = capsys.readouterr().err
    assert err.startswith("pretrain: error: ") and err.count("\n") == 1 and message in err


def test_a_source_that_is_no_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for source, message in [(tmp_path / "none", "is not a directory"),
                            (tmp_path, "cannot load it as a Qwen3-MoE model")]:
        assert main(["generate", str(source), "--prompt", "x"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_an_unexportable_model_is_warned_about_at_the_start(tmp_path, capsys):
    assert main(["--config", "tiny", f"run_dir={tmp_path / 'run'}", "train.steps=3",
                 "optim.warmup_steps=1", "model.n_shared_experts=1"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "n_shared_experts > 0" in warnings[0]


def test_a_tied_model_with_a_selection_bias_loads_whole(tmp_path, capsys):
    """Tied embeddings (one stored tensor) and the routers' selection bias (a buffer, which
    Qwen3-MoE cannot hold) come back from our checkpoint as they were saved."""
    from moe_ckpt import read_tensors

    run = tmp_path / "run"
    assert main(["--config", "tiny", f"run_dir={run}", "train.steps=3", "optim.warmup_steps=1",
                 "checkpoint.every=3", "model.tie_embeddings=true", "model.bias_update_rate=0.01"]) == 0
    checkpoint = run / "checkpoints" / "step_0000000003"
    loaded, _ = load_model(checkpoint, torch.device("cpu"), torch.float32)
    m = loaded.model
    assert m.head.weight is m.embed.weight
    saved = dict(read_tensors(checkpoint, ["main/embed.weight", "buffer/blocks.1.mlp.router.expert_bias"]))
    assert torch.equal(m.embed.weight, saved["main/embed.weight"])
    bias = m.blocks["1"].mlp.router.expert_bias
    assert bias.abs().sum() > 0 and torch.equal(bias, saved["buffer/blocks.1.mlp.router.expert_bias"])
    capsys.readouterr()
    assert main(["generate", str(checkpoint), "--prompt", "import ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("import ")
