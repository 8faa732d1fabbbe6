"""The memory plan of a run: per pipeline rank, every category, the peak, and whether it fits.

    peak allocated = persistent state
                   + max(activation high-water mark of the schedule,
                         optimizer-step transients)
                   + kernel workspaces
    on the device  = peak allocated x (1 + allocator fragmentation)
                   + CUDA context + NCCL communicators + NVSHMEM symmetric heap

"Peak allocated" is what ``torch.cuda.max_memory_allocated`` reports and what the
GPU validation compares against; the terms outside PyTorch's allocator (context,
NCCL, NVSHMEM) and fragmentation only enter "on the device", which decides whether
a layout fits. Every rank of a pipeline stage holds the same amounts (DP and EP
ranks are symmetric), so one rank per stage is planned.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from moe_model import MoEConfig, active_params, total_params
from moe_model.experts import MAX_WGRAD_SOURCES
from moe_mxfp8 import name_matches

from pretrain.config import PretrainConfig, ep_call_tokens, validate_layout
from pretrain.planner.activations import (
    EPBackend,
    Execution,
    ep_capacity,
    local_rows,
    merged_wgrad_operands,
)
from pretrain.planner.persistent import (
    ModelShapes,
    PersistentMemory,
    StateLayout,
    fp32_dense_wgrads,
    persistent_memory,
)
from pretrain.planner.pipeline import rank_activations
from pretrain.planner.stage import StageMemory, stage_memory

GIB = 2**30
FP32 = 4

# Outside PyTorch's allocator; estimates to be replaced by GPU measurements
# (tools/plan_validate.py compares the plan with the allocator's peak).
CUDA_CONTEXT = int(0.6 * GIB)  # CUDA 13 context with torch's kernels loaded
NCCL_PER_GROUP = 256 * 2**20  # buffers of one NCCL communicator of 2-8 NVLink peers
KERNEL_WORKSPACES = 64 * 2**20  # cuBLAS/cuBLASLt workspaces, allocated through PyTorch
FRAGMENTATION = 0.05  # reserved / allocated - 1 of the caching allocator
NVSHMEM_HEAP_MARGIN = 256 * 2**20  # moe_ep_transport.nvshmem_memory's margin for NVSHMEM state
COMPUTE_BYTES = {"bfloat16": 2, "float32": 4}  # PlanRequest.compute_dtype -> bytes per element
H200_GIB = 140.0  # an H200 "141 GB": 143,771 MiB as nvidia-smi reports it


@dataclass(frozen=True)
class PlanRequest:
    """A model and a layout to plan, with the device it must fit on."""

    model: MoEConfig
    world: int
    pp: int = 1
    ep: int = 1
    schedule: str = "1f1b"  # moe_pp: gpipe | 1f1b (interleaved if virtual > 1) | zero_bubble
    virtual: int = 1
    pp_split: str = "params"  # moe_pp split policy: params | flops
    micro_batch: int = 1
    seq_len: int = 4096
    global_batch: int = 1  # sequences per optimizer step
    ddp_mode: str = "reduce_scatter"
    bucket_cap_mb: float = 64.0
    optimizer: str = "adamw"
    ep_backend: EPBackend = "local"
    ep_combine: str = "auto"  # moe_ep_transport.EPConfig.combine
    ep_overlap_chunks: int = 1  # parallel.ep_overlap_chunks: the transport is sized for one chunk
    ep_comm_sms: int | None = None  # parallel.ep_comm_sms: the EP communication stream's SMs
    ep_overlap_microbatches: bool = False  # parallel.ep_overlap_microbatches: pairs in flight
    ep_payload: str = "compute"  # parallel.ep_payload: what the forward dispatch sends
    # parallel.ep_copy_engine and parallel.sm_carveout: carried, not modelled (not_modelled)
    ep_copy_engine: bool = False
    sm_carveout: int | None = None
    mxfp8_targets: tuple[str, ...] = ()
    mxfp8_save_activations: bool = False
    mxfp8_recipe: str = "mxfp8"  # moe_mxfp8.MXFP8Config.recipe: mxfp8 | fp8_rowwise | ...
    mxfp8_gemm: str = "emulated"  # moe_mxfp8.MXFP8Config.gemm: emulated | native | triton
    mxfp8_dense_gemm: str | None = None  # moe_mxfp8.MXFP8Config.dense_gemm; None: mxfp8_gemm
    compute_dtype: str = "bfloat16"  # bfloat16 | float32: compute weights and activations
    merge_expert_grads: int = 1  # microbatches' expert weight gradients added in one launch
    fused_grad_accumulation: bool = True  # parallel.fuse_grad_accumulation (CUDA kernels)
    gpu_gib: float = H200_GIB
    headroom: float = 0.10  # share of the device kept free

    def __post_init__(self) -> None:
        for name in ("world", "pp", "ep", "virtual", "micro_batch", "seq_len", "global_batch",
                     "merge_expert_grads", "ep_overlap_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"PlanRequest.{name} must be >= 1, got {getattr(self, name)}")
        if self.ep_comm_sms is not None and self.ep_comm_sms < 1:
            raise ValueError(f"PlanRequest.ep_comm_sms must be >= 1, got {self.ep_comm_sms}")
        if self.world % self.pp:
            raise ValueError(f"world {self.world} is not divisible by pp={self.pp}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the data-parallel size {self.dp}")
        if self.model.n_experts % self.ep:
            raise ValueError(f"n_experts={self.model.n_experts} is not divisible by ep={self.ep}")
        if self.global_batch % (self.dp * self.micro_batch):
            raise ValueError(f"global_batch={self.global_batch} is not divisible by dp={self.dp} "
                             f"x micro_batch={self.micro_batch}")
        if self.compute_dtype not in COMPUTE_BYTES:
            raise ValueError(f"PlanRequest.compute_dtype must be one of {', '.join(COMPUTE_BYTES)}, "
                             f"got {self.compute_dtype!r}")
        if self.pp == 1 and self.virtual > 1:
            raise ValueError(f"virtual={self.virtual} needs pp > 1 (the trainer runs one stage "
                             "at pp=1: PlanRequest.from_config plans virtual=1)")
        if self.model.n_layers < self.pp * self.virtual:
            raise ValueError(f"{self.model.n_layers} layers cannot fill "
                             f"{self.pp * self.virtual} stages")
        if self.ep > 1 and self.ep_backend == "local":  # a transport also runs on one rank
            raise ValueError(f"ep_backend='local' does not go with ep={self.ep}")
        if self.ep_payload != "compute":
            from pretrain.config import EP_PAYLOAD_CODECS

            if self.ep_payload not in EP_PAYLOAD_CODECS:
                raise ValueError(f"PlanRequest.ep_payload must be compute or one of "
                                 f"{', '.join(EP_PAYLOAD_CODECS)}, got {self.ep_payload!r}")
            if self.ep_backend == "local":
                raise ValueError(f"ep_payload={self.ep_payload!r} needs an EP transport "
                                 "(ep_backend='local' dispatches nothing)")
        if self.pp > 1 and self.schedule == "zero_bubble" and self.model.recompute != "none":
            raise ValueError(f"the zero_bubble schedule does not run with recompute="
                             f"{self.model.recompute!r} (moe_pp refuses it)")
        self._check_low_precision()
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if not 0 <= self.headroom < 1:
            raise ValueError(f"headroom must be in [0, 1), got {self.headroom}")
        if not (math.isfinite(self.gpu_gib) and self.gpu_gib > 0):
            raise ValueError(f"gpu_gib must be a finite positive number, got {self.gpu_gib}")

    def _check_low_precision(self) -> None:
        """The ``mxfp8`` fields as ``moe_mxfp8.MXFP8Config`` accepts them."""
        from moe_mxfp8 import MXFP8Config

        try:
            MXFP8Config(targets=self.mxfp8_targets, recipe=self.mxfp8_recipe, gemm=self.mxfp8_gemm,
                        dense_gemm=self.mxfp8_dense_gemm,
                        save_mxfp8_activations=self.mxfp8_save_activations)
        except ValueError as e:
            raise ValueError(f"PlanRequest: {e}") from None

    @property
    def fp8_dense_gemm(self) -> str:
        """The GEMM of the FP8 dense layers (``MXFP8Config.resolved_dense_gemm``)."""
        return self.mxfp8_gemm if self.mxfp8_dense_gemm is None else self.mxfp8_dense_gemm

    @property
    def low_precision_expert_layers(self) -> frozenset[int]:
        """The MoE layers whose routed experts ``mxfp8_targets`` reach (moe_mxfp8's GEMMs)."""
        return frozenset(layer for layer in range(self.model.n_layers) if self.model.is_moe_layer(layer)
                         and any(name_matches(f"blocks.{layer}.mlp.experts", t) for t in self.mxfp8_targets))

    @property
    def dp(self) -> int:
        return self.world // self.pp

    @property
    def microbatches(self) -> int:
        """Microbatches per rank per optimizer step."""
        return self.global_batch // (self.dp * self.micro_batch)

    @classmethod
    def from_config(cls, cfg: PretrainConfig, world: int, **planner: object) -> PlanRequest:
        """The request for ``cfg`` run on ``world`` ranks (layout checked as the app does).

        ``planner`` sets what the run config does not carry (``gpu_gib``, ``headroom``),
        or overrides the compute dtype, whose ``auto`` plans the GPUs' bfloat16. Virtual
        stages count only with a pipeline (pp > 1), as in the trainer."""
        layout = validate_layout(cfg, world)
        p = cfg.parallel
        merge = p.merge_expert_grad_microbatches
        if merge == "auto":
            merge = fitting_merge(cfg, world, **planner)
        dtype = cfg.train.compute_dtype
        planner = {"compute_dtype": "bfloat16" if dtype == "auto" else dtype, **planner}
        return cls(model=cfg.model, world=world, pp=layout.pp, ep=layout.ep,
                   schedule=p.pp_schedule, virtual=p.pp_virtual_stages if layout.pp > 1 else 1,
                   pp_split=p.pp_split,
                   micro_batch=cfg.train.micro_batch, seq_len=cfg.train.seq_len,
                   global_batch=cfg.train.global_batch, ddp_mode=p.ddp_mode,
                   bucket_cap_mb=p.bucket_cap_mb, optimizer=cfg.optim.name,
                   ep_backend=_ep_backend(p.resolved_ep_backend(cfg.train.cuda_graphs)), ep_combine=p.ep_combine,
                   ep_overlap_chunks=p.ep_overlap_chunks,
                   ep_comm_sms=p.ep_comm_sms, ep_overlap_microbatches=p.ep_overlap_microbatches,
                   ep_payload=p.ep_payload, ep_copy_engine=p.ep_copy_engine, sm_carveout=p.sm_carveout,
                   mxfp8_targets=tuple(cfg.mxfp8.targets),
                   mxfp8_save_activations=cfg.mxfp8.save_mxfp8_activations,
                   mxfp8_recipe=cfg.mxfp8.recipe, mxfp8_gemm=cfg.mxfp8.gemm,
                   mxfp8_dense_gemm=cfg.mxfp8.dense_gemm,
                   merge_expert_grads=merge if p.fuse_grad_accumulation else 1,
                   fused_grad_accumulation=p.fuse_grad_accumulation,
                   **planner)  # type: ignore[arg-type]


def fitting_merge(cfg: PretrainConfig, world: int, **planner: object) -> int:
    """``parallel.merge_expert_grad_microbatches=auto``: the most microbatches' expert weight
    gradients per launch, ``MAX_WGRAD_SOURCES`` down to 2, whose plan of ``cfg`` on ``world``
    ranks fits (``planner`` as ``PlanRequest.from_config`` takes it: ``gpu_gib``,
    ``headroom``); 1 where none fits or the gradients are not fused.

    The most that fits because n merged microbatches leave 1/n of the FP32 main grads'
    read-modify-writes of the expert weights (bench-1gpu on one H200: +3.5% at 2, +1.5%
    more at 4; DP2 of bench-2gpu on two: +6% at 2, docs/performance.md), and the planner
    matches the allocator within 0.2 GiB on those runs and predicted the EP2 run at 2 that
    ran out of memory."""
    if not cfg.parallel.fuse_grad_accumulation:
        return 1
    for n in range(MAX_WGRAD_SOURCES, 1, -1):
        trial = cfg.with_changes("parallel", merge_expert_grad_microbatches=n)
        if plan_memory(PlanRequest.from_config(trial, world, **planner)).fits:
            return n
    return 1


def _ep_backend(name: str) -> EPBackend:
    if name not in ("local", "all_to_all", "rowwise"):
        raise ValueError(f"unknown EP backend {name!r}")
    return name  # type: ignore[return-value]


@dataclass(frozen=True)
class RankPlan:
    """One pipeline rank (every DP/EP rank of that stage holds the same)."""

    pp_rank: int
    layers: tuple[int, ...]
    params: int  # parameters held (its slices)
    weights: int
    grads: int
    optimizer: int
    mxfp8_caches: int
    bookkeeping: int
    activations_held_per_microbatch: int  # summed over the rank's stages
    activations_peak: int  # schedule high-water mark (microbatches in flight, transients)
    merged_grads_held: int  # expert weight-gradient operands held for merging (in the peak)
    in_flight: int
    optimizer_step_transient: int
    kernel_workspaces: int
    peak_allocated: int
    fragmentation: int
    cuda_context: int
    nccl: int
    nvshmem_heap: int
    device_total: int
    fits: bool

    @property
    def persistent(self) -> int:
        return self.weights + self.grads + self.optimizer + self.mxfp8_caches + self.bookkeeping


def not_modelled(req: PlanRequest) -> list[str]:
    """The request's settings the planner leaves out, each with what it plans instead: a
    report prints them, so that a prediction never silently ignores a key."""
    notes = []
    if req.ep > 1 and req.ep_copy_engine:
        notes.append("parallel.ep_copy_engine: the copy engines' staging of the partial sums (memory) and "
                     "their SM share (time; the profile's is fitted to SM puts)")
    if req.sm_carveout is not None:
        notes.append(f"parallel.sm_carveout={req.sm_carveout}: planned with every SM")
    if req.mxfp8_targets:
        dense = _dense_targets(req, ModelShapes(req.model))
        if req.mxfp8_recipe == "mxfp8" and dense:
            # MXFP8Linear's weight gradient takes the BF16 layers' route (the same sink add)
            notes.append(f"mxfp8.targets on {len(dense)} dense layers (e.g. {dense[0]}): their "
                         "weight caches and weight gradients are planned; their GEMMs' mxfp8 "
                         "copies of the inputs and output gradients (transient) are not")
        elif dense:
            planned = _planned_fp8_linears(dense)
            others = [fqn for fqn in dense if fqn not in planned]
            if others:
                notes.append(f"mxfp8.targets on {len(others)} dense layers other than the head and "
                             f"whole attention projection groups (e.g. {others[0]}): their weight "
                             f"caches are planned; their GEMMs' {req.mxfp8_recipe} copies of the inputs "
                             "and output gradients (transient) are not")
            if any(fqn != "head" for fqn in planned):
                notes.append("the attention projections' forward in FP8: the inputs' E4M3 copies "
                             "(transient, before the block's forward peak) are not planned; their "
                             "backward is")
            if planned and req.pp > 1 and req.schedule == "zero_bubble":
                notes.append("parallel.pp_schedule=zero_bubble: the input and weight passes of the "
                             "FP8 dense layers are planned as the BF16 layers'")
    return notes


def _dense_targets(req: PlanRequest, shapes: ModelShapes) -> list[str]:
    """The model's ``nn.Linear`` modules that ``mxfp8_targets`` convert."""
    from torch import nn

    return [fqn for fqn, module in shapes.model.named_modules()
            if isinstance(module, nn.Linear) and any(name_matches(fqn, t) for t in req.mxfp8_targets)]


def _planned_fp8_linears(dense: list[str]) -> frozenset[str]:
    """The converted linears whose FP8 memory the planner models: the head, each attention
    output projection, and q, k and v where all three of a block are converted (they then
    run as one function, ``FP8Linear.shared_input_forward``)."""
    converted = set(dense)
    planned = {fqn for fqn in converted if fqn == "head" or fqn.endswith(".attn.wo")}
    for fqn in converted:
        if fqn.endswith(".attn.wq"):
            group = {fqn[:-2] + name for name in ("wq", "wk", "wv")}
            if group <= converted:
                planned |= group
    return frozenset(planned)


def fp8_linears(req: PlanRequest, shapes: ModelShapes) -> frozenset[str]:
    """``Execution.fp8_linears`` of ``req``: the linears an FP8 recipe converts whose memory
    the planner models (``_planned_fp8_linears``); none for other recipes."""
    from moe_mxfp8 import FP8_RECIPES

    if req.mxfp8_recipe not in FP8_RECIPES or not req.mxfp8_targets:
        return frozenset()
    return _planned_fp8_linears(_dense_targets(req, shapes))


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    total_params: int
    active_params: int
    capacity_rows: int  # rows the experts run on per MoE layer and microbatch
    ranks: tuple[RankPlan, ...] = field(default_factory=tuple)

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.device_total)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def to_json(self) -> dict:
        req = asdict(self.request)
        req["model"] = asdict(self.request.model)
        req["mxfp8_targets"] = list(self.request.mxfp8_targets)
        return {
            "request": req, "dp": self.request.dp, "microbatches": self.request.microbatches,
            "total_params": self.total_params, "active_params": self.active_params,
            "capacity_rows": self.capacity_rows, "fits": self.fits,
            "worst_pp_rank": self.worst.pp_rank,
            "ranks": [{**asdict(r), "persistent": r.persistent} for r in self.ranks],
        }


