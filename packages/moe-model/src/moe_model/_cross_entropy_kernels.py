"""Triton kernels of the fused cross-entropy (imported lazily by ``moe_model.loss``,
whose docstring describes them). Importing this module requires Triton.

Both kernels run one program per row and stream the row in ``BLOCK_V`` chunks, so
registers hold one chunk whatever the vocabulary size; all arithmetic is FP32.
Row offsets are formed in int64 (``N * V`` passes 2**31 at 21k tokens of a 100k
vocabulary).
"""

import triton
import triton.language as tl

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
