"""The router's work after the logits (scores, top-k, weight normalisation, per-expert
counts, z-loss) in one Triton kernel forward and one backward, for CUDA tensors.

The eager form (``moe_model.router.route_top_k_reference``) is a chain of small kernels on a
[tokens, experts] tile: softmax or sigmoid, top-k, the normalisation, the count
(zeros, ones, ``scatter_add_``), ``logsumexp`` (nine kernels), square and sum; its
backward about fifteen more. At 256 router calls per training step that was a large
share of the step's ~49k launches, each ~2 us of gap for microseconds of work. Here the
forward launches three kernels (the counts' zero fill, the fused kernel, the sum of
the per-program z-loss partials) and the backward one.

Both kernels hold ``BLOCK_T`` whole rows of the logits in registers (the experts padded
to a power of two) and compute in FP32. Top-k is k rounds of a row maximum with ties
to the lower expert index (on distinct scores, ``torch.topk``'s ids). The counts are
integer atomics and the z-loss is summed per program and then by torch: deterministic
run to run. The backward keeps only the logits and the ids and recomputes the scores
(it reads one [T, E] tensor either way, and nothing else [T, E] stays alive); it
takes the upstream gradients with any strides (the balancing loss hands the
probabilities a stride-0 broadcast of one [E] vector). Importing this module
requires Triton (``moe_model.router`` imports it only for CUDA logits).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _load_rows(logits_ptr, T, E, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's rows of the logits (padding columns -inf, rows past ``T`` zero, so
    every row's softmax is finite), with the row and column indices and the tile mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok, col_ok = rows < T, cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0)
    return tl.where(col_ok[None, :], x, float("-inf")), rows, cols, row_ok, mask


@triton.jit
def _scores(x, col_ok, SIGMOID: tl.constexpr):
    """Per row: the scores, the probabilities for the balancing loss, the scores' sum
    (the sigmoid's normaliser), logsumexp and the softmax (zero in padding columns)."""
    m = tl.max(x, axis=1)
    e = tl.exp(x - m[:, None])
    total = tl.sum(e, axis=1)
    lse = m + tl.log(total)
    soft = e / total[:, None]
    if SIGMOID:
        s = tl.where(col_ok[None, :], tl.sigmoid(x), 0.0)
        s_sum = tl.sum(s, axis=1)
        p = s / s_sum[:, None]
    else:
        s, s_sum, p = soft, total, soft
    return s, p, s_sum, lse, soft


@triton.jit
def router_forward_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, probs_ptr, counts_ptr, z_part_ptr,
    T, E, K,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_TOPK: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    x, rows, cols, row_ok, mask = _load_rows(logits_ptr, T, E, BLOCK_T, BLOCK_E)
    col_ok = cols < E
    s, p, _, lse, _ = _scores(x, col_ok, SIGMOID)
    tl.store(probs_ptr + rows[:, None] * E + cols[None, :], p, mask=mask)
    tl.store(z_part_ptr + tl.program_id(0), tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0))

    key = s
    if HAS_BIAS:
        key = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    key = tl.where(col_ok[None, :], key, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for j in range(K):
        best = tl.max(key, axis=1)
        # lowest column holding the maximum; a NaN row picks column 0 (a valid id)
        hit = (key == best[:, None]) | (best != best)[:, None]
        pick = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)
        chosen = cols[None, :] == pick[:, None]
        in_slot = slots[None, :] == j
        ids = tl.where(in_slot, pick[:, None], ids)
        w = tl.where(in_slot, tl.sum(tl.where(chosen, s, 0.0), axis=1)[:, None], w)
        counts += tl.sum((chosen & row_ok[:, None]).to(tl.int32), axis=0)
        key = tl.where(chosen, float("-inf"), key)
    if NORM_TOPK:
        w = w / tl.sum(w, axis=1)[:, None]
    out = rows[:, None] * K + slots[None, :]
    out_mask = row_ok[:, None] & (slots[None, :] < K)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)
    tl.store(weights_ptr + out, w, mask=out_mask)
    tl.atomic_add(counts_ptr + cols, counts.to(tl.int64), mask=col_ok & (counts > 0), sem="relaxed")


