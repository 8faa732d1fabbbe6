"""``parallel.merge_expert_grad_microbatches=auto`` resolved for the run's GPUs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.config import PretrainConfig


def resolve_merge(cfg: PretrainConfig, world: int, device: torch.device) -> PretrainConfig:
    """``cfg`` with an ``auto`` merge count replaced by the one the memory planner fits in
    this device's memory (``pretrain.planner.fitting_merge``, its default headroom), the
    least over the ranks: every rank must hold the same microbatches (the CUDA graphs'
    units and the gradient sink's merges follow the count). 1 on a CPU, where the fused
    weight-gradient kernels do not run. A config without ``auto`` is returned as it is."""
    if cfg.parallel.merge_expert_grad_microbatches != "auto":
        return cfg
    n = 1
    if device.type == "cuda":
        from pretrain.planner import fitting_merge

        gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        n = fitting_merge(cfg, world, gpu_gib=gib)
        if dist.is_initialized() and dist.get_world_size() > 1:
            least = torch.tensor([n], device=device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            n = int(least.item())
    return cfg.with_changes("parallel", merge_expert_grad_microbatches=n)
