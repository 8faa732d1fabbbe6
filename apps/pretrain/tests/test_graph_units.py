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
from pretrain.trainer import Trainer, graph_unit, microbatch_groups


class _RerunUnits:
    """``UnitGraphs`` as a CPU stand-in: the capture keeps the trainer's unit function, a
    replay runs it again, unit by unit, into the running sums, as the graphs would."""

    stream = None  # the eager warm-up runs on the current stream

    def __init__(self, trainer: Trainer) -> None:
        self.unit = graph_unit(trainer.cfg)
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


def test_microbatches_pair_up_but_the_synchronised_last_and_an_odd_one_out():
    assert microbatch_groups(5, pairs=False, finish=True) == [[0], [1], [2], [3], [4]]
    assert microbatch_groups(5, pairs=True, finish=True) == [[0, 1], [2, 3], [4]]
    assert microbatch_groups(4, pairs=True, finish=True) == [[0, 1], [2], [3]]
    assert microbatch_groups(4, pairs=True, finish=False) == [[0, 1], [2, 3]]
    assert microbatch_groups(3, pairs=True, finish=False) == [[0, 1], [2]]
    assert microbatch_groups(1, pairs=True, finish=True) == [[0]]
    from pretrain.planner.pipeline import paired_microbatches

    for n in range(1, 18):  # what the planner assumes is what the trainer runs
        pairs = [g for g in microbatch_groups(n, pairs=True, finish=True) if len(g) == 2]
        assert 2 * len(pairs) == paired_microbatches(n), n


@pytest.mark.parametrize("merge, unit", [(1, 2), (2, 2), (3, 6), (4, 4)])
def test_a_graph_unit_holds_whole_pairs(merge, unit):
    overrides = ["parallel.ep_backend=all_to_all", f"parallel.merge_expert_grad_microbatches={merge}"]
    assert graph_unit(load_config("tiny", overrides)) == merge
    assert graph_unit(load_config("tiny", [*overrides, "parallel.ep_overlap_microbatches=true"])) == unit


def test_interleaved_pairs_train_in_graph_units_exactly_like_eager_steps(monkeypatch):
    """Five microbatches, pairs interleaved at the transport (an EP group of one rank): eager
    steps run (0, 1), (2, 3), 4; the units (two of one pair each, then the last) run the same
    pairs, so the same bits. Every step runs its two pairs through the interleave."""
    from moe_ep_transport import MicrobatchInterleave

    runs = []
    run = MicrobatchInterleave.run
    monkeypatch.setattr(MicrobatchInterleave, "run", lambda self, forwards: runs.append(len(forwards))
                        or run(self, forwards))
    overrides = [*COMMON, "parallel.ep_backend=rowwise", "parallel.ep_overlap_microbatches=true"]
    with distributed("cpu"):
        eager, eager_weights = _steps(overrides, units=False)
        assert runs == [2] * 8
        replayed, weights = _steps(overrides, units=True)
    assert runs == [2] * 16
    assert replayed == eager
    for name, ref in eager_weights.items():
        assert torch.equal(weights[name], ref), name


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


def _capture_then_fall_back_on_two_ranks() -> tuple:
    """Eager steps, then the same steps captured after the first and, the model changed on
    every rank after the capture, run eagerly again: both ranks leave the graphs together."""
    overrides = ["train.global_batch=12", "parallel.merge_expert_grad_microbatches=2",
                 "parallel.ddp_mode=all_reduce"]
    eager, eager_weights = _steps(overrides, units=False, steps=3)
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu"),
                      torch.device("cpu"))
    try:
        made = _capture_then_change(trainer)
        records = [trainer.train_step(1).record]
        trainer.capture_graphs()
        records += [trainer.train_step(step).record for step in (2, 3)]
        fell_back = len(made) == 2 and made[0].captured and not made[1].captured
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load", "skipped")
    return eager, eager_weights, [tuple(r[k] for k in keys) for r in records], weights, fell_back


@pytest.mark.multiprocess
def test_two_data_parallel_ranks_fall_back_to_eager_steps_together():
    """The capture's Python on two ranks (gradient hooks launching the reductions, the
    wrapper left with every bucket reduced), then eager steps on both: the reductions of
    those steps pair up across the ranks and train like steps that never captured."""
    for eager, eager_weights, records, weights, fell_back in run_distributed(
            _capture_then_fall_back_on_two_ranks, 2, timeout=240):
        assert fell_back
        assert records == eager
        for name, ref in eager_weights.items():
            assert torch.equal(weights[name], ref), name


class _RerunUnitsCountingPhases(_RerunUnits):
    """The rerun stand-in, recording the EP transport's phases per unit as a graph would
    hold them (a replay reruns its capture's slab choices)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer)
        self.transport = trainer.part.transport
        self.unit_phases: list[int] = []

    def capture(self, run_unit, token_shape: tuple[int, int]) -> None:
        def counted(tokens, last: bool) -> None:
            start = self.transport.phase
            run_unit(tokens, last)
            self.unit_phases.append(self.transport.phase - start)

        super().capture(counted, token_shape)


def _ep2_eager_and_units() -> tuple:
    # One MoE layer: five exchanges per microbatch (counts, rows, rows back; two in the
    # backward), so a unit of one microbatch is odd and needs rounding up.
    overrides = ["parallel.ep=2", "parallel.ep_backend=rowwise", "model.n_layers=1",
                 "train.global_batch=12", "parallel.merge_expert_grad_microbatches=2",
                 "model.lb_loss_granularity=global_batch", "model.bias_update_rate=0.01"]
    eager, eager_weights = _steps(overrides, units=False)
    cfg = load_config("tiny", overrides)
    trainer = Trainer(cfg, build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu"),
                      torch.device("cpu"))
    try:
        made: list[_RerunUnitsCountingPhases] = []
        trainer.enable_graphs(lambda: made.append(_RerunUnitsCountingPhases(trainer)) or made[-1])
        start = trainer.part.transport.phase
        records = [trainer.train_step(1).record]
        eager_step_phases = trainer.part.transport.phase - start
        trainer.capture_graphs()
        records += [trainer.train_step(step).record for step in range(2, 5)]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    keys = ("loss", "grad_norm", "lb_loss", "z_loss", "expert_load", "skipped")
    return (eager, eager_weights, [tuple(r[k] for k in keys) for r in records], weights,
            eager_step_phases, made[0].unit_phases)


@pytest.mark.multiprocess
def test_ep2_graph_units_keep_the_transport_buffers_alternating():
    """EP2 on the rowwise transport (emulated peer memory): the units train like eager steps,
    and every unit holds whole rounds of the transport's two buffers although an eager step
    of three microbatches runs an odd number of exchanges."""
    for eager, eager_weights, records, weights, step_phases, unit_phases in run_distributed(
            _ep2_eager_and_units, 2, timeout=240):
        assert records == eager
        for name, ref in eager_weights.items():
            assert torch.equal(weights[name], ref), name
        assert step_phases % 2 == 1
        assert len(unit_phases) == 3 * 2 and all(n % 2 == 0 for n in unit_phases), unit_phases
