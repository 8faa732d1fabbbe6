"""Running one optimizer step's microbatches through the pipeline.

``Pipeline.step`` executes this rank's action list of the schedule:

- ``F``: run the stage module on the microbatch (token ids on the first stage,
  the received activation elsewhere); the last stage applies ``loss_fn`` times
  ``loss_scale`` and keeps the loss; other stages send their output on.
- ``B``: full backward (or, when the schedule splits it, the input-gradient pass
  of ``moe_pp.backward``) from the received output gradient, or from the loss on
  the last stage; the input gradient goes to the previous stage.
- ``W``: the deferred weight-gradient pass.

``Pipeline.forward_only`` runs microbatches forward only, without gradients (an
evaluation), outside the schedule.

All of it runs inside ``grad_sync.no_sync()``; ``grad_sync.finish_grad_sync()``
follows once, so the data-parallel reduction sees every microbatch of every
local stage. Parameter gradients accumulate through autograd in every schedule
(post-accumulate-grad hooks fire), and the losses of all microbatches are
broadcast from the last stage, so every rank can log them.

Loss convention: the caller's ``loss_fn`` returns a microbatch's token-loss
*sum*; ``loss_scale`` is ``1 / N_global`` (target tokens in the whole global
batch), the same divisor the model's auxiliary losses are scaled with. The
auxiliary losses live in each MoE layer's autograd graph, so they reach the
routers on every stage without crossing stage boundaries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_pp.backward import WeightGradWork, backward_input, backward_weight
from moe_pp.p2p import ACTIVATION, GRADIENT, OrderedP2P, message_order
from moe_pp.protocols import GradSync, PipelineModel
from moe_pp.schedules import (
    SCHEDULES,
    Schedule,
    ScheduleError,
    ScheduleName,
    make_schedule,
    simulate,
)
from moe_pp.split import POLICIES, SplitPolicy, StageSplit, split_model
from moe_pp.stages import RankStages, Stage, build_rank_stages

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PipelineConfig:
    schedule: ScheduleName = "1f1b"  # 1f1b with virtual_stages > 1: interleaved 1F1B
    virtual_stages: int = 1  # stages (model chunks) per PP rank; stage s runs on rank s % pp
    split: SplitPolicy = "params"  # balanced split policy: params (memory) | flops (compute)
    stage_blocks: list[int] | None = None  # explicit blocks per stage, overrides split

    def validate(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"PipelineConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.virtual_stages < 1:
            raise ValueError(f"PipelineConfig.virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.split not in POLICIES:
            raise ValueError(f"PipelineConfig.split must be one of {POLICIES}, got {self.split!r}")


@dataclass
class _StepState:
    """What one ``Pipeline.step`` carries between actions."""

    p2p: OrderedP2P
    inputs: Sequence[torch.Tensor] | None
    targets: Sequence[torch.Tensor] | None
    loss_scale: float
    losses: torch.Tensor  # [M] scaled microbatch losses (filled on the last stage's rank)
    params: dict[int, list[torch.nn.Parameter]]  # trainable parameters per local stage
    held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    deferred: dict[tuple[int, int], WeightGradWork] = field(default_factory=dict)


class Pipeline:
    """This rank's stages plus the schedule that runs them.

    ``activation_shape``/``activation_dtype``: the tensor passed between stages
    for one microbatch (``[micro_batch, seq_len, d_model]`` in the compute dtype);
    the receivers allocate their buffers from it.
    """

    def __init__(
        self,
        stages: RankStages,
        schedule: Schedule,
        loss_fn: LossFn,
        activation_shape: Sequence[int],
        activation_dtype: torch.dtype,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        _check_recompute(stages, schedule)
        pp = dist.get_world_size(group)
        if schedule.pp != pp or dist.get_rank(group) != stages.rank:
            raise ValueError(
                f"the schedule is for pp={schedule.pp} and the stages for PP rank {stages.rank}, "
                f"but this process is PP rank {dist.get_rank(group)} of {pp}"
            )
        expected = [s for s in range(schedule.n_stages) if schedule.rank_of(s) == stages.rank]
        if [s.index for s in stages.stages] != expected:
            raise ValueError(
                f"PP rank {stages.rank} holds stages {[s.index for s in stages.stages]}; "
                f"the schedule runs {expected} there"
            )
        self.stages = stages
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.activation_shape = tuple(activation_shape)
        self.activation_dtype = activation_dtype
        self.group = group
        self.timeline = simulate(schedule)
        self._messages = message_order(self.timeline)
        self._by_index = {s.index: s for s in stages.stages}

    @property
    def module(self) -> torch.nn.Module:
        """All of this rank's parameters under their model names (for DDP, optimizer, checkpoints)."""
        return self.stages.module

    def step(
        self,
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[torch.Tensor] | None,
        loss_scale: float = 1.0,
        grad_sync: GradSync | None = None,
    ) -> torch.Tensor:
        """Forward and backward of all microbatches; returns their scaled losses ``[M]`` on every rank.

        ``inputs``/``targets``: one tensor per microbatch; needed on the rank of the
        first / last stage (others may pass them or ``None``). Gradients accumulate
        into ``param.grad`` (or wherever ``grad_sync``'s hooks move them).
        """
        M = self.schedule.n_microbatches
        first = self._by_index.get(0)
        last = self._by_index.get(self.schedule.n_stages - 1)
        for name, given, needed in (("inputs", inputs, first), ("targets", targets, last)):
            if needed is not None and (given is None or len(given) != M):
                got = "None" if given is None else f"{len(given)} tensors"
                raise ValueError(f"PP rank {self.stages.rank} runs stage {needed.index} and needs "
                                 f"{name} for {M} microbatches, got {got}")
        device = next(self.stages.module.parameters()).device
        step = _StepState(
            p2p=OrderedP2P(self._messages, self.stages.rank, self.group, self.activation_shape,
                           self.activation_dtype, device),
            inputs=inputs,
            targets=targets,
            loss_scale=loss_scale,
            losses=torch.zeros(M, dtype=torch.float32, device=device),
            params={s.index: [p for p in s.module.parameters() if p.requires_grad]
                    for s in self.stages.stages},
        )
        with grad_sync.no_sync() if grad_sync is not None else nullcontext():
            for action in self.schedule.orders[self.stages.rank]:
                stage = self._by_index[action.stage]
                if action.kind == "F":
                    self._forward(step, stage, action.microbatch)
                elif action.kind == "B":
                    self._backward(step, stage, action.microbatch)
                else:
                    backward_weight(step.deferred.pop((stage.index, action.microbatch)))
            step.p2p.finish()
        if grad_sync is not None:
            grad_sync.finish_grad_sync()
        last_rank = self.schedule.rank_of(self.schedule.n_stages - 1)
        src = dist.get_global_rank(self.group, last_rank) if self.group is not None else last_rank
        dist.broadcast(step.losses, src=src, group=self.group)
        return step.losses

    @torch.no_grad()
    def forward_only(
        self,
        inputs: Sequence[torch.Tensor],
        targets: Sequence[torch.Tensor],
        loss_fn: LossFn | None = None,
    ) -> torch.Tensor:
        """Forward of every microbatch without gradients (an evaluation): the sum of
        ``loss_fn`` (default: the pipeline's) over them, unscaled, in FP32 on the rank of
        the last stage and zero elsewhere.

        ``inputs``/``targets``: one tensor per microbatch, any number of microbatches of
        ``activation_shape``, the same count on every rank (only the first / last stage
        reads them). No schedule: each microbatch goes through the stages in order, with
        point-to-point transfers between ranks; every rank walks the same (microbatch,
        stage) order, so each receive meets its send. No parameter, gradient or schedule
        state is touched.
        """
        loss_fn = loss_fn or self.loss_fn
        if len(inputs) != len(targets):
            raise ValueError(f"forward_only needs one target per input, got {len(inputs)} "
                             f"inputs and {len(targets)} targets")
        n_stages = self.schedule.n_stages
        device = next(self.stages.module.parameters()).device
        total = torch.zeros((), dtype=torch.float32, device=device)

        def peer(stage_index: int) -> int:
            rank = self.schedule.rank_of(stage_index)
            return dist.get_global_rank(self.group, rank) if self.group is not None else rank

        for mb in range(len(inputs)):
            x = inputs[mb]
            for s in range(n_stages):
                stage = self._by_index.get(s)
                if stage is None:
                    continue
                if not stage.is_first and self.schedule.rank_of(s - 1) != self.stages.rank:
                    x = torch.empty(self.activation_shape, dtype=self.activation_dtype, device=device)
                    dist.recv(x, src=peer(s - 1), group=self.group)
                x = stage.module(x)
                if stage.is_last:
                    total += loss_fn(x, targets[mb]).float()
                elif self.schedule.rank_of(s + 1) != self.stages.rank:
                    dist.send(x.contiguous(), dst=peer(s + 1), group=self.group)
        return total

    def _forward(self, step: _StepState, stage: Stage, mb: int) -> None:
        s = stage.index
        if stage.is_first:
            x = step.inputs[mb]  # type: ignore[index]
        else:
            x = step.p2p.recv((ACTIVATION, s - 1, mb)).requires_grad_()
        y = stage.module(x)
        if stage.is_last:
            y = self.loss_fn(y, step.targets[mb]) * step.loss_scale  # type: ignore[index]
            if y.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(y.shape)}")
            step.losses[mb] = y.detach()
        else:
            step.p2p.send((ACTIVATION, s, mb), y)
        step.held[s, mb] = (x, y)

    def _backward(self, step: _StepState, stage: Stage, mb: int) -> None:
        """Full backward, or the input-gradient pass when the schedule splits it."""
        s = stage.index
        x, y = step.held.pop((s, mb))
        dy = None if stage.is_last else step.p2p.recv((GRADIENT, s + 1, mb))
        grad_input = None if stage.is_first else x  # token ids have no gradient
        if self.schedule.split_backward:
            dx, step.deferred[s, mb] = backward_input([y], [dy], grad_input, step.params[s])
        else:
            torch.autograd.backward([y], [dy])
            dx = None if grad_input is None else grad_input.grad
        if grad_input is not None:
            step.p2p.send((GRADIENT, s, mb), torch.zeros_like(x) if dx is None else dx)


