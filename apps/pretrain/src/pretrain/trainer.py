"""One rank's training loop: an optimizer step in explicit phases.

Built once (``pretrain.build``): this rank's part of the model, then
``MultiGroupDDP`` (every parameter's gradient reduced with SUM inside its replica
group: dense -> DP, routed experts -> EP-DP), then the distributed optimizer
over it, then the MXFP8 caches' refresh hook; the model is wired once
(``moe_model.wire_model``: the aux-loss scale, the gradient sink, the DP count
reducer and the EP dispatchers).

``Trainer.train_step`` runs, in order (the names are the phase timer's):

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
5. ``eval``, on the steps ``fit`` evaluates (every ``eval.every`` steps and the run's
   last): the held-out windows' loss under the updated weights (``pretrain.evaluate``),
   forward only, its sum left on the device for the step's read.

With ``train.cuda_graphs`` the step's forward and backward is a
``pretrain.graphs.GraphedForwardBackward`` in place of the eager one: the first step
runs eagerly (on the graphs' stream), ``fit`` then captures the microbatches' forward
and backward, with the final ``finish_grad_sync``, in CUDA graphs (not after a step that
ends the run: the last, ``train.stop_after``'s or a stopped one), and they are replayed
from the second step on, as one phase ``graph``; the rest of the step runs as before.

Host synchronisation: none inside the step on GPU (the no-sync transports,
device-side routing, clipping and skip flag). The one synchronisation per step
is at the end of ``train_step``: one copy of the reduced values, the gradient norm, the
skip flag, the held-out loss sum on an evaluation step and (on GPU) the ranks' largest
peak memory (a one-element MAX all-reduce queued just before) to the host at the end of
the step, which the logging, the skip counter and the stop decision need.
(``parallel.ep_backend=all_to_all`` adds the host-visible split sizes of its
all-to-all; ``rowwise`` does not.)

Shape legend: L MoE layers of the model, E experts.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP
from moe_model import (
    ModelWiring,
    attended_pairs,
    documents_from_eos,
    flops_per_token,
    lm_loss_sum,
    param_kind,
    wire_model,
)
from moe_mxfp8 import refresh_weight_caches
from moe_optim import StepStats
from torch import nn

from pretrain.build import build_model_part
from pretrain.config import ConfigError, PretrainConfig
from pretrain.data import BatchReader, document_eos_id, open_data
from pretrain.divergence import SkipGuard
from pretrain.evaluate import Evaluator, eval_every
from pretrain.graphs import GraphedForwardBackward, MicrobatchGraphs, UnitGraphs
from pretrain.merge_choice import resolve_merge
from pretrain.mesh import ParallelMesh
from pretrain.metrics import MetricsLog
from pretrain.moe_stats import StepPacker
from pretrain.optimizer import MIN_SHARD_NUMEL, build_optimizer
from pretrain.phases import PhaseTimer
from pretrain.reference_kernels import reference_kernels
from pretrain.samples import SAMPLES_FILE, PromptSamples
from pretrain.schedule import build_schedule
from pretrain.signals import StopRequest
from pretrain.sm_carveout import sm_carveout
from pretrain.tokenizer_files import data_tokenizer

PEAK_FLOPS = 989e12  # dense BF16 peak of one H200: the MFU denominator peers use


class StepCheckpoints(Protocol):
    """What the loop needs from the run's checkpointer (``pretrain.checkpoint``)."""

    def due(self, step: int, stopping: bool) -> bool: ...

    def save(self, step: int) -> None: ...


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass
class StepResult:
    """What ``Trainer.train_step`` returns."""

    record: dict[str, Any]  # the step's metrics record (a line of metrics.jsonl)
    stop: bool  # some rank asked to stop (a signal): the vote summed over the world


def microbatch_groups(n: int, pairs: bool, finish: bool) -> list[list[int]]:
    """The microbatches ``0..n-1`` in the groups that run forward and backward together:
    alone, or with ``pairs`` two at a time (interleaved at the EP transport), except the
    last one where ``finish`` (it runs alone, with the gradient sync overlapping its
    backward) and one left over from an odd count."""
    paired = (n - 1 if finish else n) // 2 * 2 if pairs else 0
    return [[i, i + 1] for i in range(0, paired, 2)] + [[i] for i in range(paired, n)]


