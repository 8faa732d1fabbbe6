"""Keys and values of the tokens a model has already read, for incremental decoding.

``KVCache(cfg, batch, max_len)`` preallocates ``[B, K, max_len, Dh]`` keys and values
per attention layer. ``MoETransformer.forward(tokens, cache=cache)`` reads the new
tokens at positions ``[cache.length, cache.length + S)`` (RoPE at those positions),
writes their keys and values, attends over everything held, and advances
``cache.length`` by ``S``. A prompt is one such call (the prefill), each new token
another.

Shape legend: B batch, K kv heads, Dh head dim.
"""

from __future__ import annotations

import torch

from moe_model.config import MoEConfig


class LayerKV:
    """One attention layer's keys and values, ``[B, K, max_len, Dh]`` each."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    def append(self, start: int, k_BKSDh: torch.Tensor, v_BKSDh: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values at ``[start, start + S)``; all held ones, ``[:start + S]``."""
        end = start + k_BKSDh.shape[2]
        self.keys[:, :, start:end] = k_BKSDh
        self.values[:, :, start:end] = v_BKSDh
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every attention layer's keys and values and the number of positions held."""

    def __init__(self, cfg: MoEConfig, batch: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"KVCache needs batch >= 1 and max_len >= 1, got {batch}, {max_len}")
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.layers = [LayerKV(torch.zeros(shape, device=device, dtype=dtype),
                               torch.zeros(shape, device=device, dtype=dtype))
                       for _ in range(cfg.n_layers)]
        self.batch, self.max_len, self.length = batch, max_len, 0

    def check_room(self, new: int) -> None:
        if self.length + new > self.max_len:
            raise ValueError(f"KVCache holds {self.length} of {self.max_len} positions; "
                             f"{new} more do not fit")
