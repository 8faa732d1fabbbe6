"""The MoE transformer.

Structure (names are stable whatever parallelism is applied later):
``embed`` -> ``blocks["0".."L-1"]`` (attention + MLP) -> ``norm`` -> ``head``.
Each block's MLP is an ``MoELayer``, except the first ``n_dense_layers`` blocks,
which hold a dense ``SwiGLU``. A pipeline stage is this same module with some
blocks removed and ``embed`` or ``norm``/``head`` set to ``None`` (see
``moe_model.partition``): ``forward`` then takes or returns hidden states instead
of tokens or logits. The model itself holds no parallelism.

With ``tie_embeddings`` the head's weight *is* the embedding's parameter; its one
logical name is ``embed.weight`` (a pipeline's last stage that holds only the
head shares it under ``head.weight`` and must keep the two copies in sync).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.document_attention import DocumentMask
from moe_model.embedding import Embedding
from moe_model.kv_cache import KVCache, LayerKV
from moe_model.layers import Attention, RMSNorm, SwiGLU
from moe_model.linear import Linear
from moe_model.moe import MoELayer
from moe_model.recompute import recompute_block


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, moe: bool = True) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp: MoELayer | SwiGLU = (
            MoELayer(cfg) if moe else SwiGLU(cfg.d_model, cfg.dense_hidden_width)
        )
        self.recompute = cfg.recompute

    def forward(self, x_BSD: torch.Tensor, documents: DocumentMask | None = None,
                cache: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        """``documents``, ``cache``, ``start``: see ``Attention.forward``."""
        if self.recompute == "none" or not torch.is_grad_enabled():
            return self._forward(x_BSD, documents, cache, start)
        return recompute_block(functools.partial(self._forward, documents=documents), x_BSD,
                               selective=self.recompute == "selective")

    def _forward(self, x_BSD: torch.Tensor, documents: DocumentMask | None = None,
                 cache: LayerKV | None = None, start: int = 0) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x_BSD), documents, cache, start)
        h_BSD, normed_BSD = self.mlp_norm.add_and_norm(x_BSD, attended)
        return h_BSD + self.mlp(normed_BSD)


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed: Embedding | None = Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict(
            {str(i): Block(cfg, moe=cfg.is_moe_layer(i)) for i in range(cfg.n_layers)}
        )
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head: nn.Linear | None = Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head share the embedding's parameter (if tied and both are held).

        ``to_empty`` (materialising a ``meta`` model) separates them; ``init_weights``
        calls this again."""
        if self.config.tie_embeddings and self.embed is not None and self.head is not None:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [B,S] (or hidden [B,S,D] without ``embed``) -> logits [B,S,V] (or hidden).

        ``cache``: incremental decoding (``moe_model.kv_cache``): ``x`` continues the
        sequences the cache holds, which then holds ``x`` too.
        ``documents``: ``[B, S]`` non-decreasing document numbers (``documents_from_eos``);
        attention then stays inside each document (``moe_model.document_attention``).
        """
        if cache is not None and documents is not None:
            raise ValueError("forward takes a KV cache or document ids, not both")
        if self.embed is not None:
            if x.dim() != 2 or x.is_floating_point():
                raise ValueError(f"tokens must be an integer [B, S] tensor, got {x.dtype} {tuple(x.shape)}")
            if x.numel() == 0:
                raise ValueError(f"tokens: an empty batch {tuple(x.shape)}")
            if x.device.type == "cpu":  # (a CUDA check would wait for the device: it asserts there)
                bad = x[(x < 0) | (x >= self.config.vocab_size)]
                if bad.numel():
                    raise ValueError(f"token id {int(bad[0])} is outside [0, vocab_size={self.config.vocab_size})")
            h = self.embed(x)
        else:
            if x.dim() != 3 or not x.is_floating_point() or x.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"this stage holds no embedding: it takes hidden states [B, S, d_model="
                    f"{self.config.d_model}] (floating point), got {x.dtype} {tuple(x.shape)}")
            h = x
        mask = None if documents is None else DocumentMask(documents)
        start = 0 if cache is None else cache.length
        if cache is not None:
            cache.check_room(x.shape[1])
            if x.shape[0] != cache.batch:
                raise ValueError(f"the KV cache holds {cache.batch} sequences, got a batch of {x.shape[0]}")
        for name, block in self.blocks.items():
            layer_cache = None if cache is None else cache.layers[int(name)]
            h = block(h, mask, layer_cache, start)
        if cache is not None:
            cache.length = start + x.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h

    def moe_layers(self) -> Iterator[tuple[str, MoELayer]]:
        for name, module in self.named_modules():
            if isinstance(module, MoELayer):
                yield name, module
