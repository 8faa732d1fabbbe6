"""The MoE transformer.

Structure (names are stable whatever parallelism is applied later):
``embed`` -> ``blocks["0".."L-1"]`` (attention + MoE) -> ``norm`` -> ``head``.
A pipeline stage is this same module with some blocks removed and ``embed`` or
``norm``/``head`` set to ``None``: ``forward`` then takes or returns hidden states
instead of tokens or logits. The model itself holds no parallelism.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.layers import Attention, RMSNorm
from moe_model.moe import MoELayer


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens [B,S] (or hidden [B,S,D] without ``embed``) -> logits [B,S,V] (or hidden)."""
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.head is not None:
            h = self.head(h)
        return h

    def moe_layers(self) -> Iterator[tuple[str, MoELayer]]:
        for name, module in self.named_modules():
            if isinstance(module, MoELayer):
                yield name, module


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Weight of the auxiliary losses' gradient: the trainer's token-loss divisor inverse."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.aux_loss_scale = scale