def _optimizer_step_transient(state: PersistentMemory, optimizer: str) -> int:
    """Allocations of the step boundary (activations are freed by then).

    Rebuild: moe_optim gathers compute weights in capped chunks, three in flight at
    most. Muon, from moe_optim's code: FP32 update directions and results of every
    owned shard (8 B/element), the exchanges' send, receive and return buffers for
    sharded tensors (12 B/element), and one Newton-Schulz batch of equal-shaped
    matrices at a time (its FP32 copy, BF16 iterate and Gram products: 8 B/element,
    measured on CPU together with the 8 B/element; the exchange term is not). The weight
    caches refresh after both, one at a time (``PersistentMemory.cache_refresh``).
    """
    transient = 3 * state.largest_gather_chunk
    if optimizer == "muon":
        transient += 8 * state.muon_owned + 12 * state.muon_exchanged + 8 * state.muon_largest_batch
    return max(transient, state.cache_refresh)


def _nccl_groups(req: PlanRequest) -> int:
    """Communicators a rank joins with more than one member: DP, EP-DP, EP-MP, PP, world."""
    sizes = [req.dp, req.dp // req.ep, req.ep, req.pp, req.world]
    return sum(1 for s in sizes if s > 1)


def _nvshmem_heap(req: PlanRequest) -> int:
    """Two symmetric slabs (moe_ep_transport.rowwise) plus NVSHMEM's own state."""
    if req.ep_backend != "rowwise":
        return 0
    from moe_ep_transport import EPConfig
    from moe_ep_transport.peer_memory import N_SLABS
    from moe_ep_transport.rowwise import slab_bytes_for

    m = req.model
    cfg = EPConfig(n_experts=m.n_experts, top_k=m.top_k,
                   max_tokens=ep_call_tokens(req.micro_batch * req.seq_len, req.ep_overlap_chunks),
                   d_model=m.d_model, capacity_factor=m.capacity_factor, combine=req.ep_combine)
    # rows of the compute dtype (an MXFP8 payload packs narrower), partial sums in FP32 or wider
    b = COMPUTE_BYTES[req.compute_dtype]
    slab = slab_bytes_for(cfg, req.ep, b * m.d_model, max(4, b) * m.d_model)
    return N_SLABS * slab + NVSHMEM_HEAP_MARGIN


def plan_memory(req: PlanRequest, shapes: ModelShapes | None = None,
                kernels: str = "cuda") -> MemoryPlan:
    """Plan every pipeline rank of ``req`` (``shapes``: the model's, when planning many
    layouts of one model; ``kernels``: whose attention kernels allocate, cuda | cpu)."""
    m = req.model
    shapes = shapes or ModelShapes(m)
    if replace(shapes.cfg, recompute=m.recompute) != m:
        raise ValueError("plan_memory: shapes were built for another model configuration")
    b = COMPUTE_BYTES[req.compute_dtype]
    ex = Execution(
        micro_batch=req.micro_batch, seq_len=req.seq_len, compute_bytes=b, param_bytes=b,
        ep=req.ep, ep_backend=req.ep_backend,
        ep_combine=req.ep_combine,
        mxfp8_expert_layers=req.low_precision_expert_layers,
        mxfp8_save_activations=req.mxfp8_save_activations,
        mxfp8_recipe=req.mxfp8_recipe, mxfp8_gemm=req.mxfp8_gemm,
        fp8_linears=fp8_linears(req, shapes), fp8_dense_gemm=req.fp8_dense_gemm,
        expert_grad_sink=req.fused_grad_accumulation,
        kernels=kernels,  # type: ignore[arg-type]
        dense_grads_in_gemm=req.fused_grad_accumulation and kernels == "cuda",
    )
    state_layout = StateLayout(dp=req.dp, ep=req.ep, ddp_mode=req.ddp_mode, param_bytes=b,
                               bucket_cap_mb=req.bucket_cap_mb, optimizer=req.optimizer,
                               mxfp8_targets=req.mxfp8_targets, mxfp8_recipe=req.mxfp8_recipe,
                               fp8_dense_gemm=req.fp8_dense_gemm)
    stage_layers = shapes.stage_layers(req.pp, req.virtual, req.pp_split, req.seq_len)
    n_stages = len(stage_layers)
    # rows the experts run on: the local dispatcher's (capacity applied), or what one rank
    # of the EP transport receives (also on one rank)
    capacity = (local_rows(m, ex.tokens) if req.ep_backend == "local"
                else ep_capacity(m, ex.tokens, req.ep))
    ranks = []
    for rank in range(req.pp):
        own = list(range(rank, n_stages, req.pp))
        layers = tuple(layer for s in own for layer in stage_layers[s])
        params = shapes.held(layers, 0 in own, n_stages - 1 in own, req.ep)
        rank_ex = ex if not ex.dense_grads_in_gemm else replace(
            ex, fp32_dense_wgrads=fp32_dense_wgrads(m, params, state_layout))
        stages: dict[int, StageMemory] = {
            s: stage_memory(m, stage_layers[s], s == 0, s == n_stages - 1, rank_ex) for s in own
        }
        acts = rank_activations(stages, req.pp, req.virtual, req.schedule, req.microbatches, rank,
                                message_bytes=ex.compute_bytes * ex.tokens * m.d_model,
                                pairs=req.ep_overlap_microbatches)
        # earlier microbatches' expert weight-gradient operands, held until merged: alive
        # through the next microbatch's forward and the start of its backward
        merged = (min(req.merge_expert_grads, req.microbatches) - 1) * merged_wgrad_operands(
            m, layers, ex, capacity)
        state = persistent_memory(m, params, state_layout)
        step = _optimizer_step_transient(state, req.optimizer)
        peak = state.total + max(acts.peak + merged, step) + KERNEL_WORKSPACES
        frag = int(FRAGMENTATION * peak)
        nccl = NCCL_PER_GROUP * _nccl_groups(req)
        heap = _nvshmem_heap(req)
        device = peak + frag + CUDA_CONTEXT + nccl + heap
        ranks.append(RankPlan(
            pp_rank=rank, layers=layers, params=state.n_params, weights=state.weights,
            grads=state.grads, optimizer=state.optimizer, mxfp8_caches=state.mxfp8_caches,
            bookkeeping=state.bookkeeping,
            activations_held_per_microbatch=sum(s.held for s in stages.values()),
            activations_peak=acts.peak + merged, merged_grads_held=merged, in_flight=acts.in_flight,
            optimizer_step_transient=step, kernel_workspaces=KERNEL_WORKSPACES,
            peak_allocated=peak, fragmentation=frag, cuda_context=CUDA_CONTEXT, nccl=nccl,
            nvshmem_heap=heap, device_total=device,
            fits=device <= (1 - req.headroom) * req.gpu_gib * GIB,
        ))
    return MemoryPlan(req, total_params(m), active_params(m), capacity, tuple(ranks))


def gib(nbytes: int) -> float:
    return nbytes / GIB


def fits_share(plan: MemoryPlan) -> float:
    """Worst rank's device total as a share of the usable device memory."""
    req = plan.request
    return plan.worst.device_total / ((1 - req.headroom) * req.gpu_gib * GIB)


