"""One rank's training loop: an optimizer step in explicit phases.

Built once (``pretrain.build``): this rank's part of the model, then
``MultiGroupDDP`` (every parameter's gradient reduced with SUM inside its replica
group: dense -> DP, routed experts -> EP-DP), then the distributed optimizer
over it, then the MXFP8 caches' refresh hook.

``Trainer.step`` runs, in order (the names are the phase timer's):

1. ``forward`` / ``backward``: this rank's microbatches of the global batch, all
   but the last under ``no_sync()``; each loss is the token-loss *sum* times
   ``1 / N`` with ``N`` the global batch's target-token count (the auxiliary
   losses use the same scale), so any split over microbatches, ranks and stages
   sums to the same loss and gradient, and SUM is the right reduction (global-batch
   balancing over several microbatches per rank excepted: see the README). With
   ``parallel.pp > 1`` moe_pp's pipeline runs the schedule instead (phase
   ``pipeline``) and calls ``finish_grad_sync`` itself.
2. ``grad_sync``: ``finish_grad_sync`` launches the buckets the last backward did
   not, and waits.
3. ``optimizer``: global-norm clip, AdamW/Muon on the FP32 shards at the
   scheduled LR; a non-finite norm skips the update on the device. Then
   ``weight_rebuild``: the compute weights are gathered from the main weights and
   the MXFP8 caches refresh.
4. ``stats``: the loss, the stop flag and every MoE layer's routing statistics in
   one SUM all-reduce over the world (``pretrain.moe_stats``); the routers' bias
   step (aux-loss-free balancing) from the step's expert load summed over DP,
   once per step, on the device, and not on a skipped step.

With ``train.cuda_graphs`` the first step runs eagerly (on the graphs' stream) and
the microbatches' forward and backward, with the final ``finish_grad_sync``, are then
captured in CUDA graphs (``pretrain.graphs``; not after a step that ends the run:
the last, ``train.stop_after``'s or a stopped one) and
replayed from the second step on, as one phase ``graph``; the rest of the step runs as
before.

Host synchronisation: none inside the step on GPU (the no-sync transports,
device-side routing, clipping and skip flag). The one synchronisation per step
is ``_read``: one copy of the reduced values, the gradient norm, the skip flag and
(on GPU) the ranks' largest peak memory (a one-element MAX all-reduce queued just
before) to the host at the end of the step, which the logging, the skip counter and
the stop decision need. (``parallel.ep_backend=all_to_all`` adds the host-visible
split sizes of its all-to-all; ``rowwise`` does not.)

Shape legend: L MoE layers of the model, E experts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP
from moe_model import (
    GradientSink,
    flops_per_token,
    lm_loss_sum,
    param_kind,
    set_aux_loss_scale,
    set_count_reducer,
    set_gradient_sink,
)
from moe_mxfp8 import refresh_weight_caches
from torch import nn

from pretrain.build import build_model_part
from pretrain.config import ConfigError, PretrainConfig
from pretrain.data import BatchReader, open_data
from pretrain.errors import PretrainError
from pretrain.evaluate import Evaluator, eval_every
from pretrain.graphs import MicrobatchGraphs
from pretrain.mesh import ParallelMesh
from pretrain.metrics import MetricsLog
from pretrain.moe_stats import StepPacker
from pretrain.optimizer import MIN_SHARD_NUMEL, build_optimizer
from pretrain.phases import PhaseTimer
from pretrain.schedule import build_schedule
from pretrain.signals import StopRequest

PEAK_FLOPS = 989e12  # dense BF16 peak of one H200: the MFU denominator peers use


class TrainingAborted(PretrainError, RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


class StepCheckpoints(Protocol):
    """What the loop needs from the run's checkpointer (``pretrain.checkpoint``)."""

    def due(self, step: int, stopping: bool) -> bool: ...

    def save(self, step: int) -> None: ...


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class _DeviceStep:
    """A step's results still on the device."""

    reduced: torch.Tensor  # StepPacker layout, summed over the world
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float
    val_loss_sum: torch.Tensor | None = None  # held-out token-loss sum, on evaluation steps


class _MarkedGradSync:
    """The DDP wrapper as the pipeline sees it, marking where ``finish_grad_sync`` starts."""

    def __init__(self, ddp: MultiGroupDDP, mark: Callable[[str], None]) -> None:
        self.ddp, self.mark = ddp, mark

    def no_sync(self) -> Any:
        return self.ddp.no_sync()

    def finish_grad_sync(self) -> None:
        self.mark("grad_sync")
        self.ddp.finish_grad_sync()


