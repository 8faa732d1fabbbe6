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

A layer whose output becomes the logits may want their gradient encoded per row as well
(moe_mxfp8's FP8 head quantizes it rowwise to E4M3 for its input-gradient GEMM, reading
the 1.6 GB gradient of a microbatch twice): where the fused cross-entropy runs on exactly
the tensor that carries a ``GRADIENT_ROW_ENCODER`` (``moe_model.row_encoding``), its
backward writes the codes in the pass that writes the gradient and hands both to the
encoder.

Target ids: the CPU path raises on an id outside ``[0, V)``. The CUDA path checks
nothing on the host (that would be a sync per microbatch); the data layer
validates token ids against the vocabulary when it opens the token files, and the
kernels still never read out of bounds: such a row's loss and gradient come out
NaN, so the step is skipped as non-finite rather than silently wrong.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_model._triton_support import Backend, use_fused
from moe_model.row_encoding import GRADIENT_ROW_ENCODER

IGNORE_INDEX = -100


def lm_loss_sum_reference(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in FP32 (``IGNORE_INDEX`` targets count zero): the
    plain ``F.cross_entropy`` call over an FP32 copy of the logits."""
    return F.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(),
        targets_BS.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def lm_loss_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """``lm_loss_sum_reference``'s loss; the fused path is the Triton cross-entropy of
    ``_cross_entropy_kernels`` (see the module docstring), which also serves the logits'
    ``GRADIENT_ROW_ENCODER``."""
    if use_fused("lm_loss_sum", backend, logits_BSV.device):
        from moe_model._cross_entropy_kernels import fused_cross_entropy_sum

        return fused_cross_entropy_sum(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1),
                                       IGNORE_INDEX, encoder=getattr(logits_BSV, GRADIENT_ROW_ENCODER, None))
    return lm_loss_sum_reference(logits_BSV, targets_BS)
