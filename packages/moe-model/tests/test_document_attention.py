"""Document-masked attention equals attention over each document computed on its own."""

import pytest
import torch
from moe_model import (
    DocumentMask,
    MoEConfig,
    MoETransformer,
    attended_pairs,
    documents_from_eos,
    init_weights,
)
from moe_model.layers import Attention

EOS = 0
# row 0: three documents (the last cut by the window), row 1: one long one, then a short one
TOKENS = torch.tensor([[5, 7, 0, 9, 9, 3, 0, 4, 8, 2, 6, 1],
                       [3, 3, 4, 5, 6, 7, 8, 9, 1, 2, 0, 7]])


def test_documents_start_after_each_eos():
    want = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2],
                         [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.int32)
    assert torch.equal(documents_from_eos(TOKENS, EOS), want)
    lengths = [3, 4, 5, 11, 1]
    assert int(attended_pairs(want)) == sum(n * (n + 1) // 2 for n in lengths)


def _spans(row: torch.Tensor) -> list[tuple[int, int]]:
    ids = documents_from_eos(row[None], EOS)[0]
    return [(int((ids == d).nonzero()[0]), int((ids == d).nonzero()[-1]) + 1) for d in ids.unique()]


def test_attention_layer_equals_per_document_attention():
    cfg = MoEConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 12, 32)
    got = attn(x, DocumentMask(documents_from_eos(TOKENS, EOS)))
    for b in range(2):
        for a, e in _spans(TOKENS[b]):
            # a document alone starts at position 0: RoPE is relative, so the scores match
            alone = attn(x[b:b + 1, a:e])
            torch.testing.assert_close(got[b:b + 1, a:e], alone, rtol=1e-5, atol=1e-5)


def test_model_forward_and_backward_equal_per_document_runs():
    cfg = MoEConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16, init_std=0.1)
    m = MoETransformer(cfg)
    init_weights(m, cfg, seed=0)
    m.eval()
    got = m(TOKENS, documents=documents_from_eos(TOKENS, EOS))
    got.square().sum().backward()
    grad = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    total = 0
    for b in range(2):
        for a, e in _spans(TOKENS[b]):
            alone = m(TOKENS[b:b + 1, a:e])
            torch.testing.assert_close(got[b:b + 1, a:e], alone, rtol=1e-5, atol=1e-5)
            total = total + alone.square().sum()
    total.backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(grad[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_without_document_breaks_it_is_causal_attention():
    cfg = MoEConfig(d_model=32, n_heads=4, n_kv_heads=4, head_dim=8)
    attn = Attention(cfg)
    x = torch.randn(2, 9, 32)
    one_document = torch.zeros(2, 9, dtype=torch.int32)
    torch.testing.assert_close(attn(x, DocumentMask(one_document)), attn(x), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kernel"):
        DocumentMask(torch.zeros(1, 4, dtype=torch.int32), kernel="flash")
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        DocumentMask(torch.zeros(4, dtype=torch.int32))


@pytest.mark.gpu
def test_flex_on_cuda_equals_the_dense_mask():
    """The CUDA kernel (FlexAttention) against the dense-mask SDPA path, forward and backward,
    for two batches of different documents (the second reuses the compiled kernel)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    q = torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", requires_grad=True) for _ in range(2))
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        starts = torch.rand(2, 256, generator=g) < 1 / 40
        starts[:, 0] = False
        ids = torch.cumsum(starts.int(), dim=1, dtype=torch.int32).cuda()
        outs = []
        for kernel in ("flex", "sdpa"):
            out = DocumentMask(ids, kernel=kernel).attend(q, k, v)
            outs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)
