"""One rank's training loop: an optimizer step in explicit phases.

``Trainer.step`` runs, in order:

1. ``_forward_backward``  this rank's microbatches of the global batch; each loss is
   the token-loss *sum* divided by the global batch's target-token count, so any
   split over microbatches and ranks sums to the same loss and gradient.
2. ``_sync_gradients``    sum gradients over each parameter's replica group.
3. ``_reduce_stats``      loss and MoE routing statistics summed over DP.
4. ``_clip``              global gradient norm, clipped; a non-finite loss or norm
                          skips the update (counted by ``fit``).
5. ``_update``            optimizer step at the scheduled learning rate, then the
                          routers' bias step (aux-loss-free balancing) from the
                          step's expert load summed over DP: once per step.

Phases 2, 4 and 5 are where the multi-group DDP, the global-norm clip over
replica groups and the distributed optimizer plug in; phase 1 is where pipeline
schedules do. This version sums plain gradients over the DP group, which is
every parameter's replica group while ``parallel.ep == 1`` and ``parallel.pp == 1``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from moe_model import (
    MoETransformer,
    flops_per_token,
    init_weights,
    lm_loss_sum,
    set_aux_loss_scale,
    set_count_reducer,
)

from pretrain.config import PretrainConfig
from pretrain.data import BatchReader, open_source
from pretrain.mesh import ParallelMesh
from pretrain.metrics import MetricsLog
from pretrain.moe_stats import MoEStepStats
from pretrain.optimizer import build_optimizer, set_lr
from pretrain.schedule import lr_at
from pretrain.signals import StopRequest

PEAK_FLOPS = 989e12  # dense BF16 peak of one H200: the MFU denominator peers use


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class Trainer:
    """One rank's model, optimizer and data slice; ``step`` runs one optimizer step."""

    def __init__(self, cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.dtype = resolve_dtype(cfg.train.compute_dtype, device)
        t = cfg.train
        data_seed = cfg.seed if cfg.data.seed is None else cfg.data.seed
        source = open_source(cfg.data.path, t.seq_len, cfg.model.vocab_size, data_seed)
        self.data = BatchReader(source, data_seed, t.global_batch, t.micro_batch,
                                mesh.dp_rank, mesh.layout.dp)
        torch.manual_seed(cfg.seed)
        self.model = MoETransformer(cfg.model).to(device)
        init_weights(self.model, cfg.model, cfg.seed)
        self.optimizer = build_optimizer(self.model, cfg.optim)
        if mesh.layout.dp > 1:  # global-batch load balancing counts over every DP rank's tokens
            set_count_reducer(self.model, self._sum_over_dp)
        self.tokens_per_step = t.global_batch * t.seq_len  # = target tokens of the global batch
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)

    def fit(self, log: MetricsLog, stop: StopRequest) -> list[dict[str, Any]]:
        """Steps 1..``train.steps`` until done or stopped; returns the records (on every rank)."""
        history, consecutive_skips = [], 0
        limit = self.cfg.train.max_consecutive_skips
        for step in range(1, self.cfg.train.steps + 1):
            record = self.step(step)
            log.write(record)
            history.append(record)
            consecutive_skips = consecutive_skips + 1 if record["skipped"] else 0
            if consecutive_skips >= limit:
                raise TrainingAborted(
                    f"{consecutive_skips} consecutive steps (to step {step}) had a non-finite loss or "
                    f"gradient norm (loss {record['loss']}, grad_norm {record['grad_norm']}); "
                    "aborting (train.max_consecutive_skips); lower optim.lr or check the data"
                )
            if stop.agreed(self.device):
                if self.mesh.is_logging_rank:
                    print(f"stopping after step {step}: {stop.describe()}", flush=True)
                break
        return history

    def step(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        loss = self._forward_backward(step)
        self._sync_gradients()
        loss, moe = self._reduce_stats(loss)
        grad_norm = self._clip()
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            self._update(lr, moe)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        record: dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
            "skipped": skipped,
        }
        if moe is not None:
            every = self.cfg.metrics.expert_load_every
            with_load = every > 0 and (step == 1 or step % every == 0)
            record.update(moe.record(with_load))
        if self.device.type == "cuda":
            n_gpus = self.mesh.layout.world_size
            record["mfu"] = self.flops_per_token * record["tokens_per_s"] / (n_gpus * PEAK_FLOPS)
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return record

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Sum of this rank's microbatch losses, each already divided by the global token count."""
        set_aux_loss_scale(self.model, 1.0 / self.tokens_per_step)
        loss_sum = torch.zeros((), device=self.device)
        for index in range(self.data.n_microbatches):
            tokens = self.data.microbatch(step, index)
            if self.device.type == "cuda":
                tokens = tokens.pin_memory()
            tokens = tokens.to(self.device, non_blocking=True)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with torch.autocast(self.device.type, dtype=self.dtype,
                                enabled=self.dtype != torch.float32):
                logits = self.model(inputs)
            loss = lm_loss_sum(logits, targets) / self.tokens_per_step
            loss.backward()
            loss_sum += loss.detach()
        return loss_sum

    def _sync_gradients(self) -> None:
        """Sum every gradient over the DP group (one flat all-reduce)."""
        if self.mesh.layout.dp == 1:
            return
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.mesh.dp_group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def _reduce_stats(self, loss: torch.Tensor) -> tuple[float, MoEStepStats | None]:
        """The global loss and the step's routing statistics, summed over DP (on every rank)."""
        dist.all_reduce(loss, group=self.mesh.dp_group)
        moe = MoEStepStats.pop(layer for _, layer in self.model.moe_layers())
        if moe is not None:
            moe.all_reduce(self.mesh.dp_group)
        return loss.item(), moe

    def _clip(self) -> float:
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()

    def _update(self, lr: float, moe: MoEStepStats | None) -> None:
        """Optimizer step, then the routers' bias step from the step's reduced expert load."""
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if moe is not None:
            for (_, layer), counts_E in zip(self.model.moe_layers(), moe.tokens_per_expert_LE):
                layer.update_bias(counts_E)

    def _sum_over_dp(self, counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts, group=self.mesh.dp_group)
        return counts