def graph_unit(cfg: PretrainConfig) -> int:
    """Microbatches per CUDA-graph unit: ``merge_expert_grad_microbatches`` (resolved), twice
    that where pairs are interleaved and it is odd, so that a unit holds whole pairs."""
    merge = int(cfg.parallel.merge_expert_grad_microbatches)
    return merge * 2 if cfg.parallel.ep_overlap_microbatches and merge % 2 else merge


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
        cfg = resolve_merge(cfg, mesh.layout.world_size, device)  # (auto: a count, here)
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.timer = phase_timer
        # process-wide settings (the packages' reference-kernel switches, torch's SM carveout),
        # before anything runs a kernel (the MXFP8 weight caches); restored by close(), or here
        # when the build fails, so that a failed trainer leaves the process as it found it
        self._process_settings = reference_kernels(cfg.train.reference_kernels)
        self._process_settings.enter_context(sm_carveout(cfg.parallel.sm_carveout))
        try:
            self._build(cfg, mesh, device)
        except BaseException:
            self._process_settings.close()
            raise

    def _build(self, cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device) -> None:
        """Data, model part, DDP, optimizer, wiring, evaluation and (``train.cuda_graphs``)
        graphs of this rank."""
        self.dtype = resolve_dtype(cfg.train.compute_dtype, device)
        t, m = cfg.train, cfg.model
        data_seed = cfg.seed if cfg.data.seed is None else cfg.data.seed
        source = open_data(cfg.data, t.seq_len, m.vocab_size, data_seed)
        self.document_eos = document_eos_id(cfg.data)  # None: attention across documents
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
        self.optimizer = build_optimizer(self.ddp, cfg.optim, m.n_experts,
                                         mesh.expert_range(m.n_experts).start, device)
        if self.part.mxfp8_layers:
            # replayed graphs read the caches where they were captured: refresh in place
            model, in_place = self.model, t.cuda_graphs  # (not self: the optimizer would hold the trainer)
            self.optimizer.register_weights_updated_hook(
                lambda: refresh_weight_caches(model, in_place=in_place))
            refresh_weight_caches(self.model)
        self.tokens_per_step = t.global_batch * t.seq_len  # = target tokens of the global batch
        self.loss_scale = 1.0 / self.tokens_per_step
        self.wiring = ModelWiring(
            aux_loss_scale=self.loss_scale,
            gradient_sink=self.ddp if cfg.parallel.fuse_grad_accumulation else None,
            # global-batch load balancing counts over every DP rank's tokens
            count_reducer=self._sum_over_dp if mesh.layout.dp > 1 else None,
            dispatchers=self.part.dispatchers,
        )
        wire_model(self.model, self.wiring)
        self.schedule = build_schedule(cfg.optim, t.steps)
        self.packer = StepPacker(self.part.moe_layers, m.n_moe_layers, m.n_experts, device)
        self.flops_per_token = flops_per_token(m, t.seq_len)
        # set by enable_graphs; no bound method of the trainer is kept on it otherwise (a
        # reference cycle would keep a closed trainer's GPU memory until a gc pass)
        self._graphs: GraphedForwardBackward | None = None
        self.skips = SkipGuard(t.max_consecutive_skips)  # continued by a resume
        self.eval_every = eval_every(cfg)  # 0: no held-out evaluation
        self.evaluator = (Evaluator(cfg, mesh, device, self.part, self.document_eos)
                          if self.eval_every else None)
        self.samples = self._prompt_samples(cfg, mesh)
        if t.cuda_graphs:
            if device.type != "cuda":
                raise ConfigError(f"train.cuda_graphs needs a CUDA device, this run uses {device}")
            self.enable_graphs()

    def _prompt_samples(self, cfg: PretrainConfig, mesh: ParallelMesh) -> PromptSamples | None:
        """``eval.prompts`` completed at each evaluation (the config checked that there are
        evaluations and a whole model per rank); only the logging rank writes them."""
        e = cfg.eval
        if not e.prompts:
            return None
        path = Path(cfg.run_dir) / SAMPLES_FILE if mesh.is_logging_rank and cfg.run_dir else None
        return PromptSamples(e.prompts, e.max_new_tokens, data_tokenizer(cfg.data), path)

    def enable_graphs(self, new_graphs: Callable[[], UnitGraphs] | None = None) -> None:
        """Replay the step's forward and backward from CUDA graphs once ``capture_graphs``
        ran (``train.cuda_graphs``). ``new_graphs``: empty units (default: this run's
        ``MicrobatchGraphs``; a CPU test passes a stand-in)."""
        if new_graphs is None:
            new_graphs = lambda: MicrobatchGraphs(  # noqa: E731
                self.model, self.data.n_microbatches, graph_unit(self.cfg),
                self.packer.n_slots * self.packer.width, self.device)
        transport = self.part.transport
        self._graphs = GraphedForwardBackward(
            self.eager_forward_backward, self.unit_work, self.host_batches, new_graphs,
            (self.cfg.train.micro_batch, self.cfg.train.seq_len + 1), after_capture=self.ddp.zero_grad,
            mark=self._mark, unit_scope=nullcontext if transport is None else transport.replayable)

    @property
    def graphs(self) -> GraphedForwardBackward | None:
        """The graphed forward and backward, if this trainer replays CUDA graphs."""
        return self._graphs

    def forward_backward(self, step: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's forward and backward over this rank's microbatches, gradients synced:
        replayed from CUDA graphs once captured (``enable_graphs``), else eagerly."""
        if self._graphs is not None:
            return self._graphs(step)
        return self.eager_forward_backward(step)

    def capture_graphs(self) -> None:
        """Capture the step's forward and backward (after at least one step; a no-op
        without graphs or once captured). ``fit`` calls it after a step that does not end
        the run; a caller stepping on its own (a benchmark) calls it after its warm-up."""
        if self.graphs is not None:
            self.graphs.capture()

    def reset_graphs(self) -> None:
        """Drop the captured graphs: the next step runs eagerly and ``fit`` captures again.

        A step does this itself when the model's hooks, parameter or buffer tensors or
        train/eval flag changed since the capture (``pretrain.graphs.launch_fingerprint``);
        call it after changing anything else a forward reads (a Python attribute). No-op
        without graphs.
        """
        if self.graphs is not None:
            self.graphs.reset()

    def close(self) -> None:
        """Release the EP transport (collective), detach the gradient hooks and restore the
        packages' reference-kernel switches (``train.reference_kernels``) and torch's SM
        carveout (``parallel.sm_carveout``)."""
        self.part.close()
        self.wiring = ModelWiring()  # (the count reducer is a bound method of the trainer)
        wire_model(self.model, self.wiring)
        self.ddp.close()
        self._graphs = None  # (it holds the trainer's bound methods)
        self._process_settings.close()

    # -- the loop ------------------------------------------------------------------

    def fit(self, log: MetricsLog, stop: StopRequest, checkpoints: StepCheckpoints | None = None,
            start_step: int = 1) -> list[dict[str, Any]]:
        """Steps ``start_step..train.steps`` until done or stopped; the records (on every rank).

        The loop alone decides when the run ends (the last step, ``train.stop_after``, an
        agreed stop request, too many skipped steps in a row) and when graphs are captured
        (after a step that does not end the run: nothing would replay them)."""
        t = self.cfg.train
        history = []
        for step in range(start_step, t.steps + 1):
            last = step in (t.steps, t.stop_after)
            evaluate = self.evaluator is not None and (last or step % self.eval_every == 0)
            result = self.train_step(step, stop.requested, evaluate)
            record = result.record
            reason = stop.describe() if result.stop else \
                "train.stop_after" if step == t.stop_after else None
            if reason is not None and self.evaluator is not None and not evaluate:
                record.update(self._val_record(self.evaluate().cpu()))  # a stop ends the run
            if self.samples is not None and "val_loss" in record:
                for sample in self.samples(self.model, step):  # (every rank generates)
                    if self.mesh.is_logging_rank:
                        log.note(f"sample (step {step}): {sample['prompt']!r} -> "
                                 f"{sample['completion']!r}")
            log.write(record)
            history.append(record)
            self.skips.observe(record)  # raises TrainingAborted at the limit
            if checkpoints is not None and checkpoints.due(step, reason is not None) \
                    and self.skips.checkpointable(record):
                checkpoints.save(step)
            if reason is not None:
                if self.mesh.is_logging_rank:
                    skipped = " (a skipped step: not checkpointed)" if record["skipped"] else ""
                    log.note(f"stopping after step {step}: {reason}{skipped}")
                break
            if step < t.steps:
                self.capture_graphs()
        return history

    def train_step(self, step: int, stop_requested: bool = False,
                   evaluate: bool = False) -> StepResult:
        """One optimizer step: its metrics record, and whether every rank agreed to stop
        (``stop_requested`` is this rank's vote); ``evaluate``: the record also holds the
        held-out loss of the updated weights (needs ``data.val_path``). Device work only,
        but for the one copy to the host at the end."""
        start = time.perf_counter()
        lr_factor = self.schedule(step)

        # forward and backward over this rank's microbatches, ending with the gradient
        # sync (eagerly, as a pipeline schedule, or replayed from CUDA graphs)
        loss, routing_stats = self.forward_backward(step)

        # clip and update the FP32 main weights; a non-finite norm skips it on the device
        self._mark("optimizer")
        update = self.optimizer.update(lr_factor)

        # the compute weights gathered from the main weights (the MXFP8 caches refresh)
        self._mark("weight_rebuild")
        self.optimizer.rebuild_weights()

        # loss, stop vote and routing statistics in one SUM all-reduce over the world; the
        # routers' bias step from the summed load
        self._mark("stats")
        reduced = self.packer.pack(loss, stop_requested, routing_stats)
        dist.all_reduce(reduced)
        self._update_router_bias(reduced, update.skipped)
        self.ddp.zero_grad()

        # the held-out loss of the weights this step made, read with the step's record
        val_loss_sum = None
        if evaluate:
            self._mark("eval")
            val_loss_sum = self.evaluate()
        self._mark(None)

        # the step's one host synchronisation
        return self._read(step, reduced, update, self.cfg.optim.lr * lr_factor, start, val_loss_sum)

    def evaluate(self) -> torch.Tensor:
        """The held-out windows' token-loss sum over the world (``pretrain.evaluate``), left
        on the device: forward only, no gradient, optimizer state or routing statistic
        touched, nothing a captured graph reads changed."""
        if self.evaluator is None:
            raise ConfigError("evaluating needs data.val_path")
        return self.evaluator.loss_sum()

    # -- forward and backward (device work only) ------------------------------------

    def _mark(self, phase: str | None) -> None:
        if self.timer is not None:
            self.timer.mark(phase)

    def host_batches(self, step: int) -> list[torch.Tensor]:
        """``[micro_batch, seq_len + 1]`` token ids of this rank's microbatches, on the host
        (pinned on CUDA, so the copies to the device do not wait for it)."""
        batches = [self.data.microbatch(step, i) for i in range(self.data.n_microbatches)]
        return [b.pin_memory() for b in batches] if self.device.type == "cuda" else batches

    def eager_forward_backward(self, step: int) -> tuple[torch.Tensor | None, None]:
        """This rank's part of the global loss (``None`` where no last pipeline stage is
        held), gradients synchronised; the routing statistics stay in the layers."""
        batches = [b.to(self.device, non_blocking=True) for b in self.host_batches(step)]
        pipeline = self.part.pipeline
        if pipeline is None:
            return self.microbatches(batches, finish=True), None
        self._mark("pipeline")
        losses = pipeline.step([b[:, :-1] for b in batches], [b[:, 1:] for b in batches],
                               self.loss_scale, grad_sync=_MarkedGradSync(self.ddp, self._mark))
        return (losses.sum() if self.mesh.is_last_stage else None), None

    def microbatches(self, batches: Sequence[torch.Tensor], finish: bool,
                     loss_sum: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward of ``batches`` (device token ids), all under ``no_sync()``
        but the last if ``finish``, which then ends with ``finish_grad_sync()``; their loss
        added to ``loss_sum`` (a new zero if ``None``), which is returned."""
        if loss_sum is None:
            loss_sum = torch.zeros((), device=self.device)
        for group in microbatch_groups(len(batches), self.part.interleave is not None, finish):
            sync = finish and group[-1] == len(batches) - 1
            with nullcontext() if sync else self.ddp.no_sync():
                self._mark("forward")
                losses = self._losses([batches[i] for i in group])
                self._mark("backward")
                torch.autograd.backward(losses)
            for loss in losses:
                loss_sum += loss.detach()
        if finish:
            self._mark("grad_sync")
            self.ddp.finish_grad_sync()
        return loss_sum

    def _losses(self, group: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The scaled loss of each microbatch of ``group``: forwards one at a time, or a pair
        interleaved at the EP transport (``parallel.ep_overlap_microbatches``)."""
        def loss(tokens: torch.Tensor) -> torch.Tensor:
            inputs = tokens[:, :-1]
            documents = None if self.document_eos is None else documents_from_eos(inputs, self.document_eos)
            return lm_loss_sum(self.model(inputs, documents=documents), tokens[:, 1:]) * self.loss_scale

        if len(group) == 1:
            return [loss(group[0])]
        return self.part.interleave.run([functools.partial(loss, tokens) for tokens in group])

    def unit_work(self, tokens: Sequence[torch.Tensor], last: bool, loss_sum: torch.Tensor,
                  stats_sum: torch.Tensor) -> None:
        """One graph unit: its microbatches, their loss and routing statistics added into
        the running sums (``last``: the step's final unit, which syncs the gradients)."""
        self.microbatches(tokens, finish=last, loss_sum=loss_sum)
        stats_sum.add_(self.packer.stats())

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

    def _read(self, step: int, reduced: torch.Tensor, update: StepStats, lr: float,
              start: float, val_loss_sum: torch.Tensor | None) -> StepResult:
        tail = [update.grad_norm.reshape(1).double(), update.skipped.reshape(1).double()]
        if self.device.type == "cuda":
            tail.append(self._peak_memory_bytes())
        if val_loss_sum is not None:
            tail.append(val_loss_sum.reshape(1).double())
        host = torch.cat([reduced, *tail]).cpu()
        elapsed = time.perf_counter() - start
        n = reduced.numel()
        values = self.packer.unpack(host[:n])
        record: dict[str, Any] = {
            "step": step, "loss": values.loss, "lr": lr, "grad_norm": host[n].item(),
            "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
            "skipped": bool(host[n + 1].item()),
        }
        if values.moe is not None:
            every = self.cfg.metrics.expert_load_every
            record.update(values.moe.record(every > 0 and (step == 1 or step % every == 0)))
        if self.device.type == "cuda":
            n_gpus = self.mesh.layout.world_size
            flops = self.flops_per_token if self.document_eos is None else self._masked_flops(step)
            record["mfu"] = flops * record["tokens_per_s"] / (n_gpus * PEAK_FLOPS)
            record["peak_mem_gib"] = host[n + 2].item() / 2**30
        if val_loss_sum is not None:
            record.update(self._val_record(host[-1]))
        return StepResult(record, values.stop)

    def _val_record(self, loss_sum: torch.Tensor) -> dict[str, float]:
        """``val_loss`` (the mean over the held-out targets) and ``val_ppl`` from the sum
        read to the host."""
        assert self.evaluator is not None
        val_loss = loss_sum.item() / self.evaluator.n_tokens
        return {"val_loss": val_loss, "val_ppl": math.inf if val_loss > 700 else math.exp(val_loss)}

    def _masked_flops(self, step: int) -> float:
        """FLOPs per token of step ``step`` under the document mask: the attention term
        scaled by the share of causal pairs the global batch's documents keep (read on the
        host from the data, no device work)."""
        t = self.cfg.train
        ids = self.data.sequence_ids(step, 0, t.global_batch)
        inputs = torch.from_numpy(self.data.source.read(ids)[:, :-1])
        kept = int(attended_pairs(documents_from_eos(inputs, self.document_eos)))
        causal = t.global_batch * t.seq_len * (t.seq_len + 1) // 2
        return flops_per_token(self.cfg.model, t.seq_len, kept / causal)

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
