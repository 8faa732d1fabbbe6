"""The fused cross-entropy: Triton kernels, their launchers and the autograd Function
(imported lazily by ``moe_model.loss``, whose docstring describes the design).
Importing this module requires Triton.

Both kernels run one program per row and stream the row in ``BLOCK_V`` chunks, so
registers hold one chunk whatever the vocabulary size; all arithmetic is FP32.
Row offsets are formed in int64 (``N * V`` passes 2**31 at 21k tokens of a 100k
vocabulary).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from moe_model.loss import IGNORE_INDEX

# Start of the running maximum: the most negative finite FP32, not -inf, so the
# rescale factor exp(m_old - m_new) is never exp(-inf - -inf) = NaN when a chunk is
# all -inf (masked tail or logits masked to -inf). m_new >= every x seen, so no
# exponent is ever positive.
_FP32_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def forward_kernel(
    logits_ptr, targets_ptr, loss_ptr, max_ptr, logsum_ptr,
    V, stride_row, ignore_index,
    BLOCK_V: tl.constexpr,
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
    else:
        cols = tl.arange(0, BLOCK_V)
        m = tl.full((), _FP32_LOWEST, tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            x = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        logsum = tl.log(s)
        in_range = (tgt >= 0) & (tgt < V)
        x_t = tl.load(row_ptr + tgt, mask=in_range, other=float("nan")).to(tl.float32)
        tl.store(loss_ptr + row, (m - x_t) + logsum)
        tl.store(max_ptr + row, m)
        tl.store(logsum_ptr + row, logsum)


@triton.jit
def backward_kernel(
    logits_ptr, targets_ptr, max_ptr, logsum_ptr, grad_out_ptr, grad_ptr,
    V, stride_row, stride_grad_row, ignore_index,
    BLOCK_V: tl.constexpr,
):
    """Per row: ``grad = (exp((x - m) - log-sum) - onehot(t)) * grad_out`` in the
    gradient's dtype; ignored rows store zeros without reading the logits.

    ``grad_out`` is read from device memory (no host sync). A target outside
    ``[0, V)`` makes its whole row NaN, so the step's gradient norm is non-finite
    and the trainer skips it instead of applying a silently wrong update.
    """
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_ptr + row * stride_grad_row
    tgt = tl.load(targets_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    if tgt == ignore_index:
        zeros = tl.zeros((BLOCK_V,), dtype=grad_ptr.dtype.element_ty)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            tl.store(grad_row_ptr + idx, zeros, mask=idx < V)
    else:
        m = tl.load(max_ptr + row)
        logsum = tl.load(logsum_ptr + row)
        g = tl.load(grad_out_ptr).to(tl.float32)
        in_range = (tgt >= 0) & (tgt < V)
        g = tl.where(in_range, g, float("nan"))
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = idx < V
            x = tl.load(row_ptr + idx, mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - m) - logsum)
            d = tl.where(idx == tgt, p - 1.0, p) * g
            tl.store(grad_row_ptr + idx, d.to(grad_ptr.dtype.element_ty), mask=mask)


# --- launchers and the autograd Function -----------------------------------------


@dataclass(frozen=True)
class CrossEntropyConfig:
    block_v: int  # vocabulary chunk one program holds in registers (a power of two)
    num_warps: int


# GPU: one row per program, so 8k rows fill an H200's 132 SMs several times over, and
# the resident programs per SM hide the load latency (Triton does not software-pipeline
# loads that feed no dot, so num_stages has no effect here). An 8192-wide chunk with 8
# warps is 32 elements, four 16-byte BF16 loads, per thread (with V and the row stride
# multiples of 16, which Triton's argument specialisation sees; 100352 is); sm_90 ptxas
# gives the forward 53 registers (4 programs per SM) and the backward 32 (8 per SM), no
# spills. Not tuned on a GPU yet (the fused step ran with these). CPU runs are the
# Triton interpreter (tests), where small chunks keep the multi-chunk paths exercised.
_GPU = {
    "forward": CrossEntropyConfig(block_v=8192, num_warps=8),
    "backward": CrossEntropyConfig(block_v=8192, num_warps=8),
}
_CPU = CrossEntropyConfig(block_v=32, num_warps=1)


def default_cross_entropy_config(kind: str, device: torch.device) -> CrossEntropyConfig:
    """Configuration of kernel ``kind`` (``forward`` or ``backward``) on ``device``."""
    if kind not in _GPU:
        raise ValueError(f"cross-entropy kernel kind must be one of {sorted(_GPU)}, got {kind!r}")
    return _GPU[kind] if device.type == "cuda" else _CPU


def cross_entropy_forward(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row FP32 ``(loss, max, log-sum)``: ``loss = (max - x[t]) + log-sum``, zero
    (and zero statistics) for ``ignore_index`` rows. ``logits_NV`` must have unit
    stride along V."""
    N, V = logits_NV.shape
    stats = torch.empty(3, N, dtype=torch.float32, device=logits_NV.device)
    loss_N, max_N, logsum_N = stats.unbind(0)
    if N == 0:
        return loss_N, max_N, logsum_N
    cfg = config or default_cross_entropy_config("forward", logits_NV.device)
    forward_kernel[(N,)](
        logits_NV, targets_N, loss_N, max_N, logsum_N,
        V, logits_NV.stride(0), ignore_index,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    return loss_N, max_N, logsum_N


def cross_entropy_backward(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, max_N: torch.Tensor,
    logsum_N: torch.Tensor, grad_out: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None,
) -> torch.Tensor:
    """``(softmax(x) - onehot(t)) * grad_out`` per row as a new tensor of the logits'
    dtype; zero rows for ``ignore_index``. ``grad_out`` is a 0-d device tensor (read by
    the kernel, never by the host)."""
    N, V = logits_NV.shape
    grad_NV = torch.empty((N, V), dtype=logits_NV.dtype, device=logits_NV.device)
    if N == 0:
        return grad_NV
    cfg = config or default_cross_entropy_config("backward", logits_NV.device)
    backward_kernel[(N,)](
        logits_NV, targets_N, max_N, logsum_N, grad_out.reshape(()).float(), grad_NV,
        V, logits_NV.stride(0), grad_NV.stride(0), ignore_index,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    return grad_NV


class _FusedCrossEntropySum(torch.autograd.Function):
    """Sum of row cross-entropies; saves the logits (alive anyway until the head's
    backward) and 8 bytes per row, where ``F.cross_entropy`` on FP32 logits keeps FP32
    log-probs."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, ignore_index, config):  # noqa: ANN001, ANN205
        loss_N, max_N, logsum_N = cross_entropy_forward(logits_NV, targets_N, ignore_index, config)
        ctx.save_for_backward(logits_NV, targets_N, max_N, logsum_N)
        ctx.ignore_index, ctx.config = ignore_index, config
        return loss_N.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        logits_NV, targets_N, max_N, logsum_N = ctx.saved_tensors
        grad_NV = cross_entropy_backward(logits_NV, targets_N, max_N, logsum_N, grad_out,
                                         ctx.ignore_index, ctx.config)
        return grad_NV, None, None, None


def fused_cross_entropy_sum(
    logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = IGNORE_INDEX,
    config: CrossEntropyConfig | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(logits_NV.float(), targets_N, ignore_index=..., reduction="sum")``
    with the Triton kernels (differentiable in ``logits_NV``); ``config`` overrides both
    kernels' configuration (tests). Ids outside ``[0, V)`` give NaN, not an error."""
    if logits_NV.dim() != 2 or targets_N.shape != logits_NV.shape[:1]:
        raise ValueError(
            f"fused cross-entropy: logits {tuple(logits_NV.shape)} must be [N, V] and "
            f"targets {tuple(targets_N.shape)} [N]"
        )
    if logits_NV.stride(1) != 1:
        logits_NV = logits_NV.contiguous()
    return _FusedCrossEntropySum.apply(logits_NV, targets_N.contiguous(), ignore_index, config)
