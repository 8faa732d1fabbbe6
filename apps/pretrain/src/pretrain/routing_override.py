"""Forced routing for benchmarks and tests: balanced or Zipf-skewed expert choices.

Benchmarks that only force balanced routing overstate throughput; reporting the
model's own routing next to a forced balanced and a forced skewed one shows what
routing costs. ``force_routing`` installs a forward hook on every router that
keeps the router's computation (its cost, its scores, its gradients) and replaces
only *which* experts each token goes to:

- ``balanced``: token ``t``'s ``j``-th slot goes to expert ``(t + j * (E // k)) mod E``,
  so every expert gets the same number of rows (when ``E`` divides ``T``), and a
  token's experts are spread over the expert range as uniformly random choices would
  be: under expert parallelism a token reaches ``min(k, ep)`` ranks (consecutive
  experts would keep all of a token's rows on one rank and halve EP's traffic);
- ``zipf``: ``k`` distinct experts per token drawn without replacement with
  probabilities ``~ 1/rank^s`` (Gumbel top-k), expert ``0`` the most popular.

The forced choices are a fixed function of (mode, seed, layer, token position),
drawn once per layer and token count and reused: every microbatch sees the same
pattern, nothing is drawn in the steady state, and an activation-recompute
forward routes exactly as the original one did.

Combine weights are the router's per-token probabilities (its scores
normalised per token) at the forced experts, so the router still learns. A hook, not a wrapper module: parameter names stay the model's.
Not a config key on purpose: this changes what the model computes and exists
only to measure it.

Shape legend: T tokens, E experts, k top-k.
"""

from __future__ import annotations

import zlib
from typing import Literal

import torch
from moe_model import RoutingResult
from torch import nn
from torch.utils.hooks import RemovableHandle

RoutingMode = Literal["model", "balanced", "zipf"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("model", "balanced", "zipf")
ZIPF_EXPONENT = 1.2


def forced_ids(mode: RoutingMode, n_tokens: int, n_experts: int, top_k: int,
               seed: int) -> torch.Tensor:
    """``[T, k]`` int64 expert ids (on the CPU) of forced routing ``mode``."""
    if mode == "balanced":
        stride = n_experts // top_k
        return (torch.arange(n_tokens)[:, None] + stride * torch.arange(top_k)) % n_experts
    g = torch.Generator().manual_seed(seed)
    log_p_E = -ZIPF_EXPONENT * torch.arange(1, n_experts + 1, dtype=torch.float64).log()
    u_TE = torch.rand((n_tokens, n_experts), generator=g, dtype=torch.float64).clamp_(min=1e-300)
    return (log_p_E - (-u_TE.log()).log()).topk(top_k, dim=-1).indices


def _forced(result: RoutingResult, ids_Tk: torch.Tensor, n_experts: int) -> RoutingResult:
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=ids_Tk.device)
    counts_E.scatter_add_(0, ids_Tk.reshape(-1), torch.ones_like(ids_Tk.reshape(-1)))
    return RoutingResult(expert_ids=ids_Tk, weights=result.probs.gather(1, ids_Tk),
                         tokens_per_expert=counts_E, probs=result.probs, z_loss=result.z_loss)


def force_routing(model: nn.Module, mode: RoutingMode, seed: int = 0) -> list[RemovableHandle]:
    """Hook every MoE router of ``model`` to route per ``mode``; returns the hook handles."""
    if mode not in ROUTING_MODES:
        raise ValueError(f"unknown routing mode {mode!r}; expected one of {ROUTING_MODES}")
    if mode == "model":
        return []
    handles = []
    for name, layer in model.moe_layers():
        router = layer.router
        layer_seed = zlib.crc32(f"{seed}:{name}".encode())
        cache: dict[int, torch.Tensor] = {}

        def hook(module: nn.Module, inputs: tuple[torch.Tensor], result: RoutingResult,
                 seed: int = layer_seed, cache: dict[int, torch.Tensor] = cache) -> RoutingResult:
            T = inputs[0].shape[0]
            if T not in cache:
                ids = forced_ids(mode, T, module.n_experts, module.top_k, seed)
                cache[T] = ids.to(result.probs.device)
            return _forced(result, cache[T], module.n_experts)

        handles.append(router.register_forward_hook(hook))
    return handles
