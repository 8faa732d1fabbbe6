"""The fused cross-entropy: Triton kernels, their launchers and the autograd Function
(imported lazily by ``moe_model.loss``, whose docstring describes the design).
Importing this module requires Triton.

Both kernels run one program per row and stream the row in ``BLOCK_V`` chunks, so
registers hold one chunk whatever the vocabulary size; all arithmetic is FP32.
Row offsets are formed in int64 (``N * V`` passes 2**31 at 21k tokens of a 100k
vocabulary).

With a ``RowEncoder`` (``moe_model.loss``) the backward also writes the gradient's
per-row codes in the same pass: the row's largest gradient magnitude is known before the
row is read, from the forward's statistics. For ``j != t``, ``|d_j| = p_j * |g|`` grows
with the logit ``x_j`` (every step of ``p_j``'s computation is monotone, the rounding to
the gradient's dtype too), so the largest is that of the largest logit other than the
target's, which the forward records beside ``m``; the target's own is
``|p_t - 1| * |g|``. Both are computed by the same operations as in the row loop, so the
row maximum equals the maximum of the stored gradient (monotone ``exp`` assumed, as the
GPU's ``ex2.approx`` and numpy's are), and the encoder's scale is that of the stored row.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moe_model.loss import IGNORE_INDEX
from moe_model.row_encoding import RowEncoder

# Start of the running maximum: the most negative finite FP32, not -inf, so the
# rescale factor exp(m_old - m_new) is never exp(-inf - -inf) = NaN when a chunk is
# all -inf (masked tail or logits masked to -inf). m_new >= every x seen, so no
# exponent is ever positive.
_FP32_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def forward_kernel(
    logits_ptr, targets_ptr, loss_ptr, max_ptr, logsum_ptr, other_max_ptr,
    V, stride_row, ignore_index,
    BLOCK_V: tl.constexpr, OTHER_MAX: tl.constexpr,
):
    """Per row: ``loss = (m - x[t]) + log(sum(exp(x - m)))`` with ``m`` the row max,
    and the two terms ``m`` and ``log-sum`` saved for the backward.

    The maximum and the sum are carried online (one pass, one exp per element: on
    H200 the SFU's exp rate is about the HBM rate in BF16 elements, so a second exp
    per element, as an element-wise online softmax needs, would make it compute
    bound). Keeping ``m`` and ``log-sum`` apart, rather than ``lse = m + log-sum``,
    follows PyTorch's log-softmax: ``(x - m) - log-sum`` stays exact to FP32
    rounding of the small terms even when the logits are ~1e4, where ``lse`` alone
    would carry an absolute error of ~1e-3.

    ``OTHER_MAX``: also store the row's largest logit other than the target's (``-inf``
    where there is none), which the encoding backward needs (module notes).

    Ignored rows read nothing and store zeros. A target outside ``[0, V)`` (other
    than ``ignore_index``) gives a NaN loss instead of reading out of bounds.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    if tgt == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(max_ptr + row, 0.0)
        tl.store(logsum_ptr + row, 0.0)
        if OTHER_MAX:
            tl.store(other_max_ptr + row, 0.0)
    else:
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), _FP32_LOWEST, tl.float32)
        m_other = tl.full((), float("-inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            chunk_max = tl.max(x, axis=0)
            m_new = tl.maximum(m, chunk_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            if OTHER_MAX:  # only the target's chunk masks (a select per element is not free)
                if (tgt >= start) & (tgt < start + BLOCK_V):
                    chunk_max = tl.max(tl.where(idx == tgt, float("-inf"), x), axis=0)
                m_other = tl.maximum(m_other, chunk_max)
        logsum = tl.log(s)
        in_range = (tgt >= 0) & (tgt < V)
        x_t = tl.load(row_ptr + tgt, mask=in_range, other=float("nan")).to(tl.float32)
        tl.store(loss_ptr + row, (m - x_t) + logsum)
        tl.store(max_ptr + row, m)
        tl.store(logsum_ptr + row, logsum)
        if OTHER_MAX:
            tl.store(other_max_ptr + row, m_other)


@triton.jit
def backward_kernel(
    logits_ptr, targets_ptr, max_ptr, logsum_ptr, other_max_ptr, grad_out_ptr, grad_ptr,
    codes_ptr, scales_ptr,
    V, stride_row, stride_grad_row, stride_codes_row, ignore_index,
    BLOCK_V: tl.constexpr, ENCODE: tl.constexpr, ROW_SCALE: tl.constexpr,
    ROW_ENCODE: tl.constexpr,
):
    """Per row: ``grad = (exp((x - m) - log-sum) - onehot(t)) * grad_out`` in the
    gradient's dtype; ignored rows store zeros without reading the logits.

    ``ENCODE``: also store ``ROW_ENCODE(grad, scale)`` (uint8 codes) and
    ``scale = ROW_SCALE(amax)`` per row, ``amax`` the row's largest stored magnitude
    found from the statistics (module notes); ignored rows get zero codes and the scale
    of a zero ``amax``.

    ``grad_out`` is read from device memory (no host sync). A target outside
    ``[0, V)`` makes its whole row NaN, so the step's gradient norm is non-finite
    and the trainer skips it instead of applying a silently wrong update.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * stride_grad_row
    codes_row_ptr = codes_ptr + row * stride_codes_row
    out_ty = grad_ptr.dtype.element_ty
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    if tgt == ignore_index:
        zeros = tl.zeros((BLOCK_V,), dtype=out_ty)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            tl.store(grad_row_ptr + idx, zeros, mask=idx < V)
            if ENCODE:
                tl.store(codes_row_ptr + idx, tl.zeros((BLOCK_V,), dtype=tl.uint8), mask=idx < V)
        if ENCODE:
            tl.store(scales_ptr + row, ROW_SCALE(tl.full((), 0.0, tl.float32)))
    else:
        m = tl.load(max_ptr + row)
        logsum = tl.load(logsum_ptr + row)
        g = tl.load(grad_out_ptr).to(tl.float32)
        in_range = (tgt >= 0) & (tgt < V)
        g = tl.where(in_range, g, float("nan"))
        if ENCODE:  # the row's largest magnitude, by the loop's own operations
            x_t = tl.load(row_ptr + tgt, mask=in_range, other=0.0).to(tl.float32)
            d_t = ((tl.exp((x_t - m) - logsum) - 1.0) * g).to(out_ty).to(tl.float32)
            x_o = tl.load(other_max_ptr + row)
            d_o = (tl.exp((x_o - m) - logsum) * g).to(out_ty).to(tl.float32)
            amax = tl.maximum(tl.abs(d_t), tl.abs(d_o))
            scale = ROW_SCALE(tl.where((d_t != d_t) | (d_o != d_o), float("nan"), amax))
            tl.store(scales_ptr + row, scale)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - m) - logsum)
            d = (tl.where(idx == tgt, p - 1.0, p) * g).to(out_ty)
            tl.store(grad_row_ptr + idx, d, mask=mask)
            if ENCODE:
                tl.store(codes_row_ptr + idx, ROW_ENCODE(d.to(tl.float32), scale), mask=mask)


# --- launchers and the autograd Function -----------------------------------------


@dataclass(frozen=True)
class CrossEntropyConfig:
    block_v: int  # vocabulary chunk one program holds in registers (a power of two)
    num_warps: int


# GPU: one row per program, so 8k rows fill an H200's 132 SMs several times over, and
# the resident programs per SM hide the load latency (Triton does not software-pipeline
# loads that feed no dot, so num_stages has no effect here). Chosen by
# `tools/from_source.sh python3 tools/sweep_cross_entropy.py` at the LM head's shape
# ([8192, 100352] BF16; one H100, commit 19adba6, `sweep_cross_entropy_h100.json`):
# the forward and the plain backward run at 92-101% of the device copy over most
# shapes, so they keep 8192-wide chunks on 8 warps (32 elements, four 16-byte loads, per
# thread; within 1.6% of their best shape, 3.3% for the forward that also records the
# largest other logit). The backward that also writes an encoder's
# codes holds more per element (the row scale, the bit-level E4M3 encoding): 2048-wide
# chunks on 8 warps ran at 1.46 ms (93% of copy) against 1.71 for 8192 on 8 (79%) and
# 1.50 for 2048 on 4. CPU runs are
# the Triton interpreter (tests), where small chunks keep the multi-chunk paths exercised.
_GPU = {
    "forward": CrossEntropyConfig(block_v=8192, num_warps=8),
    "backward": CrossEntropyConfig(block_v=8192, num_warps=8),
    "backward_codes": CrossEntropyConfig(block_v=2048, num_warps=8),
}
_CPU = CrossEntropyConfig(block_v=32, num_warps=1)


def default_cross_entropy_config(kind: str, device: torch.device) -> CrossEntropyConfig:
    """Configuration of kernel ``kind`` (``forward``, ``backward``, or ``backward_codes``,
    the backward that also writes an encoder's codes) on ``device``."""
    if kind not in _GPU:
        raise ValueError(f"cross-entropy kernel kind must be one of {sorted(_GPU)}, got {kind!r}")
    return _GPU[kind] if device.type == "cuda" else _CPU


def cross_entropy_forward(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None, other_max: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Per-row FP32 ``(loss, max, log-sum)``: ``loss = (max - x[t]) + log-sum``, zero
    (and zero statistics) for ``ignore_index`` rows; ``other_max``: and a fourth, the
    row's largest logit other than the target's (what ``cross_entropy_backward`` needs
    to encode). ``logits_NV`` must have unit stride along V."""
    N, V = logits_NV.shape
    stats = torch.empty(3 + other_max, N, dtype=torch.float32, device=logits_NV.device)
    rows = stats.unbind(0)
    if N == 0:
        return rows
    cfg = config or default_cross_entropy_config("forward", logits_NV.device)
    forward_kernel[(N,)](
        logits_NV, targets_N, *rows[:3], rows[3] if other_max else rows[0],
        V, logits_NV.stride(0), ignore_index,
        BLOCK_V=cfg.block_v, OTHER_MAX=other_max, num_warps=cfg.num_warps,
    )
    return rows


def cross_entropy_backward(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, max_N: torch.Tensor,
    logsum_N: torch.Tensor, grad_out: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None,
    encoding: tuple[RowEncoder, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(softmax(x) - onehot(t)) * grad_out`` per row as a new tensor of the logits'
    dtype; zero rows for ``ignore_index``. ``grad_out`` is a 0-d device tensor (read by
    the kernel, never by the host).

    ``encoding``: ``(encoder, other_max_N)``, the forward's fourth statistic: then also
    the encoder's codes ``[N, V]`` (uint8) and scales ``[N, 1]`` (FP32) of that gradient,
    written in the same pass (module notes); else ``None`` for both."""
    N, V = logits_NV.shape
    grad_NV = torch.empty((N, V), dtype=logits_NV.dtype, device=logits_NV.device)
    codes_NV = scales_N1 = None
    if encoding is not None:
        codes_NV = torch.empty((N, V), dtype=torch.uint8, device=logits_NV.device)
        scales_N1 = torch.empty((N, 1), dtype=torch.float32, device=logits_NV.device)
    if N == 0:
        return grad_NV, codes_NV, scales_N1
    cfg = config or default_cross_entropy_config("backward" if encoding is None else "backward_codes",
                                                 logits_NV.device)
    encoder, other_max_N = encoding if encoding is not None else (None, max_N)
    backward_kernel[(N,)](
        logits_NV, targets_N, max_N, logsum_N, other_max_N, grad_out.reshape(()).float(), grad_NV,
        grad_NV if codes_NV is None else codes_NV, max_N if scales_N1 is None else scales_N1,
        V, logits_NV.stride(0), grad_NV.stride(0), V, ignore_index,
        BLOCK_V=cfg.block_v, ENCODE=encoder is not None,
        ROW_SCALE=None if encoder is None else encoder.row_scale,
        ROW_ENCODE=None if encoder is None else encoder.row_encode,
        # an encoder's rounding steps are exact only without FMA contraction (the
        # gradient's own arithmetic has no multiply-add to contract either way)
        num_warps=cfg.num_warps, enable_fp_fusion=encoder is None,
    )
    return grad_NV, codes_NV, scales_N1


class _FusedCrossEntropySum(torch.autograd.Function):
    """Sum of row cross-entropies; saves the logits (alive anyway until the head's
    backward) and 8 bytes per row (12 with an encoder), where ``F.cross_entropy`` on FP32
    logits keeps FP32 log-probs."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, ignore_index, config, encoder):  # noqa: ANN001, ANN205
        stats = cross_entropy_forward(logits_NV, targets_N, ignore_index, config,
                                      other_max=encoder is not None)
        ctx.save_for_backward(logits_NV, targets_N, *stats[1:])
        ctx.ignore_index, ctx.config, ctx.encoder = ignore_index, config, encoder
        return stats[0].sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        logits_NV, targets_N, max_N, logsum_N, *other_max = ctx.saved_tensors
        encoder = ctx.encoder
        grad_NV, codes_NV, scales_N1 = cross_entropy_backward(
            logits_NV, targets_N, max_N, logsum_N, grad_out, ctx.ignore_index, ctx.config,
            None if encoder is None else (encoder, other_max[0]))
        if encoder is not None:
            encoder.receive(grad_NV, codes_NV, scales_N1)
        return grad_NV, None, None, None, None


def fused_cross_entropy_sum(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None, encoder: RowEncoder | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(logits_NV.float(), targets_N, ignore_index=..., reduction="sum")``
    with the Triton kernels (differentiable in ``logits_NV``); ``config`` overrides both
    kernels' configuration (tests); ``encoder`` receives the gradient's per-row codes
    from the backward (``moe_model.row_encoding.RowEncoder``). Ids outside ``[0, V)``
    give NaN, not an error."""
    if logits_NV.dim() != 2 or targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"fused cross-entropy: logits {tuple(logits_NV.shape)} must be [N, V] and "
            f"targets {tuple(targets_N.shape)} [N]"
        )
    if logits_NV.stride(1) != 1:
        logits_NV = logits_NV.contiguous()
    return _FusedCrossEntropySum.apply(logits_NV, targets_N.contiguous(), ignore_index, config,
                                       encoder)
