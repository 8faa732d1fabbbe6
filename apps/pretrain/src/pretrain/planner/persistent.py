"""Persistent training state of one rank, tensor by tensor, with the packages' own rules.

For each parameter the rank holds (its pipeline stages' blocks, the embedding on
the first stage, the final norm and head on the last, its EP slice of every expert
tensor):

- compute weight: the parameter itself, in the compute dtype, or FP32 for a
  low-precision experts weight whose main weight the rank holds whole
  (``pretrain.optimizer.expert_weight_in_fp32``);
- FP32 gradient: moe_ddp's flat buckets, laid out by ``moe_ddp.layout.plan_buckets``
  (per replica group, owner-major reduce-scatter buckets, 16-element alignment),
  so bucket padding is counted exactly;
- FP32 main weight and optimizer states of the owned part: a tensor is sharded
  over its replica group iff ``moe_ddp.is_sharded`` (numel divisible by the group
  size and at least ``min_shard_numel``), else every replica keeps all of it; an
  FP32 parameter is its own main weight (moe_optim), counted once, as a weight;
  AdamW keeps two moments, Muon one momentum; which tensor gets which is the app's
  own policy (``pretrain.optimizer.param_rules``, resolved by moe_optim);
- low-precision weight caches of targeted modules (``moe_mxfp8``'s recipes): MXFP8
  (both orientations, data plus E8M0 scales), or an FP8 recipe's E4M3 copy and its
  transpose with FP32 scales per row or 128x128 block.

Replica groups: dense parameters replicate over DP, routed experts over EP-DP.
Under ``reduce_scatter`` a sharded tensor's gradient bucket still has the whole
tensor (reduce-scatter is in place): only the optimizer state is sharded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from moe_ddp import is_sharded
from moe_ddp.layout import ParamEntry, plan_buckets
from moe_model import MoEConfig, MoETransformer, param_kind
from moe_optim.config import resolve_rule

from pretrain.config import OptimConfig as AppOptimConfig
from pretrain.optimizer import MIN_SHARD_NUMEL, expert_weight_in_fp32, optim_config, param_rules

FP32 = 4
INDEX = 8


@dataclass(frozen=True)
class HeldParam:
    name: str
    shape: tuple[int, ...]  # this rank's part (experts: its EP slice)
    kind: str  # "dense" | "expert"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PersistentMemory:
    weights: int  # compute weights (and persistent buffers)
    grads: int  # FP32 gradient buckets
    optimizer: int  # FP32 main weights, moments/momentum, step counter, norm weights
    mxfp8_caches: int  # derived low-precision weight copies (MXFP8 or an FP8 recipe's)
    bookkeeping: int  # per-step routing statistics
    n_params: int  # parameters this rank holds (its parts)
    largest_gather_chunk: int  # bytes of the largest compute-weight rebuild chunk
    muon_owned: int = 0  # elements of Muon tensors this rank updates (its shards)
    muon_exchanged: int = 0  # of those, elements of sharded tensors (sent to their owners)
    muon_largest_batch: int = 0  # elements of the largest same-shape Newton-Schulz batch it runs
    cache_refresh: int = 0  # bytes one weight cache's refresh allocates (see _cache_refresh_bytes)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.mxfp8_caches + self.bookkeeping


@dataclass(frozen=True)
class StateLayout:
    """What decides the persistent bytes besides the parameters."""

    dp: int
    ep: int
    ddp_mode: str = "reduce_scatter"  # moe_ddp mode
    bucket_cap_mb: float = 64.0  # moe_ddp bucket cap (MiB of FP32)
    optimizer: str = "adamw"  # adamw | muon
    param_bytes: int = 2
    mxfp8_targets: tuple[str, ...] = ()  # module-name globs (moe_mxfp8.MXFP8Config.targets)
    mxfp8_recipe: str = "mxfp8"  # moe_mxfp8.MXFP8Config.recipe: mxfp8 | an FP8 recipe
    fp8_dense_gemm: str = "emulated"  # MXFP8Config.resolved_dense_gemm: the FP8 dense layers' GEMM

    @property
    def ep_dp(self) -> int:
        return self.dp // self.ep


class ModelShapes:
    """The logical parameters of a model (built once on the meta device) and its
    pipeline splits, shared by every layout planned for that model."""

    def __init__(self, cfg: MoEConfig) -> None:
        with torch.device("meta"):
            self.model = MoETransformer(cfg)
        self.cfg = cfg
        self.params = [(name, tuple(p.shape)) for name, p in
                       self.model.named_parameters(remove_duplicate=False) if p.requires_grad]
        self._splits: dict[tuple[int, int, str, int], list[tuple[int, ...]]] = {}

    def stage_layers(self, pp: int, virtual: int, policy: str,
                     seq_len: int) -> list[tuple[int, ...]]:
        """Blocks of every pipeline stage, as moe_pp splits them."""
        if pp * virtual == 1:
            return [tuple(range(self.cfg.n_layers))]
        key = (pp, virtual, policy, seq_len)
        if key not in self._splits:
            from moe_pp import split_model

            split = split_model(self.model, pp, virtual, policy, seq_len)
            self._splits[key] = [tuple(int(n) for n in names) for names in split.stage_blocks]
        return self._splits[key]

    def held(self, layers: Sequence[int], first: bool, last: bool, ep: int) -> list[HeldParam]:
        """The parameters a rank holding blocks ``layers`` keeps, in registration order.

        A tied head on a last stage without the embedding is its own copy
        (``head.weight``), as moe_pp keeps it."""
        wanted = {str(i) for i in layers}
        held = []
        for name, shape in self.params:
            top, _, rest = name.partition(".")
            keep = ((top == "embed" and first) or (top in ("norm", "head") and last)
                    or (top == "blocks" and rest.split(".")[0] in wanted))
            if self.cfg.tie_embeddings and name == "head.weight" and first:
                keep = False  # the embedding's parameter, already counted
            if not keep:
                continue
            kind = param_kind(name)
            if kind == "expert":
                shape = (shape[0] // ep, *shape[1:])
            held.append(HeldParam(name, shape, kind))
        return held


def _mxfp8_cache_bytes(params: list[HeldParam], targets: tuple[str, ...], recipe: str,
                      dense_gemm: str = "emulated") -> int:
    """The weight caches of every targeted linear's weight and of each targeted expert
    stack (gate and up share one [E, 2F, D] cache). MXFP8: both orientations (rows:
    blocked along the last dim, cols: along the one before). An FP8 recipe
    (``moe_mxfp8.fp8_experts.FP8WeightCache``): the weight and its contiguous transpose,
    each scaled by the recipe's weight block along its last dim; a linear on the native
    GEMM (``dense_gemm``) also holds both copies' FP32 scale reciprocals."""
    if not targets:
        return 0
    from moe_mxfp8 import FP8_RECIPES, name_matches
    from moe_mxfp8.format import mxfp8_nbytes
    from moe_mxfp8.fp8 import fp8_nbytes

    def both(shape: tuple[int, ...]) -> int:
        if recipe == "mxfp8":
            return mxfp8_nbytes(shape, axis=-1) + mxfp8_nbytes(shape, axis=-2)
        block = FP8_RECIPES[recipe].weight_block
        transposed = (*shape[:-2], shape[-1], shape[-2])
        return fp8_nbytes(shape, block) + fp8_nbytes(transposed, block)

    total = 0
    for p in params:
        module, _, leaf = p.name.rpartition(".")
        if not any(name_matches(module, t) for t in targets):
            continue
        if p.kind == "expert":
            if leaf == "w1":  # with w3: one cache of [E, 2F, D]
                total += both((p.shape[0], 2 * p.shape[1], p.shape[2]))
            elif leaf == "w2":
                total += both(p.shape)
        elif len(p.shape) == 2 and not module.endswith(("embed", "router")):
            total += both(p.shape)
            if recipe != "mxfp8" and dense_gemm == "native":
                total += FP32 * (p.shape[0] + p.shape[1])
    return total


