"""The time of one optimizer step of a planned layout, from a calibration ``Profile``.

The walk is the memory planner's: the same stages (``ModelShapes.stage_layers``,
moe_pp's split), the same blocks and rows (``activations``: ``local_rows``,
``ep_capacity``, each block's tensor inventory), the same held parameters and their
replica groups (``persistent``). Per pipeline stage and microbatch it adds up:

- expert grouped GEMMs: ``2 R D 3F`` FLOPs forward, twice that backward, over the
  ``R`` rows this rank's experts run (``T k`` mean rows; under EP the busiest rank
  gets ``routing_skew`` times the mean), at the profile's rate for ``R / E_local``
  rows per expert;
- dense GEMMs (attention projections, router, shared and dense MLPs, LM head),
  attention (causal), each at its rate;
- memory-bound kernels: ``MEMORY_PASSES`` times the bytes of the block's tensor
  inventory (every tensor the planner counts is written once and read about once
  more by the kernels around it), the LM head's logits three times, a third of it
  in the forward;
- gradient accumulation into the FP32 main grads (``_accumulation_bytes``);
- launches: ``KERNELS_PER_BLOCK`` kernels per block (forward and backward), the
  device idle ``kernel_gap_us_*`` between two; an eager microbatch also waits for
  the host when its launches (forward and backward together) take longer than its
  kernels;
- EP token exchange: dispatch and combine forward, their two backward calls, each
  an all-to-all on the EP-MP group. One chunk (``parallel.ep_overlap_chunks`` = 1):
  exposed, one call after the other around the expert GEMMs. ``n`` > 1 chunks: each
  call and the expert GEMMs run per chunk of ``1/n`` of the tokens (each chunk call
  pays its own latency ``alpha`` and launches, ``KERNELS_PER_CHUNK_*`` more per
  chunk; the GEMMs run at the rate of ``1/n`` of the rows per expert), pipelined on
  two streams as ``moe_ep_transport.pipeline`` issues them; the layer takes the
  makespan of that schedule (``pipelined_layer_s``), in which the GEMMs lose the SM
  share the communication stream takes while both run. The exposed part is that
  makespan less the GEMMs at their full rate; the rest of the calls' time is hidden;
  Interleaved pairs of microbatches (``parallel.ep_overlap_microbatches``): a paired
  microbatch's calls of a block (``K`` seconds in a pass) run under the other
  microbatch's compute of the same block and pass (``C``), which loses the
  communication stream's SM share ``s`` (``comm_sm_share``) while they run, so ``max(s K, K - C)`` of them
  is exposed (``interleaved_exposed_s``); the step's unpaired microbatches (its last,
  one left over) keep theirs exposed;
- recompute: ``block`` runs the forward again in the backward, ``selective`` its
  memory-bound part.

A step is then the microbatches (pp = 1: one after the other; pp > 1: moe_pp's own
schedule simulated with these costs, whose idle time is the bubble), the
data-parallel gradient reduction (per replica group and collective, behind the last
microbatch's backward at pp = 1, where moe_ddp launches buckets as they fill; after the
schedule at pp > 1, where moe_pp runs everything under ``no_sync``), the optimizer
(AdamW: ``OPTIMIZER_BYTES`` per owned parameter, memory-bound; Muon adds its
Newton-Schulz GEMMs), and the weight rebuild (a local cast plus an all-gather of the
sharded compute weights, exposed).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from moe_ddp import is_sharded
from moe_model import MoEConfig, flops_per_token

from pretrain.optimizer import MIN_SHARD_NUMEL
from pretrain.planner.activations import Execution, block_inventory, ep_capacity, local_rows
from pretrain.planner.comm import Fabric, Group
from pretrain.planner.memory import COMPUTE_BYTES, PlanRequest
from pretrain.planner.persistent import HeldParam, ModelShapes
from pretrain.planner.pipeline import paired_microbatches
from pretrain.planner.profile import Profile

FP32 = 4
# Tuned on the kernel census of one bench-1gpu step (tools/kernel_census.py --config
# bench-1gpu, tools/results/kernel_census_bench-1gpu.json): 28,459 kernels over 8
# blocks x 32 microbatches (the optimizer's and the head's ~1,000 aside); ~405 ms of
# memory-bound kernels against 2.1 GB of planned tensors per block and microbatch.
KERNELS_PER_BLOCK = 107
KERNELS_PER_EDGE = 12  # embedding, final norm, head, cross-entropy (forward and backward)
MEMORY_PASSES = 2.0
# AdamW per owned parameter: FP32 main weight, two moments and gradient read, the
# three written back (28 B), the gradient norm's read (4 B).
OPTIMIZER_BYTES = 32
REBUILD_BYTES = 6  # FP32 main weight read, compute weight written
UNFUSED_ACCUMULATION_BYTES = 10  # BF16 gradient read, FP32 main grad read and written
NEWTON_SCHULZ_STEPS = 5
# Launches each extra EP chunk adds (parallel.ep_overlap_chunks), forward and backward:
# the rowwise transport's dispatch + combine on NVSHMEM, 7 forward and 6 backward summing
# at the destination (5 backward at the source; moe_ep_transport's README; its
# test_launch_count.py pins them on CPU, one more forward there), and, an assumption, 3
# forward and 5 backward of the chunk's grouped GEMMs and SwiGLU.
KERNELS_PER_CHUNK_FORWARD = 7 + 3
KERNELS_PER_CHUNK_BACKWARD = 6 + 5


@dataclass(frozen=True)
class PassCost:
    """Seconds of one microbatch's pass through one stage, per kernel class."""

    expert_gemm: float = 0.0
    dense_gemm: float = 0.0
    attention: float = 0.0
    memory_bound: float = 0.0
    launch: float = 0.0
    ep_comm: float = 0.0  # exposed: on the pass's critical path
    ep_comm_hidden: float = 0.0  # the calls' time under the expert GEMMs (not in ``device``)
    kernels: int = 0

    @property
    def device(self) -> float:
        return (self.expert_gemm + self.dense_gemm + self.attention + self.memory_bound
                + self.launch + self.ep_comm)

    def __add__(self, other: PassCost) -> PassCost:
        return PassCost(*(getattr(self, f) + getattr(other, f) for f in _PASS_FIELDS))

    def scaled(self, factor: float) -> PassCost:
        return PassCost(*(getattr(self, f) * factor for f in _PASS_FIELDS[:-1]),
                        kernels=round(self.kernels * factor))


