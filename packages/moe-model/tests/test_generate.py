"""Incremental decoding with a KV cache, and sampling: against the full forward and transformers."""

import pytest
import torch
from moe_model import KVCache, MoEConfig, MoETransformer, generate, init_weights, next_token

CFG = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=6, top_k=3, expert_hidden=16, n_dense_layers=1, dense_hidden=40,
           init_std=0.2)


def model(**kw) -> MoETransformer:
    cfg = MoEConfig(**{**CFG, **kw})
    m = MoETransformer(cfg)
    init_weights(m, cfg, seed=3)
    return m.eval()


def test_cached_pieces_equal_the_full_forward():
    m = model()
    x = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = m(x)
        cache = KVCache(m.config, 2, 16)
        pieces = [m(x[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 10), (10, 13))]
    assert cache.length == 13
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


def test_greedy_is_the_argmax_of_the_full_forward_at_every_step():
    m = model()
    prompt = torch.tensor([[5, 9, 2, 33]])
    new = generate(m, prompt, 8)
    seq = prompt
    with torch.no_grad():
        for _ in range(8):  # no cache: the whole sequence each time
            seq = torch.cat([seq, m(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, seq[:, 4:])


def test_sampling_is_seeded_and_top_k_one_is_greedy():
    m = model()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(m, prompt, 12, temperature=1.0, top_k=8, seed=7)
    assert torch.equal(a, generate(m, prompt, 12, temperature=1.0, top_k=8, seed=7))
    assert not torch.equal(a, generate(m, prompt, 12, temperature=1.0, top_k=8, seed=8))
    assert torch.equal(generate(m, prompt, 12, temperature=0.7, top_k=1, seed=1), generate(m, prompt, 12))


def test_top_k_samples_only_the_k_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).repeat(400, 1)
    picked = next_token(logits, temperature=5.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(picked.tolist()) == {1, 3}


def test_generation_stops_at_eos_and_pads_finished_rows():
    m = model()
    prompt = torch.tensor([[5, 9, 2, 33], [1, 1, 2, 3]])
    free = generate(m, prompt, 6)
    eos = int(free[0, 1])  # the first row's second token ends it
    stopped = generate(m, prompt, 6, eos_id=eos)
    assert torch.equal(stopped[0, :2], free[0, :2]) and (stopped[0, 1:] == eos).all()


def test_a_full_cache_is_refused():
    m = model()
    cache = KVCache(m.config, 1, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="4 of 4 positions"):
        m(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        m(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_greedy_equals_transformers_generate(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from moe_model.hf import save_pretrained

    m = model(norm_topk_weights=True)
    save_pretrained(m, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    prompt = torch.tensor([[7, 3, 50, 12, 9]])
    want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                       max_new_tokens=20, min_new_tokens=20, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(m, prompt, 20), want[:, 5:])
