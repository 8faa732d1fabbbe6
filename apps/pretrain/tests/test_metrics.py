"""Metrics: MoE statistics as record fields, trackers, the progress line, plots."""

from __future__ import annotations

import json

import pytest
import torch
from pretrain.metrics import JsonlTracker
from pretrain.moe_stats import StepPacker
from pretrain.plot import PlotError, plot_run


class _Layer:
    def __init__(self, stats: dict[str, torch.Tensor]) -> None:
        self.stats = stats

        self.steps_ended = 0

    def take_step_stats(self) -> dict[str, torch.Tensor]:
        stats, self.stats = self.stats, {}
        return stats

    def end_step(self) -> None:
        self.steps_ended += 1


def _layer(counts, n_tokens, lb, z, dropped) -> _Layer:
    return _Layer({"tokens_per_expert": torch.tensor(counts), "n_tokens": torch.tensor(n_tokens),
                   "lb_loss_sum": torch.tensor(float(lb)), "z_loss_sum": torch.tensor(float(z)),
                   "dropped_per_expert": torch.tensor(dropped)})


def test_step_packing_sums_stages_and_ranks_into_model_wide_slots():
    """Two pipeline stages (one MoE layer each), the last holding the loss, one with a stop.

    Summing their packed tensors is what the world all-reduce does.
    """
    first = StepPacker({0: _layer([4, 4, 4, 4], 8, 8.0, 2.0, [0, 0, 0, 0])}, 2, 4, torch.device("cpu"))
    last = StepPacker({1: _layer([10, 2, 2, 2], 8, 12.0, 6.0, [2, 0, 0, 0])}, 2, 4, torch.device("cpu"))
    reduced = first.pack(None, stop=True) + last.pack(torch.tensor(2.5), stop=False)
    assert last.counts(reduced).tolist() == [[4, 4, 4, 4], [10, 2, 2, 2]]
    values = last.unpack(reduced)
    assert values.loss == 2.5 and values.stop
    record = values.moe.record(with_load=True)
    assert record["lb_loss"] == pytest.approx((1.0 + 1.5) / 2)
    assert record["z_loss"] == pytest.approx((0.25 + 0.75) / 2)
    assert record["expert_load_imbalance"] == pytest.approx(10 / 4)
    assert record["dropped_token_rate"] == pytest.approx(2 / 32)
    assert record["expert_load"] == [[4, 4, 4, 4], [10, 2, 2, 2]]
    assert "expert_load" not in values.moe.record(with_load=False)
    with pytest.raises(RuntimeError, match="MoE layer 0 recorded no routing statistics"):
        first.pack(None, stop=False)  # popped: nothing left this step
    assert StepPacker({}, 0, 4, torch.device("cpu")).unpack(torch.zeros(2)).moe is None


def test_statistics_taken_in_groups_pack_like_the_whole_step_and_end_it_once():
    """What the CUDA-graph units do: take the statistics per group of microbatches (the
    step goes on), sum them, hand the sum to ``pack`` (which ends the step once)."""
    cpu = torch.device("cpu")
    first, second = ([3, 1, 0, 4], 4, 2.0, 1.0, [0, 1, 0, 0]), ([1, 1, 2, 4], 4, 3.0, 0.5, [1, 0, 0, 0])
    layer = _layer(*first)
    grouped = StepPacker({0: layer}, 1, 4, cpu)
    total = grouped.stats()
    layer.stats = _layer(*second).stats
    total += grouped.stats()
    assert layer.steps_ended == 0
    packed = grouped.pack(torch.tensor(1.5), stop=False, stats=total)
    assert layer.steps_ended == 1 and layer.stats == {}
    whole = _layer([4, 2, 2, 8], 8, 5.0, 1.5, [1, 1, 0, 0])
    assert torch.equal(packed, StepPacker({0: whole}, 1, 4, cpu).pack(torch.tensor(1.5), stop=False))
    assert whole.steps_ended == 1


def test_jsonl_keeps_the_records_up_to_the_resumed_step(tmp_path):
    tracker = JsonlTracker(tmp_path)
    for step in (1, 2, 3):
        tracker.log({"step": step})
    tracker.close()
    tracker = JsonlTracker(tmp_path, keep_through=2)  # resumed after step 2: step 3 is redone
    tracker.log({"step": 3, "loss": 1.0})
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1}, {"step": 2}, {"step": 3, "loss": 1.0}]


def test_jsonl_writes_one_object_per_step_and_null_for_non_finite(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "skipped": True})
    tracker.log({"step": 2, "loss": 1.5})
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": None, "grad_norm": None, "skipped": True},
                     {"step": 2, "loss": 1.5}]


@pytest.mark.slow
def test_plot_writes_pngs(tmp_path):
    with pytest.raises(PlotError, match="does not exist"):
        plot_run(tmp_path)
    tracker = JsonlTracker(tmp_path)
    for step in range(1, 31):
        record = {"step": step, "loss": 5.0 / step, "lr": 1e-3, "grad_norm": 1.0,
                  "tokens_per_s": 1000.0 + step, "skipped": step == 7, "mfu": 0.3}
        if step % 5 == 0:
            record["expert_load"] = [[step, 10, 0, 30], [5, 5, 5, 5], [1, 2, 3, 4]]
        tracker.log(record)
    tracker.close()
    written = plot_run(tmp_path)
    assert [p.name for p in written] == ["loss.png", "throughput.png", "expert_load.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
