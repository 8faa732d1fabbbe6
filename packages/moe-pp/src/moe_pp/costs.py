"""Per-module costs for balancing a pipeline split: parameter count or FLOPs.

Both read only module structure and parameter shapes, so they work on a model
still on the meta device (the point of splitting before materialisation).

The FLOPs estimate is structural (forward FLOPs per token), not traced: a
traced count would need a forward on real or fake tensors, which routing (data
dependent expert segment sizes) and autocast on the meta device do not allow.
Rules, matching the MFU convention of the model package:

- ``nn.Linear``: ``2 * in * out`` (one multiply-add per weight).
- ``nn.Embedding``: 0 (a lookup).
- Any other parameter with two or more dimensions is a matmul weight:
  ``2 * numel``; a 3-D one under a module exposing integer ``top_k`` and
  ``n_experts`` (a routed MoE layer, experts stacked on dim 0) is active for
  ``top_k`` of ``n_experts`` experts per token: ``2 * numel * top_k / n_experts``.
- 1-D parameters (norm scales, biases) are elementwise: 0.
- A module exposing integer ``n_heads`` and ``head_dim`` is causal attention:
  ``2 * seq_len * n_heads * head_dim`` for ``QK^T`` and ``AV`` with the causal half.
"""

from __future__ import annotations

from torch import nn


def param_count(module: nn.Module | None) -> float:
    """Parameters held by ``module`` (each tensor once); 0 for ``None``."""
    if module is None:
        return 0.0
    return float(sum(p.numel() for p in module.parameters()))


def _int_attr(module: nn.Module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def forward_flops_per_token(module: nn.Module | None, seq_len: int) -> float:
    """Structural forward FLOPs per token of ``module`` (see the module docstring)."""
    if module is None:
        return 0.0
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive for a FLOPs estimate, got {seq_len}")
    flops = 0.0
    seen: set[int] = set()

    def visit(mod: nn.Module, expert_fraction: float) -> None:
        nonlocal flops
        top_k, n_experts = _int_attr(mod, "top_k"), _int_attr(mod, "n_experts")
        if top_k is not None and n_experts:
            expert_fraction = top_k / n_experts
        n_heads, head_dim = _int_attr(mod, "n_heads"), _int_attr(mod, "head_dim")
        if n_heads is not None and head_dim is not None:
            flops += 2.0 * seq_len * n_heads * head_dim
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(mod, nn.Embedding) or p.dim() < 2:
                continue
            if isinstance(mod, nn.Linear) and p is mod.weight:
                flops += 2.0 * mod.in_features * mod.out_features
            elif p.dim() == 3:
                flops += 2.0 * p.numel() * expert_fraction
            else:
                flops += 2.0 * p.numel()
        for child in mod.children():
            visit(child, expert_fraction)

    visit(module, 1.0)
    return flops
