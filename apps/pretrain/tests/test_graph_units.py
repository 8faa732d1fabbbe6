"""The trainer's CUDA-graph units, checked on CPU against eager steps.

Replaying a captured unit runs the work its Python launched when it was captured, so
everything but the capture itself can be checked without a GPU by running that Python
again in its place: the split into middle and last units, the ``no_sync`` windows, the
last unit's gradient sync, the loss and routing statistics added into running sums per
unit, the step's end (``pack(stats=...)``, the sums zeroed by each replay). One rank and two
(gloo). The capture and replay on a GPU: ``test_gpu.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed
from pretrain.config import load_config, validate_layout
from pretrain.graphs import split_into_units
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog
from pretrain.runtime import distributed
from pretrain.trainer import Trainer


class _RerunUnits:
    """``UnitGraphs`` as a CPU stand-in: the capture keeps the trainer's unit function, a
    replay runs it again, unit by unit, into the running sums, as the graphs would."""

    stream = None  # the eager warm-up runs on the current stream

    def __init__(self, trainer: Trainer) -> None:
        self.unit = trainer.cfg.parallel.merge_expert_grad_microbatches
        self.n_middle, self.last_size = split_into_units(trainer.data.n_microbatches, self.unit)
        self.loss_sum = torch.zeros(())
        self.stats_sum = torch.zeros(trainer.packer.n_slots * trainer.packer.width, dtype=torch.float64)
        self.run_unit = None

    @property
    def captured(self) -> bool:
        return self.run_unit is not None

    def match_model(self) -> bool:
        return True

    def capture(self, run_unit, token_shape: tuple[int, int]) -> None:
        self.run_unit = run_unit

    def replay(self, batches: Sequence[torch.Tensor]) -> None:
        self.loss_sum.zero_()
        self.stats_sum.zero_()
        u = self.unit
        for index in range(self.n_middle):
            self.run_unit(batches[index * u:(index + 1) * u], False)
        self.run_unit(batches[self.n_middle * u:], True)


class _CaptureThenChange(_RerunUnits):
    """A capture, as the host sees it: the units' Python runs once (on the GPU no kernel
    would; here they run and their gradients are discarded with the ones the capture
    marks as reduced); then the model no longer matches it."""

    def capture(self, run_unit, token_shape: tuple[int, int]) -> None:
        super().capture(run_unit, token_shape)
        self.replay([torch.zeros(token_shape, dtype=torch.int64)] * (self.n_middle * self.unit
                                                                    + self.last_size))

    def match_model(self) -> bool:
        return False


def _capture_then_change(trainer: Trainer) -> list[_CaptureThenChange]:
    """Graphs that capture after the first step and then no longer match the model; the
    list of every set of graphs made (a fallback makes new ones)."""
    made: list[_CaptureThenChange] = []
    trainer.enable_graphs(lambda: made.append(_CaptureThenChange(trainer)) or made[-1])
    return made


def _steps(overrides: list[str], units: bool, steps: int = 4) -> tuple[list[tuple], dict]:
    """Records and final weights of ``steps`` steps; with ``units``, from step 2 on the
    microbatches run as graph units."""
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu"),
                      torch.device("cpu"))
    try:
        if units:
            trainer.enable_graphs(lambda: _RerunUnits(trainer))
        records = [trainer.train_step(1).record]
        trainer.capture_graphs()
        records += [trainer.train_step(step).record for step in range(2, steps + 1)]
        assert trainer.graphs is None or trainer.graphs.captured
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load", "skipped")
    return [tuple(r[k] for k in keys) for r in records], weights


# five microbatches a step: units of 2 (two middle units, a last one of 1) or of 4 (one
# middle, a last one of 1); global-batch balancing, whose running counts span the units
COMMON = ["train.global_batch=10", "model.lb_loss_granularity=global_batch",
          "model.bias_update_rate=0.01", "model.capacity_factor=1.0"]


@pytest.mark.parametrize("unit", [1, 2, 4])
def test_graph_units_train_exactly_like_eager_steps(unit):
    overrides = [*COMMON, f"parallel.merge_expert_grad_microbatches={unit}"]
    with distributed("cpu"):
        eager, eager_weights = _steps(overrides, units=False)
        replayed, weights = _steps(overrides, units=True)
    assert replayed == eager
    for name, ref in eager_weights.items():
        assert torch.equal(weights[name], ref), name
    assert eager[-1][0] < eager[0][0]


def test_a_step_after_the_capture_that_runs_eagerly_trains_like_an_eager_step():
    """The model changed after the capture (a hook, ``reset_graphs()``): the next step runs
    eagerly, on a data-parallel wrapper the capture's Python had left with every bucket
    reduced ('received a gradient after its bucket was reduced' before the fix)."""
    overrides = ["train.global_batch=6", "parallel.merge_expert_grad_microbatches=2"]
    with distributed("cpu"):
        eager, eager_weights = _steps(overrides, units=False, steps=2)
        cfg = load_config("tiny", overrides)
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
        try:
            made = _capture_then_change(trainer)
            records = [trainer.train_step(1).record]
            trainer.capture_graphs()
            assert len(made) == 1 and made[0].captured
            records.append(trainer.train_step(2).record)
            assert len(made) == 2 and not made[1].captured  # the fallback ran
            weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        finally:
            trainer.close()
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load", "skipped")
    assert [tuple(r[k] for k in keys) for r in records] == eager
    for name, ref in eager_weights.items():
        assert torch.equal(weights[name], ref), name


class _StopAt:
    """``StopRequest`` as ``Trainer.fit`` reads it: requested from step ``at`` on."""

    def __init__(self, at: int | None) -> None:
        self.at, self.steps = at, 0

    @property
    def requested(self) -> bool:
        self.steps += 1
        return self.at is not None and self.steps >= self.at

    def describe(self) -> str:
        return "a test's stop"


@pytest.mark.parametrize("ends", ["stop_requested", "stop_after", "last_step", None])
def test_no_capture_after_a_step_that_ends_the_run(ends):
    """Capturing costs a step's worth of Python; after the run's final step (a stop, a
    ``train.stop_after`` or the last step) nothing would replay the graphs. ``None``: the
    control, a run of three steps, captures after its first."""
    overrides = ["train.global_batch=4", f"train.steps={1 if ends == 'last_step' else 3}"]
    if ends == "stop_after":
        overrides.append("train.stop_after=1")
    with distributed("cpu"):
        cfg = load_config("tiny", [*overrides, "optim.schedule=constant"])
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
        try:
            made = _capture_then_change(trainer)
            records = trainer.fit(MetricsLog([]),
                                  _StopAt(1 if ends == "stop_requested" else None))
            assert len(records) == (3 if ends is None else 1)
            assert made[0].captured == (ends is None)
        finally:
            trainer.close()


def _both_ways_on_two_ranks() -> tuple:
    overrides = ["train.global_batch=12", "model.lb_loss_granularity=global_batch",
                 "parallel.merge_expert_grad_microbatches=2"]
    return _steps(overrides, units=False), _steps(overrides, units=True)


@pytest.mark.multiprocess
def test_graph_units_on_two_data_parallel_ranks_train_like_eager_steps():
    """Three microbatches per rank (a middle unit of 2, a last unit of 1 holding the
    gradient reductions), the balancing counts reduced over both ranks in every forward."""
    for (eager, eager_weights), (replayed, weights) in run_distributed(_both_ways_on_two_ranks, 2,
                                                                       timeout=240):
        assert replayed == eager
        for name, ref in eager_weights.items():
            assert torch.equal(weights[name], ref), name
