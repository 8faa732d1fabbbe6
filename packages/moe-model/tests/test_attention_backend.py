"""Which SDPA kernel the attention asks for (``MoEConfig.attention_backend``)."""

import pytest
import torch
import torch.nn.functional as F
from moe_model import MoEConfig
from moe_model.layers import Attention, sdpa_priority
from torch.nn.attention import SDPBackend

ALL = {SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
       SDPBackend.MATH}


@pytest.mark.parametrize(("backend", "first"), [
    ("auto", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
])
def test_priority_on_cuda(backend, first):
    order = sdpa_priority(backend, torch.device("cuda", 0))  # planned only: no GPU needed
    if first is None:
        assert order is None  # PyTorch's own selection, no context per call
    else:  # the choice first, and every other backend after it, so nothing fails to run
        assert order[0] == first and set(order) == ALL and len(order) == len(ALL)


@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash"])
def test_cpu_attention_is_pytorch_sdpa_whatever_the_backend(backend):
    assert sdpa_priority(backend, torch.device("cpu")) is None
    cfg = MoEConfig(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, attention_backend=backend)
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 7, 32)
    want = _attention_by_hand(attn, x)
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-6)


def _attention_by_hand(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """The module's math with an explicit causal softmax and repeated KV heads."""
    from moe_model.layers import apply_rope, rope_tables

    B, S, _ = x.shape
    H, K, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_norm(attn.wq(x).view(B, S, H, Dh)).transpose(1, 2)
    k = attn.k_norm(attn.wk(x).view(B, S, K, Dh)).transpose(1, 2)
    v = attn.wv(x).view(B, S, K, Dh).transpose(1, 2)
    cos, sin = rope_tables(S, Dh, attn.rope_theta, x.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    scores = (q @ k.transpose(-1, -2)) / Dh**0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = F.softmax(scores, dim=-1) @ v
    return attn.wo(out.transpose(1, 2).reshape(B, S, H * Dh))