_PASS_FIELDS = ("expert_gemm", "dense_gemm", "attention", "memory_bound", "launch", "ep_comm",
                "ep_comm_hidden", "kernels")


@dataclass(frozen=True)
class StageCost:
    forward: PassCost
    backward_input: PassCost  # the whole backward but the weight gradients' GEMMs
    backward_weight: PassCost  # the weight gradients' GEMMs

    @property
    def backward(self) -> PassCost:
        return self.backward_input + self.backward_weight

    @property
    def total(self) -> PassCost:
        return self.forward + self.backward


@dataclass(frozen=True)
class StepTime:
    """A predicted step: its time, what it is made of, and the throughput it gives.

    ``step_s = compute_s + exposed_comm_s + bubble_s``; ``compute`` and ``comm`` break
    those down (seconds per step on the busiest rank); ``comm`` holds each collective's
    whole time, ``exposed`` the part not hidden behind compute (EP with chunks: what the
    pipelined layers take beyond their expert GEMMs, the GEMMs' SM loss included)."""

    request: PlanRequest
    profile: str
    cuda_graphs: bool
    gpus_per_node: int
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    compute: dict[str, float] = field(default_factory=dict)
    comm: dict[str, float] = field(default_factory=dict)
    exposed: dict[str, float] = field(default_factory=dict)
    mfu: float = 0.0

    @property
    def tokens(self) -> int:
        return self.request.global_batch * self.request.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.request.world

    def to_json(self) -> dict:
        return {"profile": self.profile, "cuda_graphs": self.cuda_graphs,
                "gpus_per_node": self.gpus_per_node, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "compute_s": self.compute_s, "exposed_comm_s": self.exposed_comm_s,
                "bubble_s": self.bubble_s, "compute": dict(self.compute),
                "comm": dict(self.comm), "exposed": dict(self.exposed)}


def _gemm_s(flops: float, tflops: float) -> float:
    return flops / (tflops * 1e12)


def expert_rate(profile: Profile, rows_per_expert: float) -> float:
    """TFLOP/s of the expert GEMMs at ``rows_per_expert`` rows per expert."""
    m = max(rows_per_expert, 1e-9)
    return profile.expert_gemm_tflops * m / (m + profile.expert_gemm_half_rows)


def remote_reach(n_experts: int, top_k: int, ep: int) -> float:
    """Mean number of other EP ranks a token's ``top_k`` distinct experts live on
    (uniform routing: a rank holds none of them with probability C(E-L, k) / C(E, k))."""
    if ep < 2:
        return 0.0
    local = n_experts // ep
    miss = math.comb(n_experts - local, top_k) / math.comb(n_experts, top_k)
    return (ep - 1) * (1 - miss)