@triton.jit
def router_backward_kernel(
    logits_ptr, ids_ptr, dw_ptr, dp_ptr, dz_ptr, dx_ptr,
    T, E, K, dw_stride_t, dw_stride_k, dp_stride_t, dp_stride_e,
    SIGMOID: tl.constexpr, NORM_TOPK: tl.constexpr,
    HAS_DW: tl.constexpr, HAS_DP: tl.constexpr, HAS_DZ: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """d logits by the chain rule of the eager graph: the weights' gradient scattered to
    the chosen experts (through the normalisation), plus the probabilities' (through
    the sigmoid's normalisation), through the softmax or sigmoid; plus the z-loss's
    ``2 * lse * softmax`` per unit of its gradient."""
    x, rows, cols, row_ok, mask = _load_rows(logits_ptr, T, E, BLOCK_T, BLOCK_E)
    s, p, s_sum, lse, soft = _scores(x, cols < E, SIGMOID)
    ds = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    if HAS_DW:
        chosen = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1)
        for j in range(K):
            id_j = tl.load(ids_ptr + rows * K + j, mask=row_ok, other=0)
            dw_j = tl.load(dw_ptr + rows * dw_stride_t + j * dw_stride_k, mask=row_ok, other=0.0)
            at = cols[None, :] == id_j[:, None]
            ds = tl.where(at, dw_j[:, None], ds)
            chosen = chosen | at
        if NORM_TOPK:  # w = w_raw / sum(w_raw): dw_raw = (dw - sum(dw * w)) / sum(w_raw)
            w_raw = tl.where(chosen, s, 0.0)
            w_total = tl.sum(w_raw, axis=1)
            dot = tl.sum(ds * w_raw, axis=1) / w_total
            ds = tl.where(chosen, (ds - dot[:, None]) / w_total[:, None], 0.0)
    if HAS_DP:
        dp = tl.load(dp_ptr + rows[:, None] * dp_stride_t + cols[None, :] * dp_stride_e, mask=mask, other=0.0)
        if SIGMOID:  # p = s / sum(s)
            ds += (dp - tl.sum(dp * p, axis=1)[:, None]) / s_sum[:, None]
        else:
            ds += dp
    if SIGMOID:
        dx = ds * (1.0 - s) * s
    else:
        dx = s * (ds - tl.sum(ds * s, axis=1)[:, None])
    if HAS_DZ:
        dx += (2.0 * tl.load(dz_ptr) * lse)[:, None] * soft
    tl.store(dx_ptr + rows[:, None] * E + cols[None, :], dx, mask=mask)


