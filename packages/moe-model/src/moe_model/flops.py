"""Parameter counts and FLOP accounting for MFU, in the convention peers report.

    flops_per_token = 6 * N_active + 6 * L * S * H * Dh

``N_active`` counts the parameters one token multiplies with, *excluding the
input embedding* (a lookup) but including the LM head (counted even when tied:
its matmul is real work): per block the attention projections, QK-norm and
RMSNorm weights, and either the router + ``top_k`` routed experts + the shared
experts (MoE blocks) or the dense SwiGLU (the first ``n_dense_layers`` blocks);
then the final norm. 6 = 2 FLOPs per multiply-add x (forward + 2x backward).
The second term is causal attention: QK^T and AV cost 2 * 2 * S * H * Dh per
token forward, halved by the causal mask, times 3 for forward + backward. With a
document mask (``moe_model.document_attention``) it is scaled by the share of the
causal query-key pairs the mask keeps (``attention_fraction``): a window of many
short documents does far less attention work.
"""

from __future__ import annotations

from moe_model.config import MoEConfig


def _attention_params(cfg: MoEConfig) -> int:
    D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return D * H * Dh + 2 * D * K * Dh + H * Dh * D + (2 * Dh if cfg.qk_norm else 0)


def _mlp_params(cfg: MoEConfig, layer: int, n_routed: int) -> int:
    """Parameters of block ``layer``'s MLP, counting ``n_routed`` routed experts."""
    D = cfg.d_model
    if not cfg.is_moe_layer(layer):
        return 3 * D * cfg.dense_hidden_width
    return D * cfg.n_experts + n_routed * 3 * D * cfg.expert_hidden + 3 * D * cfg.shared_hidden_width


def _params(cfg: MoEConfig, n_routed: int) -> int:
    D = cfg.d_model
    blocks = sum(_attention_params(cfg) + 2 * D + _mlp_params(cfg, i, n_routed)
                 for i in range(cfg.n_layers))
    return blocks + D  # + final norm


def active_params(cfg: MoEConfig) -> int:
    """Parameters one token uses, excluding the input embedding, including the head."""
    return _params(cfg, cfg.top_k) + cfg.vocab_size * cfg.d_model


def total_params(cfg: MoEConfig) -> int:
    """Stored parameters (a tied head is counted once)."""
    embeddings = (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * cfg.d_model
    return _params(cfg, cfg.n_experts) + embeddings


def flops_per_token(cfg: MoEConfig, seq_len: int, attention_fraction: float = 1.0) -> float:
    """Training FLOPs per token: ``6 * active_params + 6 * L * S * H * Dh * attention_fraction``
    (see module doc; ``attention_fraction``: kept over causal query-key pairs, 1 without a
    document mask)."""
    attention = 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim
    return 6 * active_params(cfg) + attention * attention_fraction