class Trainer:
    """One rank's model part, optimizer and data slice; ``step`` runs one optimizer step.

    ``phase_timer``: optional step-time breakdown (benchmarks); ``None`` costs nothing.
    """

    def __init__(self, cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device,
                 phase_timer: PhaseTimer | None = None) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.dtype = resolve_dtype(cfg.train.compute_dtype, device)
        self.timer = phase_timer
        t, m = cfg.train, cfg.model
        data_seed = cfg.seed if cfg.data.seed is None else cfg.data.seed
        source = open_data(cfg.data, t.seq_len, m.vocab_size, data_seed)
        self.data = BatchReader(source, data_seed, t.global_batch, t.micro_batch,
                                mesh.dp_rank, mesh.layout.dp)
        torch.manual_seed(cfg.seed)
        self.part = build_model_part(cfg, mesh, device, self.dtype)
        self.model: nn.Module = self.part.module
        self.ddp = MultiGroupDDP(
            self.model, lambda name, _: mesh.replica_group(param_kind(name) == "expert"),
            DDPConfig(mode=cfg.parallel.ddp_mode, reduce_op="sum",
                      bucket_cap_mb=cfg.parallel.bucket_cap_mb, min_shard_numel=MIN_SHARD_NUMEL,
                      merge_microbatch_gradients=cfg.parallel.merge_expert_grad_microbatches),
        )
        if cfg.parallel.fuse_expert_grad_accumulation:
            self._set_gradient_sink(self.ddp)
        self.optimizer = build_optimizer(self.ddp, cfg.optim, m.n_experts,
                                         mesh.expert_range(m.n_experts).start, device)
        if self.part.mxfp8_layers:
            self.optimizer.register_weights_updated_hook(lambda: refresh_weight_caches(self.model))
            refresh_weight_caches(self.model)
        if mesh.layout.dp > 1:  # global-batch load balancing counts over every DP rank's tokens
            set_count_reducer(self.model, self._sum_over_dp)
        self.tokens_per_step = t.global_batch * t.seq_len  # = target tokens of the global batch
        self.loss_scale = 1.0 / self.tokens_per_step
        set_aux_loss_scale(self.model, self.loss_scale)
        self.schedule = build_schedule(cfg.optim, t.steps)
        self.packer = StepPacker(self.part.moe_layers, m.n_moe_layers, m.n_experts, device)
        self.flops_per_token = flops_per_token(m, t.seq_len)
        self.eval_every = eval_every(cfg)
        self.evaluator = Evaluator(cfg, mesh, device, self.part) if self.eval_every else None
        self.graphs: MicrobatchGraphs | None = None
        if t.cuda_graphs:
            if device.type != "cuda":
                raise ConfigError(f"train.cuda_graphs needs a CUDA device, this run uses {device}")
            self.reset_graphs()

    def reset_graphs(self) -> None:
        """Drop the captured graphs: the next step runs eagerly and captures them again.

        A step does this itself when the model's hooks, parameter or buffer tensors or
        train/eval flag changed since the capture (``pretrain.graphs.launch_fingerprint``);
        call it after changing anything else a forward reads (a Python attribute). No-op
        without ``train.cuda_graphs``.
        """
        if self.cfg.train.cuda_graphs:
            self.graphs = MicrobatchGraphs(
                self.model, self.data.n_microbatches, self.cfg.parallel.merge_expert_grad_microbatches,
                self.packer.n_slots * self.packer.width, self.device)

    def close(self) -> None:
        """Release the EP transport (collective) and detach the gradient hooks."""
        self.part.close()
        self._set_gradient_sink(None)
        self.ddp.close()
        self.graphs = None

    def _set_gradient_sink(self, sink: GradientSink | None) -> None:
        """``sink`` on the model part and on each pipeline stage's view: a view is a shallow
        copy of the model's root with root attributes of its own (the embedding's sink), and
        the views are what the schedule runs."""
        pipeline = self.part.pipeline
        views = [stage.module for stage in pipeline.stages.stages] if pipeline is not None else []
        for module in (self.model, *views):
            set_gradient_sink(module, sink)

    # -- the loop ------------------------------------------------------------------

    def fit(self, log: MetricsLog, stop: StopRequest, checkpoints: StepCheckpoints | None = None,
            start_step: int = 1) -> list[dict[str, Any]]:
        """Steps ``start_step..train.steps`` until done or stopped; the records (on every rank)."""
        t = self.cfg.train
        history, consecutive_skips = [], 0
        for step in range(start_step, t.steps + 1):
            requested = stop.requested
            # ``final`` only decides a graph capture, which runs on one rank (config): its
            # own request is the agreed one there
            final = requested or step in (t.steps, t.stop_after)
            record, stop_agreed = self._step(step, requested, final)
            log.write(record)
            history.append(record)
            reason = stop.describe() if stop_agreed else \
                "train.stop_after" if step == t.stop_after else None
            if checkpoints is not None and checkpoints.due(step, reason is not None):
                checkpoints.save(step)
            consecutive_skips = consecutive_skips + 1 if record["skipped"] else 0
            if consecutive_skips >= t.max_consecutive_skips:
                raise TrainingAborted(
                    f"{consecutive_skips} consecutive steps (to step {step}) had a non-finite "
                    f"gradient norm (loss {record['loss']}, grad_norm {record['grad_norm']}); "
                    "aborting (train.max_consecutive_skips); lower optim.lr or check the data"
                )
            if reason is not None:
                if self.mesh.is_logging_rank:
                    print(f"stopping after step {step}: {reason}", flush=True)
                break
        return history

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step; its metrics record. (Only ``fit`` stops: a caller stepping
        on its own, e.g. a benchmark, gets graphs captured after any step but the last.)"""
        return self._step(step, stop_requested=False, final=step >= self.cfg.train.steps)[0]

    def _step(self, step: int, stop_requested: bool, final: bool) -> tuple[dict[str, Any], bool]:
        """``final``: the run ends after this step, so no graphs are captured for later ones."""
        start = time.perf_counter()
        result = self._run(step, stop_requested, final)
        if self.evaluator is not None and (final or step % self.eval_every == 0):
            result.val_loss_sum = self.evaluator.loss_sum(step)
        return self._read(step, result, start)

    # -- phases (device work only) ---------------------------------------------------

    def _mark(self, phase: str | None) -> None:
        if self.timer is not None:
            self.timer.mark(phase)

    def _run(self, step: int, stop_requested: bool, final: bool) -> _DeviceStep:
        lr_factor = self.schedule(step)
        if self.graphs is not None and self.graphs.captured and not self.graphs.match_model():
            self.reset_graphs()  # the model changed since the capture: eager now, capture after
        graphs = self.graphs
        if graphs is not None and graphs.captured:
            self._mark("graph")
            graphs.replay(self._host_batches(step))
            loss, step_stats = graphs.loss_sum, graphs.stats_sum
        else:
            loss, step_stats = self._forward_backward(step), None
        self._mark("optimizer")
        stats = self.optimizer.update(lr_factor)
        self._mark("weight_rebuild")
        self.optimizer.rebuild_weights()
        self._mark("stats")
        reduced = self.packer.pack(loss, stop_requested, step_stats)
        dist.all_reduce(reduced)
        self._update_router_bias(reduced, stats.skipped)
        self.ddp.zero_grad()
        if graphs is not None:
            if graphs.captured:
                graphs.reset_sums()
            elif not final:  # this step ran eagerly on the graphs' stream
                graphs.capture(self._run_unit, (self.cfg.train.micro_batch, self.cfg.train.seq_len + 1))
                # the capture ran the units' Python (no kernels): the data-parallel wrapper
                # counts their gradients as reduced; a next step that runs eagerly (the
                # model changed) must start from a clean slate, as a replay does
                self.ddp.zero_grad()
        self._mark(None)
        return _DeviceStep(reduced, stats.grad_norm, stats.skipped, self.cfg.optim.lr * lr_factor)

    def _host_batches(self, step: int) -> list[torch.Tensor]:
        """``[micro_batch, seq_len + 1]`` token ids of this rank's microbatches, on the host
        (pinned on CUDA, so the copies to the device do not wait for it)."""
        batches = [self.data.microbatch(step, i) for i in range(self.data.n_microbatches)]
        return [b.pin_memory() for b in batches] if self.device.type == "cuda" else batches

    def _forward_backward(self, step: int) -> torch.Tensor | None:
        """This rank's part of the global loss; ``None`` where no last pipeline stage is held."""
        batches = [b.to(self.device, non_blocking=True) for b in self._host_batches(step)]
        pipeline = self.part.pipeline
        if pipeline is not None:
            self._mark("pipeline")
            losses = pipeline.step([b[:, :-1] for b in batches], [b[:, 1:] for b in batches],
                                   self.loss_scale, grad_sync=_MarkedGradSync(self.ddp, self._mark))
            return losses.sum() if self.mesh.is_last_stage else None
        if self.graphs is None:
            return self._microbatches(batches, finish=True)
        # warm-up for the capture: the same work on the stream the graphs are captured on
        stream, current = self.graphs.stream, torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            loss_sum = self._microbatches(batches, finish=True)
        current.wait_stream(stream)
        return loss_sum

    def _microbatches(self, batches: list[torch.Tensor], finish: bool,
                      loss_sum: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of ``batches`` (device token ids), all under ``no_sync()``
        but the last if ``finish``, which then ends with ``finish_grad_sync()``; their loss
        added to ``loss_sum`` (a new zero if ``None``), which is returned."""
        if loss_sum is None:
            loss_sum = torch.zeros((), device=self.device)
        for index, tokens in enumerate(batches):
            sync = finish and index == len(batches) - 1
            with nullcontext() if sync else self.ddp.no_sync():
                self._mark("forward")
                loss = lm_loss_sum(self.model(tokens[:, :-1]), tokens[:, 1:]) * self.loss_scale
                self._mark("backward")
                loss.backward()
            loss_sum += loss.detach()
        if finish:
            self._mark("grad_sync")
            self.ddp.finish_grad_sync()
        return loss_sum

    def _run_unit(self, tokens: Sequence[torch.Tensor], last: bool) -> None:
        """One captured unit: its microbatches, their loss and statistics into the graphs'
        running sums."""
        graphs = self.graphs
        self._microbatches(list(tokens), finish=last, loss_sum=graphs.loss_sum)
        graphs.stats_sum.add_(self.packer.stats())

    def _update_router_bias(self, reduced: torch.Tensor, skipped: torch.Tensor) -> None:
        """The routers' bias step from the step's load summed over DP; none on a skipped step.

        The bias moves by ``rate * sign(mean - load)``: an all-zero load moves nothing,
        so zeroing the counts of a skipped step skips the update without a host read.
        """
        counts_LE = self.packer.counts(reduced) * (~skipped).to(reduced.dtype)
        for index, layer in self.part.moe_layers.items():
            layer.update_bias(counts_LE[index])

    def _sum_over_dp(self, counts: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(counts, group=self.mesh.dp_group)
        return counts

    # -- the one host synchronisation of a step --------------------------------------------

    def _read(self, step: int, result: _DeviceStep, start: float) -> tuple[dict[str, Any], bool]:
        tail = [result.grad_norm.reshape(1).double(), result.skipped.reshape(1).double()]
        if result.val_loss_sum is not None:
            tail.append(result.val_loss_sum.reshape(1).double())
        if self.device.type == "cuda":
            tail.append(self._peak_memory_bytes())
        host = torch.cat([result.reduced, *tail]).cpu()
        elapsed = time.perf_counter() - start
        n = result.reduced.numel()
        values = self.packer.unpack(host[:n])
        record: dict[str, Any] = {
            "step": step, "loss": values.loss, "lr": result.lr, "grad_norm": host[n].item(),
            "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
            "skipped": bool(host[n + 1].item()),
        }
        if result.val_loss_sum is not None:
            tail_at = n + 2
            n += 1
            record["val_loss"] = host[tail_at].item() / self.evaluator.n_tokens
            record["val_ppl"] = math.exp(min(record["val_loss"], 700.0))
        if values.moe is not None:
            every = self.cfg.metrics.expert_load_every
            record.update(values.moe.record(every > 0 and (step == 1 or step % every == 0)))
        if self.device.type == "cuda":
            n_gpus = self.mesh.layout.world_size
            record["mfu"] = self.flops_per_token * record["tokens_per_s"] / (n_gpus * PEAK_FLOPS)
            record["peak_mem_gib"] = host[n + 2].item() / 2**30
        return record, values.stop

    def _peak_memory_bytes(self) -> torch.Tensor:
        """The largest rank's peak allocated bytes, as a device tensor: the rank that logs
        (the last stage's) is often not the fullest (1F1B's first stage, a skewed EP rank).
        The allocator's counter is the host's and already holds the step's allocations; its
        MAX all-reduce is queued before the step's one copy to the host, which reads it too
        (``full`` passes the count as a kernel argument: a host-to-device copy would sync)."""
        peak = torch.full((1,), float(torch.cuda.max_memory_allocated(self.device)),
                          dtype=torch.float64, device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return peak