def _launch_shape(n_tokens: int, n_experts: int, device: torch.device) -> tuple[tuple[int], int, int]:
    """(grid, rows per program, padded experts). On a GPU ~1024 logits per program (8
    per thread of 4 warps; 16 rows at E=64, 512 programs at 8192 tokens: several per
    SM to hide the k dependent reductions' latency), not tuned on a GPU yet. CPU runs
    are the Triton interpreter (tests), where 8 rows make the smallest test shapes span
    several programs and a partial last one."""
    block_e = triton.next_power_of_2(n_experts)
    block_t = max(1, min(64, 1024 // block_e)) if device.type == "cuda" else 8
    return (triton.cdiv(n_tokens, block_t),), block_t, block_e


class FusedRouting(torch.autograd.Function):
    """Routing of FP32 logits ``[T, E]``: ``(ids [T, k] int64, weights [T, k], counts [E]
    int64, probs [T, E], z_loss)``, as ``moe_model.router.route_top_k_reference``. Gradients flow
    to the logits from the weights, the probabilities and the z-loss (any may be unused);
    ``bias`` (``[E]`` FP32 or ``None``) only moves the selection."""

    @staticmethod
    def forward(ctx: Any, logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, sigmoid: bool,
                norm_topk: bool) -> tuple[torch.Tensor, ...]:
        logits_TE = logits_TE.contiguous()
        T, E = logits_TE.shape
        grid, block_t, block_e = _launch_shape(T, E, logits_TE.device)
        ids = torch.empty(T, top_k, dtype=torch.int64, device=logits_TE.device)
        weights = torch.empty(T, top_k, dtype=torch.float32, device=logits_TE.device)
        probs = torch.empty_like(logits_TE)
        counts = torch.zeros(E, dtype=torch.int64, device=logits_TE.device)
        z_part = torch.empty(grid[0], dtype=torch.float32, device=logits_TE.device)
        if T:
            router_forward_kernel[grid](
                logits_TE, logits_TE if bias_E is None else bias_E.contiguous(), ids, weights, probs, counts,
                z_part, T, E, top_k, SIGMOID=sigmoid, HAS_BIAS=bias_E is not None, NORM_TOPK=norm_topk,
                BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4)
        ctx.save_for_backward(logits_TE, ids)
        ctx.sigmoid, ctx.norm_topk = sigmoid, norm_topk
        ctx.mark_non_differentiable(ids, counts)
        ctx.set_materialize_grads(False)
        return ids, weights, counts, probs, z_part.sum()

    @staticmethod
    def backward(ctx: Any, _d_ids: None, d_weights: torch.Tensor | None, _d_counts: None,
                 d_probs: torch.Tensor | None, d_z: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits_TE, ids = ctx.saved_tensors
        T, E = logits_TE.shape
        d_logits = torch.empty_like(logits_TE)
        grid, block_t, block_e = _launch_shape(T, E, logits_TE.device)
        if T:
            router_backward_kernel[grid](
                logits_TE, ids, logits_TE if d_weights is None else d_weights,
                logits_TE if d_probs is None else d_probs, logits_TE if d_z is None else d_z, d_logits,
                T, E, ids.shape[1], *(d_weights.stride() if d_weights is not None else (0, 0)),
                *(d_probs.stride() if d_probs is not None else (0, 0)),
                SIGMOID=ctx.sigmoid, NORM_TOPK=ctx.norm_topk, HAS_DW=d_weights is not None,
                HAS_DP=d_probs is not None, HAS_DZ=d_z is not None, BLOCK_T=block_t, BLOCK_E=block_e,
                num_warps=4)
        return d_logits, None, None, None, None


def fused_routing(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, top_k: int, sigmoid: bool,
                  norm_topk: bool) -> tuple[torch.Tensor, ...]:
    """``FusedRouting`` applied: ``(ids, weights, counts, probs, z_loss)``."""
    return FusedRouting.apply(logits_TE, bias_E, top_k, sigmoid, norm_topk)


@triton.jit
def split_bf16_kernel(g_ptr, out_ptr, n, E, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """``out[t, i*E + e]`` = the ``i``-th BF16 part of ``g[t, e]``: each part the residual
    of the ones before, rounded to BF16 (``moe_model.router._split_bf16``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    rest = tl.load(g_ptr + offs, mask=live, other=0.0)
    dst = out_ptr + (offs // E) * (PARTS * E) + offs % E
    for i in tl.static_range(PARTS):
        part = rest.to(tl.bfloat16)
        tl.store(dst + i * E, part, mask=live)
        rest = rest - part.to(tl.float32)


def split_bf16(g_TE: torch.Tensor, parts: int) -> torch.Tensor:
    """``[T, parts * E]`` BF16: ``[g0 | g1 | ...]``, ``g``'s FP32 values split in BF16 parts
    (``g = g0 + g1 + ...`` up to FP32's precision with three), in one kernel instead of a
    cast, a subtraction and a cast back per part and a concatenation."""
    g_TE = g_TE.float().contiguous()
    T, E = g_TE.shape
    out = torch.empty(T, parts * E, dtype=torch.bfloat16, device=g_TE.device)
    block = 1024
    if g_TE.numel():
        split_bf16_kernel[(triton.cdiv(g_TE.numel(), block),)](g_TE, out, g_TE.numel(), E,
                                                             PARTS=parts, BLOCK=block)
    return out
