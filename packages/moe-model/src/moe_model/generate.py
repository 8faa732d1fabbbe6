"""Autoregressive sampling with a KV cache: greedy, temperature and top-k.

``generate(model, prompt_BS, max_new_tokens)`` reads the prompt once (the prefill),
then one token per step through ``moe_model.kv_cache``. ``temperature=0`` is greedy
(the arg-max, ties to the lowest id, as ``torch.argmax``); otherwise the logits are
divided by the temperature, cut to the ``top_k`` largest (when set) and sampled
with a generator seeded by ``seed``, so a seed gives the same text on every run
of one device. Generation stops early when every sequence has produced
``eos_id`` (the tokens after a sequence's end are ``eos_id``).

Runs on whatever device the model's parameters are on, without gradients.
"""

from __future__ import annotations

import torch

from moe_model.kv_cache import KVCache
from moe_model.model import MoETransformer


def next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """``[B]`` ids chosen from the last position's logits (see the module doc)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    scores = logits_BV.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(model: MoETransformer, prompt_BS: torch.Tensor, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None,
             eos_id: int | None = None) -> torch.Tensor:
    """``[B, N]`` new token ids (``N <= max_new_tokens``) continuing ``prompt_BS``."""
    if prompt_BS.dim() != 2 or prompt_BS.shape[1] < 1:
        raise ValueError(f"the prompt must be [B, S] token ids with S >= 1, got {tuple(prompt_BS.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    param = next(model.parameters())
    B, S = prompt_BS.shape
    out = torch.empty(B, 0, dtype=torch.long, device=param.device)
    if max_new_tokens == 0:
        return out
    generator = None
    if seed is not None:
        generator = torch.Generator(param.device)
        generator.manual_seed(seed)
    cache = KVCache(model.config, B, S + max_new_tokens, param.device, param.dtype)
    logits = model(prompt_BS.to(param.device), cache=cache)[:, -1]
    finished = torch.zeros(B, dtype=torch.bool, device=param.device)
    tokens = []
    for i in range(max_new_tokens):
        token = next_token(logits, temperature, top_k, generator)
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)
            finished |= token == eos_id
        tokens.append(token)
        if i + 1 == max_new_tokens or (eos_id is not None and bool(finished.all())):
            break
        logits = model(token[:, None], cache=cache)[:, -1]
    return torch.stack(tokens, dim=1) if tokens else out
