"""The model's configuration: one validated dataclass.

Every field carries a one-line comment; `validate()` raises ``ValueError`` naming
the offending field, so a bad override fails before any tensor is allocated.
Fields that default to ``None`` resolve through the properties at the bottom
(``dense_hidden_width`` ...), so a saved config keeps the user's intent.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields
from typing import Literal


@dataclass
class MoEConfig:
    # --- shape
    vocab_size: int = 256  # token ids are in [0, vocab_size)
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (GQA); divides n_heads
    head_dim: int = 32  # width of one attention head
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # routed experts each token is sent to
    expert_hidden: int = 256  # SwiGLU hidden width of one routed expert
    n_shared_experts: int = 0  # always-active shared experts per MoE layer, added to the routed output
    shared_expert_hidden: int | None = None  # SwiGLU hidden width of one shared expert; None: expert_hidden
    n_dense_layers: int = 0  # the first k blocks use a dense SwiGLU MLP instead of an MoE layer
    dense_hidden: int | None = None  # dense blocks' SwiGLU width; None: the MoE layer's active width
    # --- routing and balancing
    router_score: Literal["softmax", "sigmoid"] = "softmax"  # softmax | sigmoid: per-expert score from the router logits
    norm_topk_weights: bool = False  # rescale the k selected scores to sum to 1 per token
    lb_loss_coef: float = 0.01  # weight of the load-balancing loss (0 disables it)
    lb_loss_granularity: Literal["microbatch", "global_batch"] = "microbatch"  # microbatch | global_batch: token set the expert load f_e is counted over
    z_loss_coef: float = 0.0  # weight of the router z-loss, logsumexp(logits)^2 per token (0 disables it)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: per-step change of the selection bias (0 disables it)
    capacity_factor: float | None = None  # None: dropless; else each expert takes <= ceil(cf * T * k / E) rows
    # --- attention and embeddings
    qk_norm: bool = True  # RMSNorm over head_dim on queries and keys (Qwen3 style)
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = False  # the LM head shares the input embedding's weight
    # --- execution
    recompute: Literal["none", "block", "selective"] = "none"  # none | block (whole blocks) | selective (keep GEMM/attention outputs only)
    grouped_mm_backend: Literal["auto", "grouped_mm", "triton", "loop"] = "auto"  # expert GEMMs: auto | grouped_mm | triton | loop
    attention_backend: Literal["auto", "cudnn", "flash"] = "auto"  # SDPA kernel on CUDA: auto (PyTorch's choice) | cudnn | flash (tried first)
    init_std: float = 0.02  # std of the normal init; output projections are scaled by 1/sqrt(2*n_layers)
    # a Hugging Face Qwen3MoeForCausalLM folder (config.json + safetensors) the weights start from;
    # its config.json gives the model's shape (moe_model.hf.Qwen3MoeFolder reads both); None: init_std
    init_from: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        self._check_types()
        positive = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                    "n_experts", "top_k", "expert_hidden", "rope_theta", "norm_eps", "init_std"]
        for name in positive:
            self._require(name, getattr(self, name) > 0, "must be positive")
        for name in ("n_shared_experts", "n_dense_layers", "lb_loss_coef", "z_loss_coef",
                     "bias_update_rate"):
            self._require(name, getattr(self, name) >= 0, "must be >= 0")
        for name in ("shared_expert_hidden", "dense_hidden", "capacity_factor"):
            value = getattr(self, name)
            self._require(name, value is None or value > 0, "must be positive or None")
        self._require("n_kv_heads", self.n_heads % self.n_kv_heads == 0,
                      f"must divide n_heads={self.n_heads}")
        self._require("head_dim", self.head_dim % 2 == 0, "must be even for RoPE")
        self._require("top_k", self.top_k <= self.n_experts,
                      f"must not exceed n_experts={self.n_experts}")
        self._require("n_dense_layers", self.n_dense_layers <= self.n_layers,
                      f"must not exceed n_layers={self.n_layers}")

    def _check_types(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value, tp = getattr(self, f.name), hints[f.name]
            if typing.get_origin(tp) is Literal:
                options = typing.get_args(tp)
                self._require(f.name, value in options, f"must be one of {', '.join(options)}")
                continue
            allowed = typing.get_args(tp) or (tp,)
            ok = any(
                (a is type(None) and value is None)
                or (a is float and isinstance(value, int | float) and not isinstance(value, bool))
                or (a is int and isinstance(value, int) and not isinstance(value, bool))
                or (a in (bool, str) and isinstance(value, a))
                for a in allowed
            )
            if not ok:
                raise ValueError(f"MoEConfig.{f.name} must be {tp}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"MoEConfig.{f.name} must be finite, got {value!r}")

    def _require(self, name: str, ok: bool, why: str) -> None:
        if not ok:
            raise ValueError(f"MoEConfig.{name} {why}, got {getattr(self, name)!r}")

    # ------------------------------------------------------------- resolved
    @property
    def shared_hidden_width(self) -> int:
        """Total hidden width of the shared experts (several ungated experts act as one)."""
        per_expert = self.shared_expert_hidden or self.expert_hidden
        return self.n_shared_experts * per_expert

    @property
    def dense_hidden_width(self) -> int:
        """Width of a dense block's MLP; by default the FLOPs of an MoE layer's active MLPs."""
        return self.dense_hidden or self.top_k * self.expert_hidden + self.shared_hidden_width

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers
