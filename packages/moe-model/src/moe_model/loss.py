"""Language-model loss as a token *sum*.

The trainer divides by the number of target tokens in the whole global batch
(all microbatches, all data-parallel ranks), so the loss and its gradients are
the same whatever the layout or microbatch split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def lm_loss_sum(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies in FP32; ``IGNORE_INDEX`` targets count zero."""
    return F.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(),
        targets_BS.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
