"""The global gradient norm over several replica groups, without host synchronisation.

Each rank adds up squared norms of what it holds and one all-reduce over the
*norm group* (all ranks that together hold the model, usually the world; PP x DP)
sums them. For that sum to count every logical parameter exactly once:

- a shard of a sharded tensor is held by one rank of its group: weight 1;
- a replicated tensor is held identically by all ``G`` ranks of its replica
  group: weight ``1/G`` (dense small tensors over DP, expert tensors over EP-DP);
- experts of different EP-MP ranks are different tensors: each counts once;
- a rank with no expert parameters (or a pipeline stage without MoE layers)
  simply contributes nothing for them.

The norm, the clip coefficient and the non-finite flag stay on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def global_grad_norm(
    grads: list[torch.Tensor],
    weights: torch.Tensor,
    norm_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.Tensor:
    """``sqrt(sum_ranks sum_i weights[i] * ||grads[i]||^2)`` as a device scalar (FP32)."""
    if grads:
        norms = torch.stack(torch._foreach_norm(grads))
        total_sq = (norms.square() * weights).sum()
    else:
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if norm_group is not None:
        dist.all_reduce(total_sq, group=norm_group)
    return total_sq.sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
