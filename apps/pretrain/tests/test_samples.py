"""Prompts completed at an evaluation and appended to samples.jsonl."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from moe_model import MoEConfig, MoETransformer, init_weights
from pretrain.samples import SAMPLES_FILE, PromptSamples
from pretrain.tokenizer_files import TokenizerError, byte_level_tokenizer

CFG = MoEConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                n_experts=4, top_k=2, expert_hidden=16, init_std=0.3)
BYTES = {"name": "bytes", "sha256": None, "eos_id": 256, "json": byte_level_tokenizer(256)}


def _model() -> MoETransformer:
    m = MoETransformer(CFG)
    init_weights(m, CFG, seed=5)
    return m  # left in training mode, as the evaluation finds it


def _greedy_without_cache(m: MoETransformer, ids: list[int], n: int) -> list[int]:
    seq = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids):].tolist()


def test_samples_are_greedy_completions_appended_per_step(tmp_path):
    m = _model()
    path = tmp_path / SAMPLES_FILE
    samples = PromptSamples(["def f(", "héllo"], 12, BYTES, path)
    first = samples(m, 10)
    samples(m, 20)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in lines] == [(10, "def f("), (10, "héllo"),
                                                         (20, "def f("), (20, "héllo")]
    assert lines[:2] == first
    assert [r["completion"] for r in lines[2:]] == [r["completion"] for r in first]
    for record in first:
        new = _greedy_without_cache(m, list(record["prompt"].encode()), 12)
        new = new[:new.index(256)] if 256 in new else new
        assert record["completion"] == samples.tokenizer.decode(new)
    assert m.training and all(p.grad is None for p in m.parameters())


def test_completions_end_at_the_end_of_text():
    m = _model()
    ids = _greedy_without_cache(m, list(b"ab"), 6)
    free = PromptSamples(["ab"], 6, {**BYTES, "eos_id": None}, None)
    assert free(m, 1)[0]["completion"] == free.tokenizer.decode(ids)
    # the third greedy token named the end of text: the completion stops before it
    cut = PromptSamples(["ab"], 6, {**BYTES, "eos_id": ids[2]}, None)
    assert cut(m, 1)[0]["completion"] == cut.tokenizer.decode(ids[:ids.index(ids[2])])


def test_refusals():
    with pytest.raises(TokenizerError, match="needs the data's tokenizer"):
        PromptSamples(["x"], 4, {"name": "synthetic", "json": None}, None)
    with pytest.raises(TokenizerError, match="encodes to no tokens"):
        PromptSamples([""], 4, BYTES, None)
    stage = _model()
    stage.embed = None
    with pytest.raises(ValueError, match="whole model"):
        PromptSamples(["x"], 4, BYTES, None)(stage, 1)


def test_samples_drop_no_prompt_token_whatever_the_training_capacity():
    """A capacity sized for training batches drops slots of a short prefill; the samples
    are those of the same weights run dropless, as inference runs them, and the training
    capacity is back afterwards."""
    tight = dataclasses.replace(CFG, capacity_factor=0.5)
    m = MoETransformer(tight)
    init_weights(m, tight, seed=5)
    dropless = MoETransformer(CFG)
    dropless.load_state_dict(m.state_dict())
    prompt = "def f(x): return x"
    ids = list(prompt.encode())
    with torch.no_grad():
        m.eval(), dropless.eval()
        assert not torch.equal(m(torch.tensor([ids])), dropless(torch.tensor([ids])))  # it drops
        m.train()
    want = _greedy_without_cache(dropless, ids, 8)
    want = want[:want.index(256)] if 256 in want else want
    samples = PromptSamples([prompt], 8, BYTES, None)
    assert samples(m, 1)[0]["completion"] == samples.tokenizer.decode(want)
    assert {b.mlp.dispatcher.capacity_factor for b in m.blocks.values()} == {0.5}