def _cache_refresh_bytes(params: list[HeldParam], state: StateLayout, in_fp32: set[str]) -> int:
    """The most one weight cache's refresh allocates (the caches refresh one after another,
    after the optimizer's rebuild): its new copies, which an eager refresh builds beside
    the old ones (replayed graphs refresh in place), and the compute-dtype copies of an
    FP32 weight (``in_fp32``: their names) the cache derives from (``moe_mxfp8.cache``):
    gate and up for the ``[E, 2F, D]`` cache, the down projection for its own."""
    if not state.mxfp8_targets:
        return 0
    by_name = {p.name: p for p in params}
    largest = 0
    for p in params:
        module, _, leaf = p.name.rpartition(".")
        if p.kind == "expert" and leaf == "w3":
            continue  # in w1's [E, 2F, D] cache
        parts = [p, by_name[f"{module}.w3"]] if p.kind == "expert" and leaf == "w1" else [p]
        copies = _mxfp8_cache_bytes(parts, state.mxfp8_targets, state.mxfp8_recipe,
                                    state.fp8_dense_gemm)
        if copies and state.param_bytes < FP32 and p.name in in_fp32:
            copies += sum(q.numel for q in parts) * state.param_bytes
        largest = max(largest, copies)
    return largest


def _bucket_entry(p: HeldParam, state: StateLayout) -> ParamEntry:
    """How moe_ddp buckets ``p``'s FP32 gradient: its replica group and collective."""
    group = state.dp if p.kind == "dense" else state.ep_dp
    if group > 1:
        sharded = is_sharded(p.numel, group, MIN_SHARD_NUMEL)
        collective = "reduce_scatter" if state.ddp_mode == "reduce_scatter" and sharded \
            else "all_reduce"
    else:
        collective = "none"
    return ParamEntry(p.numel, p.kind, group, collective)


