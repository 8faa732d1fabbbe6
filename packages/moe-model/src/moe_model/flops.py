"""FLOP accounting for MFU, in the convention peers report.

    flops_per_token = 6 * N_active + 6 * L * S * H * Dh

``N_active`` counts the parameters one token multiplies with, *excluding the
input embedding* (a lookup) but including the LM head: attention projections,
norms, the router, ``top_k`` routed experts and any shared/dense MLPs. The second
term is causal attention: QK^T and AV cost 2 * 2 * S * H * Dh per token forward,
halved for the causal mask, times 3 for forward + backward.
"""

from __future__ import annotations

from moe_model.config import MoEConfig


def active_params(cfg: MoEConfig) -> int:
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D + (2 * Dh if cfg.qk_norm else 0)
    moe = D * cfg.n_experts + cfg.top_k * 3 * D * cfg.expert_hidden
    per_layer = attn + moe + 2 * D
    return cfg.n_layers * per_layer + D + cfg.vocab_size * D


def total_params(cfg: MoEConfig) -> int:
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D + (2 * Dh if cfg.qk_norm else 0)
    moe = D * cfg.n_experts + cfg.n_experts * 3 * D * cfg.expert_hidden
    return cfg.n_layers * (attn + moe + 2 * D) + D + 2 * cfg.vocab_size * D


def flops_per_token(cfg: MoEConfig, seq_len: int) -> int:
    return 6 * active_params(cfg) + 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
