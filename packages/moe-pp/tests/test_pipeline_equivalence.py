"""Pipelined step == the unsplit model on the same microbatches (loss and every gradient).

Oracle: the same model, not split, running the microbatches one after another
with the token-loss sum divided by the global target count and the auxiliary
losses scaled by the same divisor. Every schedule, PP2 and PP4, with and without
virtual stages; float32, max relative difference per tensor < 1e-5. The MoE
load-balancing loss has a nonzero coefficient, and the test first checks that it
changes the router gradients by far more than the tolerance, so equal router
gradients prove the auxiliary loss flows through the pipeline. ``forward_only`` (an
evaluation) against the unsplit model's loss sum under ``no_grad``.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, lm_loss_sum, wire_model
from moe_pp import (
    SCHEDULES,
    Pipeline,
    PipelineConfig,
    ScheduleError,
    build_pipeline,
    build_rank_stages,
    make_schedule,
    split_model,
)
from moe_testing import run_distributed

CFG = dict(vocab_size=64, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=4, top_k=2, expert_hidden=16, lb_loss_coef=0.1)
MICRO_BATCH, SEQ, N_MICRO, SEED = 2, 8, 4, 3
TOL = 1e-5
VIRTUAL = (1, 2)  # stages per rank


def _batch() -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, CFG["vocab_size"], (N_MICRO * MICRO_BATCH, SEQ + 1), generator=g)
    chunks = tokens.split(MICRO_BATCH)
    inputs = [c[:, :-1] for c in chunks]
    targets = [c[:, 1:] for c in chunks]
    return inputs, targets, sum(t.numel() for t in targets)


def _model(aux_scale: float, recompute: str = "none") -> MoETransformer:
    cfg = MoEConfig(**CFG, recompute=recompute)
    model = MoETransformer(cfg)
    init_weights(model, cfg, SEED)
    wire_model(model, ModelWiring(aux_loss_scale=aux_scale))
    return model


def reference(aux: bool = True) -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets, n_global = _batch()
    model = _model(1.0 / n_global if aux else 0.0)
    total = 0.0
    for x, y in zip(inputs, targets, strict=True):
        loss = lm_loss_sum(model(x), y) / n_global
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    err = (a - ref).abs().max().item()
    return err / scale if scale > 0 else err


class RecordingSync:
    """A GradSync that checks the pipeline calls it as the DDP contract says."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.inside = False
        self.entered = 0
        self.finished = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.inside = True
        self.entered += 1
        yield
        self.inside = False

    def finish_grad_sync(self) -> None:
        assert not self.inside, "finish_grad_sync() called inside no_sync()"
        assert all(p.grad is not None for p in self.module.parameters()), "finish before backward"
        self.finished += 1


def _run_all_schedules() -> dict:
    """Every schedule, without and with virtual stages, on this process group."""
    inputs, targets, n_global = _batch()
    ref_loss, ref_grads = reference()
    report: dict = {"names": {}, "diffs": {}}
    for virtual, schedule in itertools.product(VIRTUAL, SCHEDULES):
        model = _model(1.0 / n_global)
        pipe = build_pipeline(
            model, PipelineConfig(schedule=schedule, virtual_stages=virtual), N_MICRO,
            loss_fn=lm_loss_sum, activation_shape=(MICRO_BATCH, SEQ, CFG["d_model"]),
            activation_dtype=torch.float32,
        )
        sync = RecordingSync(pipe.module)
        losses = pipe.step(inputs, targets, loss_scale=1.0 / n_global, grad_sync=sync)
        assert (sync.entered, sync.finished) == (1, 1), (virtual, schedule)
        diffs = {"loss": abs(losses.sum().item() - ref_loss) / abs(ref_loss)}
        for name, p in pipe.module.named_parameters():
            assert p.grad is not None, f"virtual={virtual} {schedule}: {name} got no gradient"
            diffs[name] = rel_diff(p.grad, ref_grads[name])
        report["diffs"][virtual, schedule] = diffs
        report["names"][virtual] = [n for n, _ in pipe.module.named_parameters()]
        dist.barrier()
    return report


