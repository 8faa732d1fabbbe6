"""Top-k token router and its balancing terms, computed in FP32.

Shape legend: T tokens, D d_model, E experts (all, not local), k top_k.

- Scores: ``softmax`` over the router logits, or an independent ``sigmoid`` per
  expert (DeepSeek-V3 style). The balancing loss uses the scores normalised per
  token (identical to the softmax scores in the softmax case).
- Selection: top-k of ``score + expert_bias``. The bias (aux-loss-free balancing)
  only changes *which* experts are chosen, never the combine weights; it is a
  buffer moved by ``update_bias`` once per optimizer step, not by the optimizer.
- Loss terms are tensors in token-*sum* form (the caller divides by the global
  token count, like the LM loss), so their gradients do not depend on how the
  batch is split into microbatches or ranks.
- Counting uses ``scatter_add_`` rather than ``bincount`` (which synchronises with
  the host), so nothing here waits for the device.
- Everything after the logits (scores, top-k, weights, counts, z-loss) runs for CUDA
  logits as one Triton kernel forward and one backward (``_router_kernels``, three
  launches and one instead of ~20 and ~15); ``route_top_k_reference`` is the path elsewhere.
- Logits: FP32 ``x @ w^T``. With BF16 ``x`` and ``w`` on a GPU (``router_logits``) the
  products are exact in FP32 already, so a tensor-core GEMM with FP32 output gives the
  FP32 result without FP32 copies of ``x`` and ``w``; the backward splits the FP32 logit
  gradient into three BF16 parts (FP32's precision: BF16 has FP32's exponent range, FP16
  would underflow the small parts) for its tensor-core GEMMs.
  The FP32 (CUDA-core) GEMMs it replaces cost ~55 ms of a bench-1gpu step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_model._triton_support import Backend, fused_kernels_enabled, use_fused
from moe_model.backward_needs import grads_needed
from moe_model.config import MoEConfig


@dataclass
class RoutingResult:
    expert_ids: torch.Tensor  # [T, k] int64 global expert ids, best first
    weights: torch.Tensor  # [T, k] float32 combine weights (differentiable)
    tokens_per_expert: torch.Tensor  # [E] int64 routed (token, slot) pairs per expert
    probs: torch.Tensor  # [T, E] float32 per-token score distribution for the balancing loss
    z_loss: torch.Tensor  # scalar float32: sum over tokens of logsumexp(logits)^2


def count_per_expert(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Histogram of expert ids without a host synchronisation."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


class _BalanceLoss(torch.autograd.Function):
    """``E * sum_e f_e * sum_t p_te`` with the load ``f`` a constant.

    ``f`` is kept on ``ctx`` rather than saved for backward: under activation
    recompute the forward runs again (without re-counting over the data-parallel
    group), and the backward must still use the load of the original forward.
    """

    @staticmethod
    def forward(ctx: Any, probs_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        f_E = counts_E.float() / counts_E.sum().clamp_min(1).float()
        ctx.w_E = probs_TE.shape[1] * f_E
        ctx.n_tokens = probs_TE.shape[0]
        return (probs_TE.sum(0) * ctx.w_E).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad * ctx.w_E).expand(ctx.n_tokens, -1), None


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Switch-style balancing loss in token-sum form.

    ``E * sum_e f_e * sum_t p_te`` with ``f_e = counts_e / sum(counts)``, the share of
    routed slots expert ``e`` received over the token set ``counts`` were taken
    from (this microbatch, or more; see ``MoELayer``). Per token it is 1 when the
    load is uniform; gradients flow through ``probs`` only.
    """
    return _BalanceLoss.apply(probs_TE, counts_E)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss in token-sum form: ``sum_t logsumexp(logits_t)^2``."""
    return logits_TE.logsumexp(dim=-1).square().sum()


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of BF16 operands, accumulated and returned in FP32 (cuBLAS)."""
    return torch.mm(a, b, out_dtype=torch.float32)


_BF16_PARTS = 3  # BF16 parts of an FP32 value that carry all of its 24 significant bits


def _split_bf16(t_fp32: torch.Tensor) -> list[torch.Tensor]:
    """``t = p0 + p1 + p2`` in BF16 up to FP32's own precision (each part takes the next
    8 significant bits of the residual): operands whose products with BF16 values are
    exact in FP32."""
    parts, rest = [], t_fp32
    for _ in range(_BF16_PARTS):
        parts.append(rest.bfloat16())
        rest = rest - parts[-1].float()
    return parts


