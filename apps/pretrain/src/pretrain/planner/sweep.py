"""Layouts for large models on 16-512 GPUs, chosen by the memory plan.

The model family matches the reference report's named scales (Table 30 of the
Olmo-core report: Tiny 1.59B active @ 12.9B total, 64 experts; Small 4.29B @ 40.9B,
64; Medium 7.38B @ 137B, 128; Large 15.1B @ 296B, 128; Ultra 58.4B @ 1.20T, 128,
MXFP8). The report gives only those counts, so the shapes below are ours: head
dim 128 with four query heads per KV head, top-4 routing (its sweeps' setting),
vocabulary 100,352, and the depth/width/expert width whose parameter counts come
closest to the report's, computed by ``moe_model.active_params``/``total_params``.

For each model and GPU count the search tries EP-MP degrees (1-8 inside one
NVLink node on the rowwise NVSHMEM transport; 16 and 32 across nodes on NCCL
all-to-all), pipeline depths and recompute policies, at a fixed recipe (sequence
4096, a global batch of 1,024 sequences = 4 Mi tokens, micro batch 1, 1F1B,
capacity factor 1.25, BF16), and keeps the layout a user would want first among
those that fit: EP inside a node before EP across nodes (token traffic off
NVLink), then the shallowest pipeline (bubbles), then the least recompute
(throughput), then the smallest EP. The report ran Ultra in MXFP8
on B300s; on Hopper MXFP8 GEMMs are emulated and the weight caches add memory, so
these plans stay in BF16 (``pretrain plan`` with ``mxfp8.targets=...`` plans it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_model import MoEConfig

from pretrain.planner.activations import EPBackend
from pretrain.planner.memory import MemoryPlan, PlanRequest, plan_memory
from pretrain.planner.persistent import ModelShapes
from pretrain.planner.profile import Profile
from pretrain.planner.step_time import StepTime, predict_step

GPU_COUNTS = (16, 32, 64, 128, 256, 512)
EP_CHOICES = (1, 2, 4, 8, 16, 32)  # EP-MP; an NVLink node holds 8 GPUs
NODE_GPUS = 8
PP_CHOICES = (1, 2, 4, 8, 16)
RECOMPUTE_ORDER = ("none", "selective", "block")
SEQ_LEN = 4096
GLOBAL_BATCH = 1024  # sequences: 4 Mi tokens


def _model(d_model: int, n_layers: int, n_experts: int, expert_hidden: int) -> MoEConfig:
    heads = d_model // 128
    return MoEConfig(vocab_size=100352, d_model=d_model, n_layers=n_layers, n_heads=heads,
                     n_kv_heads=heads // 4, head_dim=128, n_experts=n_experts, top_k=4,
                     expert_hidden=expert_hidden, capacity_factor=1.25)


@dataclass(frozen=True)
class FamilyMember:
    name: str
    model: MoEConfig
    report: str  # the report's active @ total for this scale


FAMILY: tuple[FamilyMember, ...] = (
    FamilyMember("tiny", _model(3072, 24, 64, 768), "1.59B @ 12.9B"),
    FamilyMember("small", _model(4096, 32, 64, 1536), "4.29B @ 40.9B"),
    FamilyMember("medium", _model(4096, 56, 128, 1536), "7.38B @ 137B"),
    FamilyMember("large", _model(8192, 32, 128, 2816), "15.1B @ 296B"),
    FamilyMember("ultra", _model(9216, 88, 128, 3840), "58.4B @ 1.20T"),
)


def _ep_backend(ep: int) -> EPBackend:
    """NVSHMEM rowwise inside an NVLink node, NCCL all-to-all across nodes."""
    return "local" if ep == 1 else "rowwise" if ep <= NODE_GPUS else "all_to_all"


def candidates(member: FamilyMember, world: int, gpu_gib: float,
               headroom: float) -> list[PlanRequest]:
    """Every layout of ``member`` on ``world`` GPUs, in order of preference."""
    layouts = []
    for pp in PP_CHOICES:
        for ep in EP_CHOICES:
            dp = world // pp
            if world % pp or member.model.n_layers < pp or dp % ep or member.model.n_experts % ep \
                    or GLOBAL_BATCH % dp:
                continue
            for rank, recompute in enumerate(RECOMPUTE_ORDER):
                layouts.append(((ep > NODE_GPUS, pp, rank, ep), PlanRequest(
                    model=replace(member.model, recompute=recompute), world=world, pp=pp, ep=ep,
                    micro_batch=1, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                    ep_backend=_ep_backend(ep),
                    gpu_gib=gpu_gib, headroom=headroom)))
    return [req for _, req in sorted(layouts, key=lambda item: item[0])]


@dataclass(frozen=True)
class SweepResult:
    member: FamilyMember
    world: int
    chosen: MemoryPlan | None  # the first layout that fits, if any
    smallest: MemoryPlan  # the layout needing the least memory (what to compare when none fits)
    tried: int


def sweep(members: tuple[FamilyMember, ...] = FAMILY, gpu_counts: tuple[int, ...] = GPU_COUNTS,
          gpu_gib: float = 140.0, headroom: float = 0.10) -> list[SweepResult]:
    results = []
    for member in members:
        shapes = ModelShapes(member.model)  # recompute does not change the parameters
        for world in gpu_counts:
            chosen, smallest, tried = None, None, 0
            for req in candidates(member, world, gpu_gib, headroom):
                plan = plan_memory(req, shapes)
                tried += 1
                if smallest is None or plan.worst.device_total < smallest.worst.device_total:
                    smallest = plan
                if plan.fits:
                    chosen = plan
                    break
            if smallest is not None:
                results.append(SweepResult(member, world, chosen, smallest, tried))
    return results


@dataclass(frozen=True)
class TimedLayout:
    plan: MemoryPlan
    time: StepTime
    preference: int  # the layout's place in ``candidates``' order (ties go to the earlier)


@dataclass(frozen=True)
class TimeSweepResult:
    member: FamilyMember
    world: int
    ranked: tuple[TimedLayout, ...]  # layouts that fit, fastest first
    tried: int


def sweep_time(profile: Profile, members: tuple[FamilyMember, ...] = FAMILY,
               gpu_counts: tuple[int, ...] = GPU_COUNTS, gpus_per_node: int = NODE_GPUS,
               gpu_gib: float = 140.0, headroom: float = 0.10) -> list[TimeSweepResult]:
    """Every (pipeline depth, EP) of ``candidates`` with the least recompute that fits,
    ranked by predicted tokens/s (ties: ``candidates``' order, so the ranking is
    deterministic). More recompute only adds work, so it is tried only where less does
    not fit."""
    results = []
    for member in members:
        shapes = ModelShapes(member.model)
        for world in gpu_counts:
            timed, tried, done = [], 0, set()
            for index, req in enumerate(candidates(member, world, gpu_gib, headroom)):
                if (req.pp, req.ep) in done:
                    continue
                plan = plan_memory(req, shapes)
                tried += 1
                if not plan.fits:
                    continue
                done.add((req.pp, req.ep))
                timed.append(TimedLayout(plan, predict_step(req, profile, gpus_per_node,
                                                            shapes=shapes), index))
            timed.sort(key=lambda t: (-t.time.tokens_per_s, t.preference))
            results.append(TimeSweepResult(member, world, tuple(timed), tried))
    return results