@pytest.mark.slow
def test_aux_loss_moves_router_gradients():
    """Precondition of the equivalence test: dropping the aux loss would be caught."""
    _, with_aux = reference(aux=True)
    _, without = reference(aux=False)
    routers = [n for n in with_aux if "router" in n]
    assert routers
    assert min(rel_diff(without[n], with_aux[n]) for n in routers) > 1e-3


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_unsplit_model(pp: int):
    """One process group per pp (process start-up dominates on CPU), all cases inside."""
    reports = run_distributed(_run_all_schedules, pp, timeout=300)
    _, ref_grads = reference()
    for virtual in VIRTUAL:
        owned = [n for r in reports for n in r["names"][virtual]]
        assert sorted(owned) == sorted(ref_grads), (
            f"pp={pp} virtual={virtual}: ranks must own every parameter exactly once"
        )
    for rank, report in enumerate(reports):
        for (virtual, schedule), diffs in report["diffs"].items():
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] < TOL, (
                f"pp={pp} virtual={virtual} {schedule} rank {rank}: {worst} differs by "
                f"{diffs[worst]:.2e}"
            )


RECOMPUTE = ("block", "selective")


def _run_with_recompute() -> dict:
    """1F1B (one backward pass per microbatch, as GPipe) with activation recompute on."""
    inputs, targets, n_global = _batch()
    ref_loss, ref_grads = reference()
    diffs = {}
    for recompute in RECOMPUTE:
        pipe = build_pipeline(
            _model(1.0 / n_global, recompute), PipelineConfig(schedule="1f1b"), N_MICRO,
            loss_fn=lm_loss_sum, activation_shape=(MICRO_BATCH, SEQ, CFG["d_model"]),
            activation_dtype=torch.float32,
        )
        losses = pipe.step(inputs, targets, loss_scale=1.0 / n_global)
        diffs[recompute] = max(
            [abs(losses.sum().item() - ref_loss) / abs(ref_loss)]
            + [rel_diff(p.grad, ref_grads[n]) for n, p in pipe.module.named_parameters()]
        )
        dist.barrier()
    return diffs


@pytest.mark.slow
@pytest.mark.multiprocess
def test_activation_recompute_under_1f1b_matches_unsplit_model():
    for rank, diffs in enumerate(run_distributed(_run_with_recompute, 2, timeout=300)):
        assert max(diffs.values()) < TOL, (rank, diffs)


@pytest.mark.parametrize("recompute", RECOMPUTE)
def test_zero_bubble_refuses_activation_recompute(recompute):
    """Its input and weight passes would replay each recomputed block twice, which neither
    moe_model's recompute nor torch's selective checkpointing allows (the first step
    failed). Refused when the pipeline is built, before any process group is used."""
    model = _model(1.0, recompute)
    stages = build_rank_stages(model, split_model(model, pp=2), rank=0)
    with pytest.raises(ScheduleError, match=f"zero_bubble schedule cannot run a model with "
                                            f"config.recompute='{recompute}'"):
        Pipeline(stages, make_schedule("zero_bubble", 2, 1, N_MICRO), lm_loss_sum,
                 (MICRO_BATCH, SEQ, CFG["d_model"]), torch.float32)


def _forward_only() -> dict:
    """``forward_only`` of more microbatches than the schedule's, with 1 and 2 stages per
    rank: the unscaled loss sum on the last stage's rank, zero elsewhere, no gradient."""
    inputs, targets, _ = _batch()
    inputs, targets = inputs + inputs[:3], targets + targets[:3]  # 7 microbatches, schedule's 4
    model = _model(1.0)
    with torch.no_grad():
        expected = sum(lm_loss_sum(model(x), y).item() for x, y in zip(inputs, targets, strict=True))
    sums = {}
    for virtual in VIRTUAL:
        pipe = build_pipeline(
            _model(1.0), PipelineConfig(schedule="1f1b", virtual_stages=virtual), N_MICRO,
            loss_fn=lm_loss_sum, activation_shape=(MICRO_BATCH, SEQ, CFG["d_model"]),
            activation_dtype=torch.float32,
        )
        sums[virtual] = pipe.forward_only(inputs, targets).item()
        assert all(p.grad is None for p in pipe.module.parameters())
        dist.barrier()
    return {"expected": expected, "sums": sums}


@pytest.mark.multiprocess
def test_forward_only_sums_the_unsplit_models_loss():
    reports = run_distributed(_forward_only, 2, timeout=300)
    for virtual in VIRTUAL:
        assert reports[0]["sums"][virtual] == 0.0
        assert reports[1]["sums"][virtual] == pytest.approx(reports[1]["expected"], rel=TOL)
