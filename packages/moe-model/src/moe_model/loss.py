"""Language-model loss as a token *sum*.

The trainer divides by the number of target tokens in the whole global batch
(all microbatches, all data-parallel ranks), so the loss and its gradients are
the same whatever the layout or microbatch split.

On CUDA (when Triton imports) the loss is a fused cross-entropy in Triton
(``_cross_entropy_kernels``): ``F.cross_entropy(logits.float(), ...)`` materialises
an FP32 copy of the logits, FP32 log-probs (kept for backward) and FP32 gradients,
about 9 GB and 200-300 ms per optimizer step at a 100k vocabulary and 8k tokens
per microbatch. The fused version reads the BF16 logits once in the forward
(online max / log-sum-exp in FP32 registers, per-row loss and two FP32 row
statistics saved), and once more in the backward, writing the gradient straight
in the logits' dtype. Row losses are summed with ``torch.sum`` (no atomics, so the
sum is deterministic). On CPU the loss stays the plain ``F.cross_entropy`` call: it
is the reference of the layout-equivalence tests.

Target ids: the CPU path raises on an id outside ``[0, V)``. The CUDA path checks
nothing on the host (that would be a sync per microbatch); the data layer
validates token ids against the vocabulary when it opens the token files, and the
kernels still never read out of bounds: such a row's loss and gradient come out
NaN, so the step is skipped as non-finite rather than silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moe_model._triton_support import triton_available

IGNORE_INDEX = -100


def lm_loss_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in FP32; ``IGNORE_INDEX`` targets count zero.

    Fused Triton kernels on CUDA, the plain ``F.cross_entropy`` call elsewhere (see the
    module docstring)."""
    logits_NV = logits_BSV.reshape(-1, logits_BSV.shape[-1])
    targets_N = targets_BS.reshape(-1)
    if logits_NV.is_cuda and triton_available():
        return fused_cross_entropy_sum(logits_NV, targets_N, IGNORE_INDEX)
    return F.cross_entropy(
        logits_NV.float(),
        targets_N,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# ------------------------------------------------------------ fused (Triton)
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
# spills. Not yet tuned on a GPU. CPU runs are the Triton interpreter (tests), where
# small chunks keep the multi-chunk paths exercised.
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


def set_cross_entropy_config(kind: str, config: CrossEntropyConfig) -> None:
    """Replace the GPU configuration of ``kind`` (e.g. with a tuned one)."""
    if kind not in _GPU:
        raise ValueError(f"cross-entropy kernel kind must be one of {sorted(_GPU)}, got {kind!r}")
    _GPU[kind] = config




def _kernels():  # noqa: ANN202 - the jitted kernels
    from moe_model import _cross_entropy_kernels as k

    return k.forward_kernel, k.backward_kernel


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
    forward_kernel, _ = _kernels()
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
    _, backward_kernel = _kernels()
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