# The dense layers moe_model.linear.Linear runs: their weight gradient may go into the sink
_SINK_LINEAR = re.compile(r"(blocks\.\d+\.(attn\.w[qkvo]|mlp(\.shared)?\.w[123])|head)\.weight")


def fp32_dense_wgrads(cfg: MoEConfig, params: list[HeldParam], state: StateLayout) -> frozenset[str]:
    """The dense weights whose gradient, added to the main grad in the GEMM (CUDA with the
    fused accumulation), is first formed as an FP32 ``[out, in]`` temporary.

    ``moe_model.linear.dense_grad_accumulate_`` writes the FP32 accumulator straight from
    the GEMM when it is flat, or when each of its ``[G, piece]`` rows (a reduce-scattered
    weight's slice of an owner-major bucket shared with other tensors) holds whole rows
    of the weight: ``G`` divides ``out``. Otherwise it forms the gradient once and adds it
    piece by piece. A tied head has no sink. moe_mxfp8's converted layers hand the sink the
    same add (``DenseWeightGradient``) where their recipe computes the weight gradient in
    the compute dtype; with FP8 weight gradients (``fp8_rowwise``) they add a computed one."""
    from moe_mxfp8 import FP8_RECIPES, name_matches

    recipe = FP8_RECIPES.get(state.mxfp8_recipe)
    fp8_wgrad_targets = state.mxfp8_targets if recipe is not None and recipe.fp8_wgrad else ()

    cap_numel = max(1, int(state.bucket_cap_mb * 2**20) // FP32)
    entries = [_bucket_entry(p, state) for p in params]
    found = set()
    for bucket in plan_buckets(entries, cap_numel):
        if bucket.collective != "reduce_scatter":
            continue
        for index in bucket.params:
            p, piece = params[index], bucket.piece_numel(entries[index])
            module = p.name.removesuffix(".weight")
            if (piece == bucket.region_numel  # the bucket's only tensor: a contiguous view
                    or not _SINK_LINEAR.fullmatch(p.name)
                    or (cfg.tie_embeddings and p.name == "head.weight")
                    or any(name_matches(module, t) for t in fp8_wgrad_targets)):
                continue
            if piece % p.shape[1]:
                found.add(p.name)
    return frozenset(found)


def persistent_memory(cfg: MoEConfig, params: list[HeldParam],
                      state: StateLayout) -> PersistentMemory:
    """Bytes of every persistent tensor of a rank holding ``params``."""
    app_optim = AppOptimConfig(name=state.optimizer)  # type: ignore[arg-type]
    rules, optim = param_rules(app_optim), optim_config(app_optim)
    cap = int(optim.gather_bucket_mb * 2**20)
    entries, optimizer, muon_owned, muon_exchanged = [], 0, 0, 0
    gather_chunks: dict[str, int] = {}
    largest_chunk = 0
    muon_batches: dict[tuple[int, ...], int] = {}
    weights = 0
    in_fp32_names = set()
    for p in params:
        entry = _bucket_entry(p, state)
        group, sharded = entry.group_size, is_sharded(p.numel, entry.group_size, MIN_SHARD_NUMEL)
        entries.append(entry)
        owned = p.numel // group if sharded else p.numel
        in_fp32 = state.param_bytes == FP32 or expert_weight_in_fp32(
            p.name, p.numel, state.mxfp8_targets, state.ep_dp)
        param_bytes = FP32 if in_fp32 else state.param_bytes
        if in_fp32:
            in_fp32_names.add(p.name)
        weights += p.numel * param_bytes
        meta = torch.empty(p.shape, device="meta")
        rule = resolve_rule(p.name, meta, rules, optim)  # type: ignore[arg-type]
        muon = rule.algorithm == "muon"
        # (main +) momentum | (main +) two moments: an FP32 parameter is its own main weight
        optimizer += FP32 * owned * ((1 if muon else 2) + (0 if in_fp32 else 1))
        if muon:  # owners run whole matrices, spread evenly over the group
            muon_owned += owned
            muon_exchanged += owned if sharded else 0
            matrix = p.shape[-2:]
            muon_batches[matrix] = muon_batches.get(matrix, 0) + owned
        if sharded:  # the rebuild gathers per replica group in capped chunks
            nbytes = p.numel * param_bytes
            chunk = gather_chunks.get(p.kind, 0)
            chunk = nbytes if chunk + nbytes > cap and chunk else chunk + nbytes
            gather_chunks[p.kind] = chunk
            largest_chunk = max(largest_chunk, chunk)
    optimizer += FP32 * (1 + len(params))  # step counter, per-tensor norm weights
    cap_numel = max(1, int(state.bucket_cap_mb * 2**20) // FP32)
    grads = FP32 * sum(b.numel for b in plan_buckets(entries, cap_numel))
    n_moe = sum(1 for p in params if p.name.endswith("router.weight"))
    if cfg.bias_update_rate > 0:
        weights += n_moe * FP32 * cfg.n_experts  # the routers' selection bias buffers
    # Per MoE layer and step: tokens and drops per expert, loss sums, token count.
    bookkeeping = n_moe * (2 * INDEX * cfg.n_experts + 2 * FP32 + INDEX)
    return PersistentMemory(
        weights=weights, grads=grads, optimizer=optimizer,
        mxfp8_caches=_mxfp8_cache_bytes(params, state.mxfp8_targets, state.mxfp8_recipe,
                                        state.fp8_dense_gemm),
        bookkeeping=bookkeeping, n_params=sum(p.numel for p in params),
        largest_gather_chunk=largest_chunk, muon_owned=muon_owned, muon_exchanged=muon_exchanged,
        muon_largest_batch=max(muon_batches.values(), default=0),
        cache_refresh=_cache_refresh_bytes(params, state, in_fp32_names),
    )