def _check_recompute(stages: RankStages, schedule: Schedule) -> None:
    """Refuse activation recompute under a split backward (zero bubble).

    The input and weight passes are two autograd runs, and torch's non-reentrant
    checkpoint replays a recomputed block's forward in each: moe_model's recompute
    context cannot be entered twice, and torch refuses a second backward through
    selective checkpointing. The model says it recomputes through ``config.recompute``.
    """
    recompute = getattr(getattr(stages.module, "config", None), "recompute", "none")
    if schedule.split_backward and recompute != "none":
        raise ScheduleError(
            f"the {schedule.name} schedule cannot run a model with config.recompute="
            f"{recompute!r}: its split backward replays each recomputed block twice (input "
            "and weight passes), which activation recompute does not support; use "
            "recompute='none' or the gpipe / 1f1b schedule"
        )


def build_pipeline(
    model: PipelineModel,
    config: PipelineConfig,
    n_microbatches: int,
    loss_fn: LossFn,
    activation_shape: Sequence[int],
    activation_dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    seq_len: int | None = None,
) -> Pipeline:
    """Split ``model`` per ``config``, keep this rank's stages, and build the schedule.

    ``seq_len`` is needed by the ``flops`` split policy. The model may be on the
    meta device; materialise ``pipeline.module`` before the first step.
    """
    config.validate()
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    blocks = config.stage_blocks if config.stage_blocks is not None else config.split
    split: StageSplit = split_model(model, pp, config.virtual_stages, blocks, seq_len)
    stages = build_rank_stages(model, split, rank)
    schedule = make_schedule(config.schedule, pp, config.virtual_stages, n_microbatches)
    return Pipeline(stages, schedule, loss_fn, activation_shape, activation_dtype, group)