@dataclass(frozen=True)
class _Setup:
    req: PlanRequest
    profile: Profile
    fabric: Fabric
    cuda_graphs: bool
    routing_skew: float
    ex: Execution


def _block_cost(s: _Setup, layer: int) -> StageCost:
    m, req, p = s.req.model, s.req, s.profile
    T, D, S = s.ex.tokens, m.d_model, req.seq_len
    Q, KV = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    dense = 2 * T * D * (2 * Q + 2 * KV)
    expert = rows = 0.0
    if m.is_moe_layer(layer):
        dense += 2 * T * D * m.n_experts + 2 * T * D * 3 * m.shared_hidden_width
        slots = T * m.top_k
        if req.ep_backend == "local":
            rows = float(local_rows(m, T))
        else:  # what the busiest rank receives, up to its capacity
            rows = min(slots * (s.routing_skew if req.ep > 1 else 1.0),
                       float(ep_capacity(m, T, req.ep)))
        expert = 2 * rows * D * 3 * m.expert_hidden
        expert_s = _gemm_s(expert, expert_rate(p, rows / (m.n_experts // req.ep)))
    else:
        dense += 2 * T * D * 3 * m.dense_hidden_width
        expert_s = 0.0
    attn = 2 * T * S * m.n_heads * m.head_dim  # causal: QK^T and AV over half the pairs
    # the rows the kernels touch, not the worst-case receive buffers an EP rank allocates
    # (the transport's own traffic is the exchange's)
    inv = block_inventory(m, layer, replace(s.ex, ep=1, ep_backend="local"))
    mem_s = MEMORY_PASSES * sum(inv.sizes.values()) / (p.memory_gb_per_s * 1e9)
    fwd = PassCost(dense_gemm=_gemm_s(dense, p.dense_gemm_tflops),
                   attention=_gemm_s(attn, p.attention_fwd_tflops), memory_bound=mem_s / 3,
                   kernels=KERNELS_PER_BLOCK // 3)
    # backward: input and weight gradients, one GEMM each per forward GEMM
    grads = PassCost(dense_gemm=_gemm_s(dense, p.dense_gemm_tflops))
    bwd_in = PassCost(attention=_gemm_s(2.5 * attn, p.attention_bwd_tflops),
                      memory_bound=2 * mem_s / 3,
                      kernels=KERNELS_PER_BLOCK - KERNELS_PER_BLOCK // 3) + grads
    if expert_s:
        experts_fwd, experts_in, experts_w = _expert_passes(s, T, rows, expert_s)
        fwd, bwd_in, grads = fwd + experts_fwd, bwd_in + experts_in, grads + experts_w
        if req.ep > 1 and req.ep_overlap_microbatches:
            share, paired = comm_sm_share(p, req.ep_comm_sms), paired_share(req.microbatches)
            fwd = _interleaved(fwd, fwd.device - fwd.ep_comm, share, paired)
            bwd_in = _interleaved(bwd_in, bwd_in.device - bwd_in.ep_comm + grads.device, share, paired)
    if m.recompute == "block":
        bwd_in = bwd_in + fwd
    elif m.recompute == "selective":
        bwd_in = bwd_in + PassCost(memory_bound=fwd.memory_bound)
    return StageCost(fwd, bwd_in, grads)


def _expert_passes(s: _Setup, tokens: int, rows: float, expert_s: float
                   ) -> tuple[PassCost, PassCost, PassCost]:
    """A MoE layer's expert GEMMs and EP calls: (forward, backward input, weight gradients).

    One chunk: the GEMMs (``expert_s`` each way) and the four calls, exposed. ``n``
    chunks (``parallel.ep_overlap_chunks``): per chunk the calls of ``tokens / n`` and
    the GEMMs of ``rows / n`` at that size's rate, pipelined (``pipelined_layer_s``):
    forward dispatch, experts, combine; backward the combine's gradient, the input
    gradients' GEMMs, the dispatch's gradient. Without ``parallel.fuse_grad_accumulation``
    each chunk's weight gradients run in its backward; with it, moe_model's
    ``MergingSink`` holds them until the last chunk's and runs one launch over every
    chunk's rows (the unsplit rate), in that chunk's backward."""
    req, p, m = s.req, s.profile, s.req.model
    n = req.ep_overlap_chunks
    if req.ep < 2:
        return (PassCost(expert_gemm=expert_s), PassCost(expert_gemm=expert_s),
                PassCost(expert_gemm=expert_s))
    if n == 1:
        calls = _ep_calls(s, tokens)
        return (PassCost(expert_gemm=expert_s, ep_comm=calls.dispatch + calls.combine),
                PassCost(expert_gemm=expert_s, ep_comm=calls.combine_grad + calls.dispatch_grad),
                PassCost(expert_gemm=expert_s))
    calls = _ep_calls(s, tokens / n)
    chunk_s = _gemm_s(2 * rows / n * m.d_model * 3 * m.expert_hidden,
                      expert_rate(p, rows / n / (m.n_experts // req.ep)))
    share = comm_sm_share(p, req.ep_comm_sms)
    extra = n - 1

    def overlapped(first: float, work: list[float], last: float, gemm: float,
                   kernels: int) -> PassCost:
        makespan = pipelined_layer_s(first, work, last, share)
        exposed = makespan - sum(work)
        return PassCost(expert_gemm=gemm, ep_comm=exposed,
                        ep_comm_hidden=n * (first + last) - exposed, kernels=kernels)

    fwd = overlapped(calls.dispatch, [chunk_s] * n, calls.combine, n * chunk_s,
                     extra * KERNELS_PER_CHUNK_FORWARD)
    if req.fused_grad_accumulation:  # one merged weight-gradient launch, in the last chunk
        work, weights = [chunk_s] * (n - 1) + [chunk_s + expert_s], expert_s
    else:
        work, weights = [2 * chunk_s] * n, n * chunk_s
    bwd = overlapped(calls.combine_grad, work, calls.dispatch_grad, n * chunk_s,
                     extra * KERNELS_PER_CHUNK_BACKWARD)
    return fwd, bwd, PassCost(expert_gemm=weights)


def paired_share(microbatches: int) -> float:
    """Share of a step's microbatches that run in interleaved pairs (``paired_microbatches``)."""
    return paired_microbatches(microbatches) / microbatches


def interleaved_exposed_s(calls: float, other: float, share: float) -> float:
    """Exposed seconds of one microbatch's EP calls in a block's pass (``calls``) that run
    on the communication stream under the other microbatch's compute of that pass
    (``other`` seconds at the full rate), which runs at ``1 - share`` of its rate while
    they do: the pair's compute stream takes ``2 other + share 2 calls`` where the calls
    fit under it, else the calls' ``2 calls`` pace the pass."""
    return max(share * calls, calls - other)


def _interleaved(cost: PassCost, other: float, share: float, paired: float) -> PassCost:
    """``cost`` with its exposed EP calls as ``paired`` of the microbatches interleave them."""
    calls = cost.ep_comm
    exposed = paired * interleaved_exposed_s(calls, other, share) + (1 - paired) * calls
    return replace(cost, ep_comm=exposed, ep_comm_hidden=cost.ep_comm_hidden + calls - exposed)


def comm_sm_share(profile: Profile, comm_sms: int | None) -> float:
    """Share of the SMs the EP communication stream takes while it runs beside the
    expert GEMMs: ``comm_sms`` of the GPU's (``parallel.ep_comm_sms``), else the
    profile's ``ep_comm_sm_share``."""
    if comm_sms is None:
        return profile.ep_comm_sm_share
    return min(1.0, comm_sms / profile.sm_count)


def pipelined_layer_s(first: float, work: list[float], last: float, share: float) -> float:
    """Makespan of ``moe_ep_transport.pipeline``'s two-stream schedule of ``len(work)``
    chunks: chunk ``c``'s ``first`` call (forward: dispatch; backward: the combine's
    gradient), its expert GEMMs (``work[c]`` seconds at the full rate), its ``last``
    call (forward: combine; backward: the dispatch's gradient).

    The communication stream runs its calls in issue order, ``F0, F1, then for c >= 1:
    F(c+1), L(c-1), ..., L(n-1)`` (the backward's order, the autograd engine's, is the
    same with the chunks reversed), each ``L(c)`` after the GEMMs of chunk ``c``; the
    compute stream runs ``X(c)`` after ``F(c)`` and ``X(c-1)``. While a call runs the
    GEMMs progress at ``1 - share`` of their rate; a call's own time does not depend on
    the SMs it gets (the link, not the SMs, paces it). An event-driven simulation,
    exact for these piecewise-constant rates."""
    n = len(work)
    order = [("first", 0)]
    for c in range(n):
        order += [("first", c + 1)] if c + 1 < n else []
        order += [("last", c - 1)] if c > 0 else []
    order.append(("last", n - 1))
    duration = {"first": first, "last": last}
    gemm_done: list[float | None] = [None] * n
    arrived: list[float | None] = [None] * n
    t, next_call, call_end = 0.0, 0, None  # the communication stream
    chunk, left, running = 0, 0.0, False  # the compute stream
    while True:
        if call_end is None and next_call < len(order):
            kind, c = order[next_call]
            if kind == "first" or gemm_done[c] is not None:
                call_end = t + duration[kind]
        if not running and chunk < n and arrived[chunk] is not None:
            running, left = True, work[chunk]
        if call_end is None and not running:
            return t
        rate = 1 - share if call_end is not None else 1.0
        gemm_end = t + left / rate if running and rate > 0 else math.inf
        now = min(call_end if call_end is not None else math.inf, gemm_end)
        if running:
            left -= (now - t) * rate
        t = now
        if call_end is not None and call_end <= t:
            kind, c = order[next_call]
            if kind == "first":
                arrived[c] = t
            next_call, call_end = next_call + 1, None
        if running and gemm_end <= t:
            gemm_done[chunk] = t
            chunk, running = chunk + 1, False


def fit_comm_sm_share(comm_s: float, experts_s: float, pipelined_s: float, chunks: int) -> float:
    """The ``Profile.ep_comm_sm_share`` under which ``pipelined_layer_s`` gives a measured
    pipelined layer: a row of ``tools/bench_ep_overlap.py`` (``comm_ms``: the ``chunks``
    dispatch + combine calls alone; ``comp_ms``: the chunks' expert GEMMs alone;
    ``pipelined_ms``), dispatch and combine taken as equal halves (the bench's source
    combine moves the same rows back). Clamped to [0, 1] where the measurement lies
    outside what any share gives; bisection (the makespan grows with the share)."""
    call, work = comm_s / (2 * chunks), [experts_s / chunks] * chunks
    lo, hi = 0.0, 1.0
    if pipelined_s <= pipelined_layer_s(call, work, call, lo):
        return lo
    if pipelined_s >= pipelined_layer_s(call, work, call, hi):
        return hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pipelined_layer_s(call, work, call, mid) < pipelined_s else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class _EPCalls:
    """Seconds of one MoE layer's four EP calls for a number of tokens."""

    dispatch: float
    combine: float
    combine_grad: float  # the output gradient, to the ranks that ran the experts
    dispatch_grad: float  # the input gradient, back to the token's rank


def _ep_calls(s: _Setup, tokens: float) -> _EPCalls:
    """The four EP calls of one MoE layer and ``tokens`` tokens.

    Dispatch sends a token once to each other rank holding one of its experts (in
    ``parallel.ep_payload``'s packed rows when it quantises them); the combine returns, summing at the destination, one FP32 partial per such (token,
    rank), else one row per routed slot; the backward calls move the same rows the
    other way (the output gradient in the compute dtype, the partials' gradient)."""
    from pretrain.planner.activations import _sums_at_destination

    m, req = s.req.model, s.req
    b, D, ep = s.ex.compute_bytes, m.d_model, req.ep
    reach = remote_reach(m.n_experts, m.top_k, ep) * s.routing_skew
    remote_slots = tokens * m.top_k * (ep - 1) / ep * s.routing_skew
    group = Group(ep, 1)
    eff = s.profile.ep_transport_efficiency

    def call(rows: float, row_bytes: int) -> float:
        return s.fabric.all_to_all(rows * row_bytes * ep / (ep - 1), group, eff)

    dispatch = call(tokens * reach, _dispatch_row_bytes(req.ep_payload, D, b))
    if _sums_at_destination(m, s.ex):
        return _EPCalls(dispatch, call(tokens * reach, FP32 * D), call(tokens * reach, b * D),
                        call(tokens * reach, FP32 * D))
    per_slot = call(remote_slots, b * D)
    return _EPCalls(dispatch, per_slot, per_slot, per_slot)


def _dispatch_row_bytes(payload: str, d_model: int, compute_bytes: int) -> int:
    """Bytes of one row the forward dispatch sends: the compute dtype's, or the packed
    width of ``parallel.ep_payload``'s codec (its scales included). The backward calls
    and the combine always move the compute dtype."""
    if payload == "compute":
        return compute_bytes * d_model
    from pretrain.config import EP_PAYLOAD_CODECS

    return EP_PAYLOAD_CODECS[payload]().packed_width(d_model)


def _edge_cost(s: _Setup, first: bool, last: bool) -> StageCost:
    m, p = s.req.model, s.profile
    T, D, V, b = s.ex.tokens, m.d_model, m.vocab_size, s.ex.compute_bytes
    mem = (3 * b * T * D if first else 0) + (3 * b * T * V + 4 * b * T * D if last else 0)
    head = 2 * T * D * V if last else 0
    mem_s = mem / (p.memory_gb_per_s * 1e9)
    kernels = KERNELS_PER_EDGE * (first + last) // 2
    head_s = _gemm_s(head, p.dense_gemm_tflops)
    fwd = PassCost(dense_gemm=head_s, memory_bound=mem_s / 3, kernels=kernels // 3)
    grads = PassCost(dense_gemm=head_s)
    return StageCost(fwd, PassCost(memory_bound=2 * mem_s / 3, kernels=kernels - kernels // 3)
                     + grads, grads)


def _with_launches(s: _Setup, cost: StageCost) -> StageCost:
    """A stage's microbatch with the device's idle time between kernels, and, eager, its
    wait for the host.

    Eager, nothing holds the host back between the forward and the backward of a
    microbatch, so its launches run ahead through both: the microbatch takes the longer
    of the host's time (``host_launch_us`` per kernel, the EP calls' own host waits
    included: their exposed part, what the compute stream waits for) and the device's;
    the excess is spread over the passes by their kernels."""
    p = s.profile
    gap = p.kernel_gap_us_graphs if s.cuda_graphs else p.kernel_gap_us_eager
    passes = (cost.forward, cost.backward_input, cost.backward_weight)
    gaps = [c.kernels * gap * 1e-6 for c in passes]
    kernels = sum(c.kernels for c in passes)
    if not s.cuda_graphs and kernels:
        busy = sum(c.device - c.launch for c in passes)
        host = kernels * p.host_launch_us * 1e-6 + sum(c.ep_comm for c in passes)
        wait = max(sum(gaps), host - busy)
        gaps = [wait * c.kernels / kernels for c in passes]
    return StageCost(*(replace(c, launch=g) for c, g in zip(passes, gaps, strict=True)))


def stage_costs(s: _Setup, stage_layers: list[tuple[int, ...]]) -> list[StageCost]:
    n = len(stage_layers)
    costs = []
    for index, layers in enumerate(stage_layers):
        total = _edge_cost(s, index == 0, index == n - 1)
        for layer in layers:
            c = _block_cost(s, layer)
            total = StageCost(total.forward + c.forward, total.backward_input + c.backward_input,
                              total.backward_weight + c.backward_weight)
        costs.append(_with_launches(s, total))
    return costs


@functools.lru_cache(maxsize=512)
def _pipeline_ratio(schedule: str, pp: int, virtual: int, microbatches: int,
                    f: int, b: int, w: int) -> tuple[float, float]:
    """(makespan, busiest rank's busy time) of moe_pp's simulated schedule, in ticks."""
    from moe_pp import Costs, make_schedule, simulate

    timeline = simulate(make_schedule(schedule, pp, virtual, microbatches), Costs(F=f, B=b, W=w))
    return float(timeline.makespan), float(max(timeline.busy(r) for r in range(pp)))


PIPELINE_TICKS = 8  # ticks of the simulated schedule's longest action


def pipeline_bubble(schedule: str, pp: int, virtual: int, microbatches: int,
                    forward: float, backward_input: float, backward_weight: float) -> float:
    """Idle share of the makespan of moe_pp's schedule simulated with these costs (the
    longest action quantised to ``PIPELINE_TICKS``); 0 without a pipeline."""
    if pp < 2:
        return 0.0
    split = schedule == "zero_bubble"
    longest = max(forward, backward_input + (0 if split else backward_weight),
                  backward_weight if split else 0)
    tick = longest / PIPELINE_TICKS

    def ticks(x: float) -> int:
        return max(1, round(x / tick))

    if split:
        f, b, w = ticks(forward), ticks(backward_input), ticks(backward_weight)
    else:  # a full backward costs B + W in the simulator
        full = ticks(backward_input + backward_weight)
        f, b, w = ticks(forward), max(1, full // 2), max(1, full - full // 2)
    makespan, busy = _pipeline_ratio(schedule, pp, virtual, microbatches, f, b, w)
    return 1 - busy / makespan


def _owned(p: HeldParam, group: int) -> int:
    return p.numel // group if group > 1 and is_sharded(p.numel, group, MIN_SHARD_NUMEL) \
        else p.numel


def _grad_sync(s: _Setup, params: list[HeldParam]) -> tuple[float, float, float]:
    """(reduction seconds, its last bucket's seconds, weight all-gather seconds)."""
    req = s.req
    cap = req.bucket_cap_mb * 2**20
    per_kind: dict[tuple[str, str], float] = {}
    gather: dict[str, float] = {}
    for p in params:
        group = req.dp if p.kind == "dense" else req.dp // req.ep
        if group < 2:
            continue
        sharded = is_sharded(p.numel, group, MIN_SHARD_NUMEL)
        collective = "reduce_scatter" if req.ddp_mode == "reduce_scatter" and sharded \
            else "all_reduce"
        key = (p.kind, collective)
        per_kind[key] = per_kind.get(key, 0.0) + FP32 * p.numel
        if sharded:
            gather[p.kind] = gather.get(p.kind, 0.0) + COMPUTE_BYTES[req.compute_dtype] * p.numel
    groups = {"dense": Group(req.dp, 1), "expert": Group(req.dp // req.ep, req.ep)}
    total = last = 0.0
    for (kind, collective), nbytes in per_kind.items():
        buckets = max(1, math.ceil(nbytes / cap))
        run = s.fabric.all_reduce if collective == "all_reduce" else s.fabric.reduce_scatter
        one = run(nbytes / buckets, groups[kind])
        total += buckets * one
        last = max(last, one)
    gathered = sum(s.fabric.all_gather(n, groups[kind]) for kind, n in gather.items())
    return total, last, gathered


def _optimizer_s(s: _Setup, params: list[HeldParam]) -> tuple[float, float]:
    """(optimizer seconds, weight rebuild's local seconds) of one rank."""
    req, p = s.req, s.profile
    owned = rebuilt = 0
    ns_flops = 0.0
    for param in params:
        group = req.dp if param.kind == "dense" else req.dp // req.ep
        own = _owned(param, group)
        owned += own
        # an FP32 weight held whole is its own main weight: nothing to rebuild (moe_optim);
        # a low-precision expert kept FP32 is cast to BF16 for its caches instead, as many bytes
        rebuilt += 0 if s.ex.param_bytes == 4 and own == param.numel else own
        if req.optimizer == "muon" and len(param.shape) >= 2 and not param.name.startswith(
                ("embed", "head")):
            rows, cols = param.shape[-2], param.shape[-1]
            a, c = min(rows, cols), max(rows, cols)
            batch = own / (rows * cols)
            ns_flops += batch * NEWTON_SCHULZ_STEPS * (4 * a * a * c + 2 * a ** 3)
    bw = p.memory_gb_per_s * 1e9
    optimizer = owned * OPTIMIZER_BYTES / bw + _gemm_s(ns_flops, p.dense_gemm_tflops)
    return optimizer, rebuilt * REBUILD_BYTES / bw


def _accumulation_bytes(req: PlanRequest, params: list[HeldParam]) -> float:
    """Bytes per microbatch of adding weight gradients to the FP32 main grads.

    Fused (CUDA): the GEMMs read and write the main grad (8 B per element), the expert
    weight gradients once per ``merge_expert_grads`` microbatches, the embedding only
    at the rows seen; else a BF16 gradient is added to it by a separate pass."""
    expert = sum(p.numel for p in params if p.kind == "expert")
    dense = sum(p.numel for p in params if p.kind == "dense" and not p.name.startswith("embed"))
    if req.fused_grad_accumulation:
        return 2 * FP32 * (expert / req.merge_expert_grads + dense)
    return UNFUSED_ACCUMULATION_BYTES * (expert + dense)


def _pp_crossings(req: PlanRequest, gpus_per_node: int) -> int:
    """Stage boundaries of the first pipeline (ranks 0, dp, 2dp, ...) crossing a node."""
    ranks = Group(req.pp, req.dp).ranks()
    return sum(1 for a, b in zip(ranks, ranks[1:], strict=False)
               if a // gpus_per_node != b // gpus_per_node)


def _refuse_low_precision_experts(req: PlanRequest) -> None:
    """The model times BF16 (or FP32) expert GEMMs only: a request whose ``mxfp8.targets``
    reach routed experts is refused, not predicted as if they ran in the compute dtype.

    Why not modelled: on one H200 the FP8 step's gains and losses are not the GEMM
    benchmark's ratios. At commit aad7336 ``fp8_rowwise_gw_hp`` ran 1.07x BF16 at the layer
    (``tools/bench_fp8_experts.py``) and 0.96x in the ``bench-1gpu`` step
    (``tools/bench_train_step.py``); fast accumulation in the input gradients moved the
    step by 148 ms where the same commit's GEMM rates (900 against 1,039 TFLOP/s) predict
    36 of the model's 340 ms of input-gradient GEMMs. Emulated MXFP8 and emulated FP8 run
    FP32 matmuls. A time for them needs per-role rates measured inside the step."""
    hit = req.low_precision_expert_layers
    if hit:
        raise ValueError(
            f"the step-time model times experts in the compute dtype only: mxfp8.targets="
            f"{list(req.mxfp8_targets)} makes the experts of {len(hit)} layers run mxfp8.recipe="
            f"{req.mxfp8_recipe} (gemm={req.mxfp8_gemm}), not modelled; plan without --time "
            f"for their memory, or measure with tools/bench_train_step.py")


def predict_step(req: PlanRequest, profile: Profile, gpus_per_node: int = 8,
                 cuda_graphs: bool = False, routing_skew: float = 1.0,
                 shapes: ModelShapes | None = None) -> StepTime:
    """Predict one optimizer step of ``req`` on GPUs described by ``profile``.

    ``routing_skew``: the busiest EP rank's routed rows over the mean (1: balanced);
    ``cuda_graphs``: the microbatches replayed from graphs (``train.cuda_graphs``)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    if not (math.isfinite(routing_skew) and routing_skew >= 1):
        raise ValueError(f"routing_skew must be >= 1, got {routing_skew}")
    m: MoEConfig = req.model
    _refuse_low_precision_experts(req)
    shapes = shapes or ModelShapes(m)
    b = COMPUTE_BYTES[req.compute_dtype]
    ex = Execution(micro_batch=req.micro_batch, seq_len=req.seq_len, compute_bytes=b,
                   param_bytes=b, ep=req.ep, ep_backend=req.ep_backend, ep_combine=req.ep_combine,
                   dense_grads_in_gemm=req.fused_grad_accumulation)
    fabric = Fabric(profile.links["nvlink"], profile.links["network"], gpus_per_node)
    s = _Setup(req, profile, fabric, cuda_graphs, routing_skew, ex)
    stage_layers = shapes.stage_layers(req.pp, req.virtual, req.pp_split, req.seq_len)
    n_stages = len(stage_layers)
    costs = stage_costs(s, stage_layers)
    mb = req.microbatches

    # per pipeline rank: its stages' work per microbatch, and its parameters
    ranks = []
    for rank in range(req.pp):
        own = list(range(rank, n_stages, req.pp))
        total = PassCost()
        for st in own:
            total = total + costs[st].total
        layers = tuple(layer for st in own for layer in stage_layers[st])
        params = shapes.held(layers, 0 in own, n_stages - 1 in own, req.ep)
        total = total + PassCost(memory_bound=_accumulation_bytes(req, params)
                                 / (profile.memory_gb_per_s * 1e9))
        ranks.append((total, params, own))

    busiest = max(range(req.pp), key=lambda r: ranks[r][0].device)
    work, params, own = ranks[busiest]
    busy = mb * work.device
    if req.pp > 1:
        slow = [max(costs[st].forward.device for st in range(n_stages)),
                max(costs[st].backward_input.device for st in range(n_stages)),
                max(costs[st].backward_weight.device for st in range(n_stages))]
        bubble_share = pipeline_bubble(req.schedule, req.pp, req.virtual, mb, *slow)
        bubble = busy * bubble_share / (1 - bubble_share)
        crossings = _pp_crossings(req, gpus_per_node)
        message = b * ex.tokens * m.d_model
        boundaries = n_stages - 1
        # the fill and the drain wait on one send per boundary each way; a boundary
        # between nodes is on the network
        p2p = 2 * (crossings * fabric.send(message, True)
                   + (boundaries - crossings) * fabric.send(message, False))
        sends = mb * (2 * len(own) - (0 in own) - (n_stages - 1 in own))
        p2p_total = sends * fabric.send(message, crossings > 0)
    else:
        bubble = p2p = p2p_total = 0.0

    sync, last_bucket, gather = _grad_sync(s, params)
    if req.pp == 1:  # buckets launch during the last microbatch's backward
        sync_exposed = max(last_bucket, sync - costs[0].backward.device) if sync else 0.0
    else:
        sync_exposed = sync
    optimizer, rebuild_local = _optimizer_s(s, params)

    compute = {"expert_gemm": mb * work.expert_gemm, "dense_gemm": mb * work.dense_gemm,
               "attention": mb * work.attention, "memory_bound": mb * work.memory_bound,
               "launch_gaps": mb * work.launch, "optimizer": optimizer,
               "weight_rebuild": rebuild_local}
    comm = {"ep_all_to_all": mb * (work.ep_comm + work.ep_comm_hidden), "dp_grad_sync": sync,
            "weight_all_gather": gather, "pp_sends": p2p_total}
    exposed = {"ep_all_to_all": mb * work.ep_comm, "dp_grad_sync": sync_exposed,
               "weight_all_gather": gather, "pp_sends": p2p}
    compute_s = sum(compute.values())
    exposed_s = sum(exposed.values())
    step = compute_s + exposed_s + bubble
    tokens = req.global_batch * req.seq_len
    mfu = flops_per_token(m, req.seq_len) * tokens / step / req.world / (profile.peak_tflops * 1e12)
    return StepTime(req, profile.name, cuda_graphs, gpus_per_node, step, compute_s, exposed_s,
                    bubble, compute, comm, exposed, mfu)
