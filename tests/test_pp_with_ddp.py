"""DP2 x PP2 on 4 ranks: moe_pp schedules composed with moe_ddp's MultiGroupDDP.

Layout: a (pp, dp) device mesh. Dense parameters replicate over the DP group;
routed-expert parameters get a replica group of their own (EP-DP = DP here, EP-MP
= 1), so MultiGroupDDP keeps them in separate buckets. Each DP replica runs its
own microbatches of the global batch through its pipeline, every backward inside
``no_sync()``, then one ``finish_grad_sync()`` sums the gradients.

Oracle: the unsplit model running every microbatch of the global batch in one
process, token-loss sum and auxiliary losses both divided by the global target
count. After the step each rank's FP32 main gradients equal the oracle's for the
parameters its stages hold (float32, max relative difference < 1e-5), for every
schedule, with and without virtual stages; the zero-bubble schedule proves that
its deferred weight-gradient pass reaches the DDP buckets through the hooks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, lm_loss_sum, wire_model
from moe_pp import SCHEDULES, GradSync, PipelineConfig, build_pipeline
from moe_testing import run_distributed
from torch.distributed.device_mesh import init_device_mesh

CFG = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8,
           n_experts=4, top_k=2, expert_hidden=16, lb_loss_coef=0.1)
PP, DP, MICRO_BATCH, SEQ, N_MICRO, SEED = 2, 2, 2, 8, 2, 3
TOL = 1e-5


def _global_batch() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], int]:
    """Per DP replica: its microbatches' inputs and targets; and the global target count."""
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, CFG["vocab_size"], (DP * N_MICRO * MICRO_BATCH, SEQ + 1), generator=g)
    chunks = tokens.split(MICRO_BATCH)
    inputs = [[c[:, :-1] for c in chunks[d * N_MICRO:(d + 1) * N_MICRO]] for d in range(DP)]
    targets = [[c[:, 1:] for c in chunks[d * N_MICRO:(d + 1) * N_MICRO]] for d in range(DP)]
    return inputs, targets, tokens[:, 1:].numel()


def _model(n_global: int) -> MoETransformer:
    cfg = MoEConfig(**CFG)
    model = MoETransformer(cfg)
    init_weights(model, cfg, SEED)
    wire_model(model, ModelWiring(aux_loss_scale=1.0 / n_global))
    return model


def _oracle() -> tuple[float, dict[str, torch.Tensor]]:
    inputs, targets, n_global = _global_batch()
    model = _model(n_global)
    total = 0.0
    for d in range(DP):
        for x, y in zip(inputs[d], targets[d], strict=True):
            loss = lm_loss_sum(model(x), y) / n_global
            loss.backward()
            total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    err = (a - ref).abs().max().item()
    return err / scale if scale > 0 else err


def _dp_pp_step() -> dict:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    # Experts' replica group (EP-DP) spans the DP ranks but is a group of its own;
    # new_group is collective, so every rank creates every replica's group.
    expert_groups = [dist.new_group(row.tolist()) for row in mesh.mesh]
    expert_group = expert_groups[mesh.get_coordinate()[0]]
    dp_rank = dist.get_rank(dp_group)
    inputs, targets, n_global = _global_batch()
    ref_loss, ref_grads = _oracle()

    def replica_group_of(name: str, _param: torch.nn.Parameter) -> dist.ProcessGroup:
        return expert_group if ".experts." in name else dp_group

    result: dict = {"diffs": {}, "expert_buckets": None, "stage_params": {}, "stray_grads": {}}
    for virtual, schedule in itertools.product((1, 2), SCHEDULES):
        pipe = build_pipeline(
            _model(n_global), PipelineConfig(schedule=schedule, virtual_stages=virtual), N_MICRO,
            loss_fn=lm_loss_sum, activation_shape=(MICRO_BATCH, SEQ, CFG["d_model"]),
            activation_dtype=torch.float32, group=pp_group,
        )
        ddp = MultiGroupDDP(pipe.module, replica_group_of, DDPConfig(reduce_op="sum"))
        assert isinstance(ddp, GradSync)
        losses = pipe.step(inputs[dp_rank], targets[dp_rank], loss_scale=1.0 / n_global,
                           grad_sync=ddp)
        total = losses.sum()
        dist.all_reduce(total, group=dp_group)
        diffs = {"loss": abs(total.item() - ref_loss) / abs(ref_loss)}
        for name, param, main_grad, group in ddp:
            assert group is replica_group_of(name, param)
            assert param.grad is None, f"{name}: the hook must have moved param.grad"
            diffs[name] = _rel(main_grad, ref_grads[name])
        result["diffs"][virtual, schedule] = diffs
        # Completeness: every parameter this rank's stages hold (not just what DDP yields),
        # and none of them kept a gradient outside DDP's buffers.
        stage_params = dict(pipe.module.named_parameters())
        result["stage_params"][virtual, schedule] = set(stage_params)
        result["stray_grads"][virtual, schedule] = sorted(
            n for n, p in stage_params.items() if p.grad is not None)
        result["expert_buckets"] = sum(g is expert_group for g, _ in ddp.grad_buffers())
        dist.barrier()
    return result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_pp2_with_multigroup_ddp_matches_unsplit_model():
    results = run_distributed(_dp_pp_step, PP * DP, timeout=300)
    all_names = {n for n, _ in _model(1).named_parameters()}
    for key in results[0]["diffs"]:
        # Every PP rank's stages together hold the whole model, and DDP compared all of it.
        assert set().union(*(r["stage_params"][key] for r in results)) == all_names, key
        for rank, r in enumerate(results):  # each rank's DDP yields exactly its stages' params
            compared = r["diffs"][key].keys() - {"loss"}
            assert compared == r["stage_params"][key], (key, rank, sorted(r["stage_params"][key] ^ compared))
    for rank, result in enumerate(results):
        assert result["expert_buckets"] >= 1, f"rank {rank}: experts share buckets with dense"
        for key, stray in result["stray_grads"].items():
            assert not stray, f"rank {rank} {key}: gradients left outside DDP's buffers: {stray}"
        for (virtual, schedule), diffs in result["diffs"].items():
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] < TOL, (
                f"rank {rank} virtual={virtual} {schedule}: {worst} differs by {diffs[worst]:.2e}"
            )