class _RouterLogits(torch.autograd.Function):
    """FP32 logits ``x @ w^T`` of BF16 ``x [T, D]`` and ``w [E, D]`` (see the module
    docstring). Gradients with the FP32 logit gradient ``g`` split in three BF16 parts
    (FP32's precision), ``G = [g0 | g1 | g2]``: ``dx = G @ [w; w; w]`` in BF16 (rounded
    once), ``dw = sum_i g_i^T @ x`` in FP32, returned in w's dtype.

    dW stays three GEMMs, not one ``G^T @ x`` over the ``[3E, T]`` operand: on H200
    (cuBLAS, torch 2.11) that one GEMM ran as a split-K kernel whose FP32 result was
    off by 9.9e-6 of the largest element against an FP64 reference, against 3.5e-6
    for the three (and 4.5e-7 for the CUDA-core FP32 GEMM); reading x three times
    costs ~20 us more per call."""

    @staticmethod
    def forward(ctx: Any, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return _mm_fp32(x_TD, w_ED.t())

    @staticmethod
    def backward(ctx: Any, g_TE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_TD, w_ED = ctx.saved_tensors
        need_dx, need_dw = grads_needed(ctx)  # one of them in a split (zero-bubble) backward
        n_parts, E = _BF16_PARTS, w_ED.shape[0]
        if fused_kernels_enabled(g_TE.device):
            from moe_model._router_kernels import split_bf16

            g_TP = split_bf16(g_TE, n_parts)  # P = 3 * E, in one kernel
        else:
            g_TP = torch.cat(_split_bf16(g_TE.float()), 1)
        dx = dw = None
        if need_dx:  # [T, 3E] @ [3E, D], rounded once
            dx = g_TP @ torch.cat([w_ED] * n_parts, 0)
        if need_dw:
            dw = _mm_fp32(g_TP[:, :E].t(), x_TD)
            for i in range(1, n_parts):
                dw += _mm_fp32(g_TP[:, i * E:(i + 1) * E].t(), x_TD)
            dw = dw.to(w_ED.dtype)
        return dx, dw


def router_logits_reference(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """FP32 ``x @ w^T`` through FP32 copies of ``x`` and ``w`` and an FP32 GEMM."""
    return x_TD.float() @ w_ED.float().t()


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """FP32 ``x @ w^T``; the fused path (BF16 ``x`` and ``w``) is ``_RouterLogits``, the
    tensor-core GEMM with FP32 output (see the module docstring)."""

    def unfit() -> str | None:
        if x_TD.dtype == w_ED.dtype == torch.bfloat16:
            return None
        return f"x ({x_TD.dtype}) and w ({w_ED.dtype}) must both be torch.bfloat16"

    if use_fused("router_logits", backend, x_TD.device, unfit):
        return _RouterLogits.apply(x_TD, w_ED)
    return router_logits_reference(x_TD, w_ED)


def route_top_k_reference(logits_TE: torch.Tensor, score: str, top_k: int, norm_topk: bool,
                          expert_bias: torch.Tensor | None) -> RoutingResult:
    """Scores, selection, weights, counts and z-loss of FP32 logits in eager PyTorch.

    ``score``: ``"softmax"`` or ``"sigmoid"``; ``norm_topk``: the chosen weights summed to
    one per token; ``expert_bias`` (``[E]`` or ``None``): added to the scores for the
    selection only."""
    if score == "softmax":
        scores_TE = probs_TE = logits_TE.softmax(dim=-1)
    else:
        scores_TE = logits_TE.sigmoid()
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    if expert_bias is None:
        weights_Tk, ids_Tk = scores_TE.topk(top_k, dim=-1)
    else:
        ids_Tk = (scores_TE.detach() + expert_bias).topk(top_k, dim=-1).indices
        weights_Tk = scores_TE.gather(1, ids_Tk)
    if norm_topk:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
    return RoutingResult(
        expert_ids=ids_Tk,
        weights=weights_Tk,
        tokens_per_expert=count_per_expert(ids_Tk, logits_TE.shape[1]),
        probs=probs_TE,
        z_loss=router_z_loss(logits_TE),
    )


def route_top_k(logits_TE: torch.Tensor, score: str, top_k: int, norm_topk: bool,
                expert_bias: torch.Tensor | None, backend: Backend = "auto") -> RoutingResult:
    """``route_top_k_reference``'s routing; the fused path is one Triton kernel forward and
    one backward (``_router_kernels``)."""
    if use_fused("route_top_k", backend, logits_TE.device):
        from moe_model._router_kernels import fused_routing

        ids_Tk, weights_Tk, counts_E, probs_TE, z_loss = fused_routing(
            logits_TE, expert_bias, top_k, score == "sigmoid", norm_topk)
        return RoutingResult(ids_Tk, weights_Tk, counts_E, probs_TE, z_loss)
    return route_top_k_reference(logits_TE, score, top_k, norm_topk, expert_bias)


class TopKRouter(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.score, self.norm_topk = cfg.router_score, cfg.norm_topk_weights
        self.bias_update_rate = cfg.bias_update_rate
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.expert_bias: torch.Tensor | None
        if cfg.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x_TD: torch.Tensor) -> RoutingResult:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = router_logits(x_TD, self.weight)
        return route_top_k(logits_TE, self.score, self.top_k, self.norm_topk, self.expert_bias)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """Aux-loss-free balancing step: raise under-loaded experts' bias, lower over-loaded.

        ``counts_E``: the optimizer step's routed slots per expert, accumulated over
        all microbatches and summed over the data-parallel group. Only the sign of
        each expert's deviation from the mean is used, so the step is independent of
        the microbatch count, DP size and PP stage count. A no-op when disabled.
        """
        if self.expert_bias is None:
            return
        load_E = counts_E.to(self.expert_bias.device, torch.float32)
        self.expert_bias += self.bias_update_rate * torch.sign(load_E.mean() - load_E)
