"""The model's configuration: one validated dataclass.

Every field carries a one-line comment; `validate()` raises ``ValueError`` naming
the offending field, so a bad override fails before any tensor is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class MoEConfig:
    vocab_size: int = 256  # token ids are in [0, vocab_size)
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (GQA); divides n_heads
    head_dim: int = 32  # width of one attention head
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    expert_hidden: int = 256  # SwiGLU hidden width of one routed expert
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    qk_norm: bool = True  # RMSNorm over head_dim on queries and keys (Qwen3 style)
    lb_loss_coef: float = 0.01  # weight of the load-balancing loss
    init_std: float = 0.02  # std of the normal init; output projections are scaled by 1/sqrt(2*n_layers)
    grouped_mm_backend: str = "auto"  # expert GEMMs: auto | grouped_mm | loop

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"MoEConfig.{f.name} must be an int, got {value!r}")
        positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "n_experts", "top_k", "expert_hidden"]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"MoEConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"MoEConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"MoEConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.top_k > self.n_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} must not exceed n_experts={self.n_experts}"
            )
        if self.lb_loss_coef < 0:
            raise ValueError(f"MoEConfig.lb_loss_coef must be >= 0, got {self.lb_loss_coef}")
        if self.rope_theta <= 0:
            raise ValueError(f"MoEConfig.rope_theta must be positive, got {self.rope_theta}")
        if self.grouped_mm_backend not in ("auto", "grouped_mm", "loop"):
            raise ValueError(
                "MoEConfig.grouped_mm_backend must be one of auto, grouped_mm, loop; "
                f"got {self.grouped_mm_backend!r}"
            )
