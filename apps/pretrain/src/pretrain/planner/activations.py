"""What one microbatch keeps in memory, tensor by tensor, as our implementation runs it.

Shape legend: B micro batch, S sequence, T = B*S tokens, D d_model, H query heads,
Q = H*Dh and KV = K*Dh the query and key/value widths, E experts (all), k top_k,
N = T*k routed slots, R rows the experts run on (N when dropless and local, the
capacity otherwise), F expert hidden, Fs shared hidden, Fd dense hidden, V vocab,
b bytes of a compute element (2 for BF16).

Each block is an inventory of named tensors with their bytes, read off the code
of moe_model (and moe_ep_transport, moe_mxfp8 where they replace a piece) and
checked against measurements (``pretrain.planner.measure.LiveBytes``, CPU tests):

- ``saved``: what autograd keeps from the forward to the backward without
  recompute, including tensors custom ``autograd.Function``s keep as context
  attributes (``ctx``: the dispatch index vectors and route plans), which stay
  even under recompute;
- ``selective``: outputs of the operators selective recompute keeps (GEMMs and
  attention, moe_model.recompute);
- ``fwd_live``: what else is alive at the forward's high-water mark (the residual
  stream, Python locals, the FP32 combine's temporaries);
- backward moments, in execution order: what is freed by then and which
  temporaries (gradients, the FP32 combine's) and weight gradients are alive.

Zero bubble splits the backward (``moe_pp.backward``): an input pass that keeps the
whole graph (nothing saved is freed until the weight pass) and captures, at each
weight's GEMM (or norm gain), the output gradient its weight gradient reads (the
"dy operands"), then a weight pass that forms the weight gradients from them. A
moment also names the dy operands captured there (``captured``) and which of its
tensors are weight gradients (``wgrad``: the weight pass's, absent from the input
pass); ``split_only`` moments (the expert and projection GEMMs, the norms' backward)
only matter when nothing is freed on the way, and are left out of the ordinary
backward's high-water mark, which they were validated without.

Sets make overlaps explicit (a tensor both saved and alive is counted once).
The router runs in FP32 and keeps an FP32 copy of its input (see ``_router`` for the
exceptions).

``kernels`` selects the device-specific paths. CUDA: moe_model's fused Triton
RMSNorm (keeps its input and rstd), SwiGLU gating (keeps its two inputs, not
silu(gate)), combine (no FP32 temporaries) and cross-entropy (no FP32 logits), and
the SDPA backward's temporaries, an FP32 accumulator for dQ and, with GQA, expanded
dK/dV (flash attention's; cuDNN's measured the same saved tensors and backward peak
on an H200, ``tools/bench_attention.py``). CPU: the eager forms (RMSNorm keeps an FP32 copy of its input,
FP32 combine and cross-entropy temporaries) and an attention kernel that allocates
neither (as tensors PyTorch can see).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from moe_model import MoEConfig

FP32 = 4
INDEX = 8  # int64 index tensors
OFFSET = 4  # int32 group offsets

Kernels = Literal["cuda", "cpu"]
EPBackend = Literal["local", "all_to_all", "rowwise"]


@dataclass(frozen=True)
class Execution:
    """How a microbatch runs: everything besides the model shape that sets its bytes."""

    micro_batch: int  # B: sequences per microbatch
    seq_len: int  # S
    compute_bytes: int = 2  # b: BF16 activations and compute weights
    param_bytes: int = 2  # parameters are held in the compute dtype (the DDP path)
    ep: int = 1  # EP-MP ranks splitting each MoE layer's experts
    ep_backend: EPBackend = "local"  # local dispatch, all-to-all, or rowwise (NVSHMEM puts)
    ep_combine: str = "auto"  # where the EP combine sums (moe_ep_transport.EPConfig.combine)
    mxfp8_expert_layers: frozenset[int] = frozenset()  # layers whose experts run moe_mxfp8's GEMMs
    mxfp8_save_activations: bool = False  # MXFP8 layers keep their saved tensors in MXFP8
    mxfp8_recipe: str = "mxfp8"  # moe_mxfp8.MXFP8Config.recipe of those layers
    mxfp8_gemm: str = "emulated"  # moe_mxfp8.MXFP8Config.gemm: emulated | native | triton
    # dense Linear modules (the model's names, e.g. "blocks.0.attn.wq", "head") that run
    # moe_mxfp8.FP8Linear: mxfp8_recipe is an FP8 recipe, on fp8_dense_gemm
    fp8_linears: frozenset[str] = frozenset()
    fp8_dense_gemm: str = "emulated"  # moe_mxfp8.MXFP8Config.resolved_dense_gemm
    # the trainer wires moe_model's gradient sink (parallel.fuse_grad_accumulation): FP8
    # experts hand it their weight gradients on every device
    expert_grad_sink: bool = False
    kernels: Kernels = "cuda"
    # dense weight gradients added to the FP32 main grads by the GEMM itself (moe_model's
    # gradient sink: CUDA with parallel.fuse_grad_accumulation): no BF16 [out, in]
    # gradient exists between the GEMM and the DDP hook
    dense_grads_in_gemm: bool = False
    # dense weights (parameter names) whose in-GEMM gradient is formed as an FP32 [out, in]
    # temporary first (moe_model.linear.dense_grad_accumulate_: an owner-major bucket piece
    # that is not whole rows; ``persistent.fp32_dense_wgrads``)
    fp32_dense_wgrads: frozenset[str] = frozenset()

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


@dataclass
class Moment:
    """A point of a block's backward."""

    freed: set[str]  # saved tensors the backward's earlier steps freed (kept under a split)
    temps: set[str]  # gradients and other temporaries alive then
    wgrad: set[str] = field(default_factory=set)  # weight gradients alive then
    captured: set[str] = field(default_factory=set)  # dy operands a split input pass keeps from here on
    split_only: bool = False  # a candidate only for the split backward's high-water marks


@dataclass
class Inventory:
    """Named tensors of one block (or stage edge) and the roles they play."""

    sizes: dict[str, int] = field(default_factory=dict)
    saved: set[str] = field(default_factory=set)
    ctx: set[str] = field(default_factory=set)
    selective: set[str] = field(default_factory=set)
    fwd_live: set[str] = field(default_factory=set)
    bwd_moments: list[Moment] = field(default_factory=list)  # in execution order

    def add(self, name: str, nbytes: int, *roles: str) -> None:
        """Register ``name`` (``nbytes``) in each role set named (``saved``, ``ctx``, ...)."""
        if name in self.sizes and self.sizes[name] != nbytes:
            raise ValueError(f"tensor {name!r} registered with {self.sizes[name]} and "
                             f"{nbytes} bytes")
        self.sizes[name] = nbytes
        for role in roles:
            getattr(self, role).add(name)

    def bytes(self, names: Iterable[str]) -> int:
        return sum(self.sizes[n] for n in set(names))

    def kept(self, recompute: str) -> set[str]:
        """Tensors held from the forward until the block's backward, under ``recompute``."""
        if recompute == "none":
            return self.saved | self.ctx
        keep = self.ctx | {"input"}  # the checkpoint keeps the block input
        return keep | self.selective if recompute == "selective" else keep

    def held(self, recompute: str) -> int:
        return self.bytes(self.kept(recompute))

    def forward_peak(self, recompute: str) -> int:
        """High-water mark of this block's forward, the block input included."""
        return self.bytes(self.kept(recompute) | self.fwd_live | {"input"})

    def moment(self, freed: Iterable[str], temporaries: Iterable[str], wgrad: Iterable[str] = (),
               captured: Iterable[str] = (), split_only: bool = False) -> None:
        """A point of the backward: what its earlier steps freed, what is alive only then
        (``wgrad``: the weight gradients among it), the dy operands a split input pass
        captures there (see the module docstring)."""
        self.bwd_moments.append(Moment(set(freed), set(temporaries), set(wgrad), set(captured),
                                       split_only))

    def backward_peak(self, recompute: str) -> int:
        """High-water mark of this block's backward: what the backward still reads plus
        the temporaries of each moment. Recompute replays the forward first (selective
        recompute hands its cached outputs to the replay, which frees those nothing
        saves), so the replay's own high-water mark is a candidate too."""
        full = self.saved | self.ctx | ({"input"} if recompute != "none" else set())
        peak = max(self.bytes((full - m.freed) | m.temps | m.wgrad)
                   for m in self.bwd_moments if not m.split_only)
        if recompute != "none":
            peak = max(peak, self.bytes(full | self.fwd_live | {"grad_out"}))
        return peak

    # The split backward (zero bubble; no recompute: the app refuses it there). Nothing
    # saved is freed before the weight pass, so every pass sees ``saved | ctx`` whole.

    def deferred(self) -> int:
        """Bytes of the dy operands the input pass keeps for the weight pass."""
        return self.bytes(set().union(*(m.captured for m in self.bwd_moments)))

    def input_pass_peak(self) -> int:
        """High-water mark of this block in a split input pass: everything saved, the dy
        operands captured so far, each moment's temporaries without weight gradients."""
        kept, captured, peak = self.saved | self.ctx, set(), 0
        for m in self.bwd_moments:
            captured |= m.captured
            peak = max(peak, self.bytes(kept | m.temps | captured))
        return peak

    def retained_backward_peak(self) -> int:
        """High-water mark of this block in one whole backward that keeps the graph (a
        first stage's weight pass: it has no input gradient, so no input pass)."""
        kept = self.saved | self.ctx
        return max(self.bytes(kept | m.temps | m.wgrad) for m in self.bwd_moments)

    def weight_pass_temporaries(self) -> int:
        """The largest weight-gradient temporaries of this block in a weight pass (one
        weight at a time; the DDP hook frees each)."""
        return max((self.bytes(m.wgrad) for m in self.bwd_moments), default=0)


def _norm(inv: Inventory, prefix: str, rows: int, width: int, ex: Execution, out_saved: bool,
          input_name: str) -> None:
    """moe_model's RMSNorm. Eager (CPU): an FP32 copy of x, rstd, the BF16 normalised x
    (for the gain's gradient). Fused (CUDA): the input itself (``input_name``, the
    tensor it aliases) and rstd. The output is kept only when a GEMM consumes it."""
    b = ex.compute_bytes
    inv.add(f"{prefix}.rstd", FP32 * rows, "saved")
    if ex.kernels == "cuda":
        inv.saved.add(input_name)
    else:
        inv.add(f"{prefix}.x32", FP32 * rows * width, "saved")
        inv.add(f"{prefix}.xn", b * rows * width, "saved")
    inv.add(f"{prefix}.out", b * rows * width, *(("saved",) if out_saved else ()))


def _norm_backward(inv: Inventory, prefix: str, rows: int, width: int, ex: Execution,
                   captured: Iterable[str] = ()) -> None:
    """A norm's backward, as a split input pass sees it (``split_only``): the gain's dy
    operand (the output gradient) is captured; eager (CPU), the autograd graph's FP32
    temporaries, five [rows, width] at once (measured); fused (CUDA), dx. ``captured``:
    more dy operands captured by then (the router's, between the experts and this norm)."""
    b = ex.compute_bytes
    inv.add(f"{prefix}.dy", b * rows * width)
    inv.add(f"{prefix}.bwd", (b if ex.kernels == "cuda" else 5 * FP32) * rows * width)
    inv.moment((), {"grad_out", f"{prefix}.bwd"}, captured={f"{prefix}.dy", *captured},
               split_only=True)


def _dense_wgrad(inv: Inventory, ex: Execution, param: str, name: str, n_out: int,
                 n_in: int) -> set[str]:
    """The weight-gradient temporary of dense ``Linear`` ``param`` ([n_out, n_in]): autograd's
    [out, in] gradient in the compute dtype (freed by the DDP hook), nothing when the GEMM
    adds it to the main grad (``dense_grads_in_gemm``), or there an FP32 [out, in] first
    when the bucket piece is not whole rows (``fp32_dense_wgrads``)."""
    if not ex.dense_grads_in_gemm:
        inv.add(name, ex.compute_bytes * n_out * n_in)
        return {name}
    if param in ex.fp32_dense_wgrads:
        inv.add(f"{name}32", FP32 * n_out * n_in)
        return {f"{name}32"}
    return set()


def _shared_input_moments(inv: Inventory, freed: set[str], temps: set[str], dx: str,
                          dx_bytes: int, summed: bool, wgrad: set[str], captured: set[str],
                          split_only: bool) -> None:
    """The backward of GEMMs sharing one input (q, k, v; gate and up): with their output
    gradients (``temps``) alive, each forms its weight gradient (``wgrad``) beside its input
    gradient ``dx`` ([rows, in], ``dx_bytes``); ``summed``: two such results and their sum
    are alive next (separate GEMMs, autograd adds them), else one GEMM adds into the other's."""
    inv.add(dx, dx_bytes)
    inv.moment(freed, temps | {dx}, wgrad, captured=captured, split_only=split_only)
    if summed:
        inv.add(f"{dx}_sum", 2 * dx_bytes)
        inv.moment(freed, temps | {dx, f"{dx}_sum"}, split_only=True)


def _attention(inv: Inventory, cfg: MoEConfig, ex: Execution, layer: int) -> None:
    """Projections, QK-norm, RoPE, SDPA (keeps q, k, v, out and the log-sum-exp).

    Projections that run ``moe_mxfp8.FP8Linear`` (``ex.fp8_linears``: the output
    projection, or q, k and v together): their backward as ``_fp8_linears_backward``
    runs it. Their forward's E4M3 copy of the input lives only through the GEMMs, before
    the block holds its MLP's tensors, and is not planned (``memory.not_modelled``)."""
    T, b, D = ex.tokens, ex.compute_bytes, cfg.d_model
    H, Dh = cfg.n_heads, cfg.head_dim
    Q, KV = H * Dh, cfg.n_kv_heads * Dh
    _norm(inv, "attn_norm", T, D, ex, out_saved=True, input_name="input")
    inv.add("attn.q_proj", b * T * Q, "selective")
    inv.add("attn.k_proj", b * T * KV, "selective")
    inv.add("attn.v", b * T * KV, "saved", "selective")
    if cfg.qk_norm:
        for name, heads in (("q", H), ("k", cfg.n_kv_heads)):
            _norm(inv, f"attn.{name}_norm", T * heads, Dh, ex, out_saved=False,
                  input_name=f"attn.{name}_proj")
    # RoPE's cos/sin tables (FP32 [S, Dh]) are built once and shared by all layers: not per layer.
    inv.add("attn.q_rope", b * T * Q, "saved")
    inv.add("attn.k_rope", b * T * KV, "saved")
    inv.add("attn.out", b * T * Q, "saved", "selective")
    inv.add("attn.lse", FP32 * T * H, "saved", "selective")
    inv.add("attn.wo_out", b * T * D, "selective")
    inv.add("attn.d_out", b * T * Q)
    inv.add("attn.dq", b * T * Q)
    inv.add("attn.dkv", 2 * b * T * KV)
    temps = {"grad_out", "attn.d_out", "attn.dq", "attn.dkv"}
    if ex.kernels == "cuda":
        inv.add("attn.dq_accum", FP32 * T * Q)  # the SDPA backward's FP32 dQ accumulator
        temps.add("attn.dq_accum")
        if cfg.n_kv_heads != H:
            inv.add("attn.dkv_expanded", 2 * b * T * Q)  # dK/dV per query head, then summed
            temps.add("attn.dkv_expanded")
    mlp = {n for n in inv.sizes if not n.startswith(("attn", "input", "grad_out"))}
    # The output projection's backward first: its dy operand is the residual gradient
    # ("grad_out" stands for it from here on); a moment of the ordinary backward only where
    # its weight gradient is an FP32 temporary.
    param = f"blocks.{layer}.attn"
    if f"{param}.wo" in ex.fp8_linears:
        dw_o = _fp8_linear_wgrad(inv, ex, f"{param}.wo.weight", "attn.dw_o", D, Q, T)
        _fp8_linears_backward(inv, "attn.wo", ex, T, Q, [("out", D, dw_o)], "attn.d_out", mlp,
                              {"grad_out"}, {"grad_out"})
    else:
        dw_o = _dense_wgrad(inv, ex, f"{param}.wo.weight", "attn.dw_o", D, Q)
        inv.moment(mlp, {"grad_out", "attn.d_out"}, dw_o, captured={"grad_out"},
                   split_only=not dw_o or not ex.dense_grads_in_gemm)
    inv.moment(mlp, temps)  # runs after the MLP's backward has freed its tensors
    # q, k and v projections: their output gradients are the dy operands (and the QK-norm
    # gains' before them); the input gradient of the three; one weight gradient at a time
    inv.add("attn.dqkv", b * T * (Q + 2 * KV))
    captured = {"attn.dqkv"}
    if cfg.qk_norm:
        inv.add("attn.dqk_norm", b * T * (Q + KV))
        captured.add("attn.dqk_norm")
    projections_only = {n for n in inv.sizes if not n.startswith(("attn_norm", "input", "grad_out"))}
    qkv = (("wq", Q), ("wk", KV), ("wv", KV))
    if all(f"{param}.{name}" in ex.fp8_linears for name, _ in qkv):  # one shared-input function
        outputs = [(name, n_out, _fp8_linear_wgrad(inv, ex, f"{param}.{name}.weight", f"attn.dw_{name}",
                                                    n_out, D, T)) for name, n_out in qkv]
        _fp8_linears_backward(inv, "attn.qkv", ex, T, D, outputs, "attn.dx_qkv", projections_only,
                              {"grad_out", "attn.dqkv"}, captured)
    else:
        dw_qkv: set[str] = set()
        for name, n_out in qkv:
            dw = _dense_wgrad(inv, ex, f"{param}.{name}.weight", f"attn.dw_{name}", n_out, D)
            if dw and inv.bytes(dw) > inv.bytes(dw_qkv):
                dw_qkv = dw
        _shared_input_moments(inv, projections_only, {"grad_out", "attn.dqkv"}, "attn.dx_qkv",
                              b * T * D, not ex.dense_grads_in_gemm, dw_qkv, captured,
                              split_only=not dw_qkv or not ex.dense_grads_in_gemm)
    _norm_backward(inv, "attn_norm", T, D, ex)


def _router(inv: Inventory, cfg: MoEConfig, ex: Execution) -> None:
    """FP32 router: logits, scores, top-k. The logits GEMM keeps FP32 copies of its
    operands (x32 @ w32), except on CUDA with BF16 x and w (``moe_model.router.router_logits``),
    where it keeps the BF16 x (the MLP norm's output) and w, and in FP32 compute, where
    the "copies" are x (the MLP norm's output) and w themselves. Whenever a loss
    coefficient is nonzero the auxiliary losses are in the graph, and the z-loss term
    keeps the logits."""
    T, D, E, k = ex.tokens, cfg.d_model, cfg.n_experts, cfg.top_k
    aux = cfg.lb_loss_coef > 0 or cfg.z_loss_coef > 0
    if ex.kernels == "cuda" and ex.compute_bytes == ex.param_bytes == 2:  # BF16 (the planner's 2-byte dtype)
        inv.saved.add("mlp_norm.out")
    elif ex.compute_bytes == FP32:  # x.float() is x itself: the GEMM keeps the MLP norm's output
        inv.saved.add("mlp_norm.out")
    else:
        inv.add("router.x32", FP32 * T * D, "saved")
        if ex.param_bytes != FP32:
            inv.add("router.w32", FP32 * E * D, "saved")
    inv.add("router.logits", FP32 * T * E, "selective", *(("saved",) if aux else ()))
    inv.add("router.scores", FP32 * T * E, "saved", "fwd_live")
    if cfg.router_score == "sigmoid":
        inv.add("router.score_sum", FP32 * T, "saved")
        inv.add("router.probs", FP32 * T * E, "fwd_live")
    inv.add("router.lse", FP32 * T, *(("saved",) if aux else ()))
    inv.add("router.topk_ids", INDEX * T * k, "saved", "fwd_live")
    inv.add("router.weights", FP32 * T * k, "saved", "fwd_live")
    if cfg.norm_topk_weights:
        inv.add("router.weight_sum", FP32 * T, "saved")
        inv.add("router.weights_normed", FP32 * T * k, "saved", "fwd_live")
    if cfg.lb_loss_coef > 0:
        inv.add("router.lb_weight", FP32 * E, "ctx")


def local_rows(cfg: MoEConfig, tokens: int) -> int:
    """Rows the local dispatcher hands the experts: all slots, or E * capacity."""
    n = tokens * cfg.top_k
    if cfg.capacity_factor is None:
        return n
    return min(n, cfg.n_experts * max(1, math.ceil(cfg.capacity_factor * n / cfg.n_experts)))


def ep_capacity(cfg: MoEConfig, tokens: int, ep: int) -> int:
    """Rows one EP rank receives per call (moe_ep_transport.EPConfig.rank_capacity)."""
    slots = tokens * cfg.top_k
    if cfg.capacity_factor is None:
        return ep * slots
    return min(ep * slots, max(1, math.ceil(cfg.capacity_factor * slots)))


def _rowwise_fp8_experts(ex: Execution, layer: int) -> bool:
    """Whether ``layer``'s experts run an FP8 recipe with one scale per row of ``dy``."""
    if layer not in ex.mxfp8_expert_layers or ex.mxfp8_recipe == "mxfp8":
        return False
    from moe_mxfp8 import FP8_RECIPES

    return FP8_RECIPES[ex.mxfp8_recipe].act_block == (1, 0)


def _local_dispatch(inv: Inventory, cfg: MoEConfig, ex: Execution, R: int, encoded: bool) -> None:
    """moe_model.LocalDispatcher: index vectors on the handle (ctx); the combine keeps
    rows_out and w. Eager (CPU): ``bmm(w, rows_out[row_of_slot].float())`` with its
    FP32 temporaries both ways. Fused (CUDA): the FP32 sum stays in registers; the
    backward writes d_rows and the weights' gradient directly, and, dropless, for
    experts of a rowwise FP8 recipe (``encoded``) d_rows' E4M3 codes and scales too
    (``moe_model.row_encoding``), which the experts' backward then holds as its dy's."""
    T, D, E, b = ex.tokens, cfg.d_model, cfg.n_experts, ex.compute_bytes
    N = T * cfg.top_k
    if cfg.capacity_factor is None:
        inv.add("dispatch.slot_of_row", INDEX * N, "ctx")
        inv.add("dispatch.token_of_row", INDEX * N, "ctx")
    else:
        inv.add("dispatch.slot_of_row", INDEX * (R + 1), "ctx")  # a view of R + 1 entries
        inv.add("dispatch.token_of_row", INDEX * R, "ctx")
        inv.add("dispatch.kept_of_slot", FP32 * N, "ctx")
        inv.add("dispatch.valid_rows", R, "ctx")
        inv.add("combine.weights", FP32 * N, "saved")  # weights * kept
    inv.add("dispatch.row_of_slot", INDEX * N, "ctx")
    inv.add("dispatch.dropped", INDEX * E, "ctx")
    inv.add("dispatch.offsets", OFFSET * E, "saved", "fwd_live")
    inv.add("dispatch.rows", b * R * D, "saved", "fwd_live")
    inv.add("combine.d_weights", FP32 * N)
    if ex.kernels == "cuda":
        inv.add("combine.y", b * T * D, "fwd_live", "selective")
        inv.add("combine.d_rows", b * R * D)
        backward = {"grad_out", "combine.d_rows", "combine.d_weights"}
        if encoded and cfg.capacity_factor is None:
            from moe_mxfp8.fp8 import fp8_nbytes

            inv.add("combine.d_rows_q", fp8_nbytes((R, D), (1, 0)))
            backward.add("combine.d_rows_q")
        inv.moment((), backward)
        return
    inv.add("combine.gathered", b * N * D, "fwd_live")
    inv.add("combine.gathered32", FP32 * N * D, "fwd_live")
    inv.add("combine.y32", FP32 * T * D, "fwd_live", "selective")
    inv.add("combine.dy32", FP32 * T * D)
    inv.add("combine.d_rows32", FP32 * N * D)
    inv.moment((), {"grad_out", "combine.dy32", "combine.d_rows32", "combine.gathered",
                    "combine.gathered32", "combine.d_weights"})


def _sums_at_destination(cfg: MoEConfig, ex: Execution) -> bool:
    """Where the EP combine sums a token's contributions (moe_ep_transport's "auto" rule)."""
    from moe_ep_transport import EPConfig

    ep_cfg = EPConfig(n_experts=cfg.n_experts, top_k=cfg.top_k, max_tokens=ex.tokens, d_model=cfg.d_model,
                      capacity_factor=cfg.capacity_factor, combine=ex.ep_combine)
    D = cfg.d_model
    return ep_cfg.sums_at_destination(ex.ep, ex.compute_bytes * D, FP32 * D)


def _ep_dispatch(inv: Inventory, cfg: MoEConfig, ex: Execution, C: int) -> None:
    """moe_ep_transport.EPDispatcher: the route plan lives on the autograd context.

    Summing at the source, the combine keeps the gathered rows [N, D] (for the weights'
    gradient) and w [N]; summing at the destination it keeps the expert output (already
    counted by the experts) and the weights of the receive rows [C], and its backward
    receives the output gradient per receive row instead of sending one per slot."""
    T, D, E, b, M = ex.tokens, cfg.d_model, cfg.n_experts, ex.compute_bytes, ex.ep
    N, L = T * cfg.top_k, cfg.n_experts // ex.ep
    at_destination = _sums_at_destination(cfg, ex)
    inv.add("plan.counts", 2 * INDEX * M * E, "ctx")  # counts_ME, kept_ME
    inv.add("plan.dst", 2 * INDEX * N, "ctx")  # dst_rank_N, dst_row_N
    inv.add("plan.row_src", INDEX * C, "ctx")
    inv.add("plan.recv_base", INDEX * L * M, "ctx")
    inv.add("dispatch.offsets", OFFSET * L, "saved", "fwd_live")
    if at_destination:
        backward = {"grad_out", "combine.dy_rows", "combine.d_rows_in"}
    else:
        backward = {"grad_out", "combine.dy32", "combine.d_rows", "combine.d_rows_in"}
    if ex.ep_backend == "all_to_all":  # staging buffers of all_to_all_single, both ways
        inv.add("route.send_order", INDEX * N, "ctx")
        inv.add("route.recv_pos", INDEX * C, "ctx")
        inv.add("combine.payload", b * C * D, "fwd_live")
        inv.add("combine.inbox", b * N * D, "fwd_live")
        backward |= {"combine.payload", "combine.inbox"}
        if at_destination:  # every rank's partials of every token, and what comes back
            inv.add("combine.partials", 2 * FP32 * M * T * D, "fwd_live")
    else:
        inv.add("route.origin", INDEX * C, "ctx")
    inv.add("dispatch.rows", b * C * D, "saved", "fwd_live")
    if at_destination:
        inv.add("route.slot_rows", INDEX * M * N, "ctx")
        inv.add("combine.weights", FP32 * C, "saved")
        inv.add("combine.y", b * T * D, "fwd_live", "selective")
        inv.add("combine.dy_rows", b * C * D)  # the output gradient of each receive row's token
        inv.add("combine.d_rows_in", b * C * D)  # times the weight: the experts' output gradient
    else:
        inv.add("combine.weights", FP32 * N, "saved")
        inv.add("combine.rows", b * N * D, "saved", "fwd_live")
        inv.add("combine.y32", FP32 * T * D, "fwd_live", "selective")
        inv.add("combine.dy32", FP32 * T * D)
        inv.add("combine.d_rows", b * N * D)  # grad_y * w, sent back to the experts' ranks
        inv.add("combine.d_rows_in", b * C * D)  # what arrives: the experts' output gradient
    inv.moment((), backward)


def _experts(inv: Inventory, cfg: MoEConfig, ex: Execution, R: int, mxfp8: bool,
             out_saved: bool) -> None:
    """SwiGLU over R rows: BF16 grouped GEMMs, or moe_mxfp8's (keeps rows and h13, or
    their MXFP8 forms with ``save_mxfp8_activations``; FP8 recipes: ``_fp8_experts``). The output is kept when the
    combine keeps it (``out_saved``: the local dispatcher's, the EP combine summing at the
    destination; summing at the source it keeps its gathered copy). The backward's high-water mark
    is at the SwiGLU's gradient. The BF16 path has no weight gradient alive then: each
    GEMM's weight gradient reaches the DDP hook (or the main grad, in-kernel) right after
    that GEMM's backward. moe_mxfp8's single function still holds the down projection's.

    Split (zero bubble): the three GEMMs' dy operands are captured, the down projection's
    output gradient [R, D] and the gate and up gradients [R, F] each (what
    ``merged_wgrad_operands`` counts besides the saved rows and h); the GEMMs' own
    moments (with a weight gradient when no sink takes it) are ``split_only``. moe_mxfp8's
    function is one node: its output gradient is captured, and the weight pass replays
    its whole backward."""
    from moe_mxfp8.format import mxfp8_nbytes

    D, F, b = cfg.d_model, cfg.expert_hidden, ex.compute_bytes
    E_local = cfg.n_experts // ex.ep
    inv.add("experts.out", b * R * D, *(("saved",) if out_saved else ()), "selective", "fwd_live")
    inv.add("experts.dy_down", b * R * D)
    if ((mxfp8 and ex.mxfp8_recipe == "mxfp8" and not mxfp8_wgrads_in_kernel(ex))
            or (not mxfp8 and not ex.dense_grads_in_gemm)):
        # else the sink adds it in the GEMM's epilogue (FP8: see _fp8_experts)
        inv.add("experts.dw", b * E_local * F * D)
    # By the SwiGLU's gradient, the down projection's backward has freed its input h
    # and the output gradient; the combine's backward has freed what it kept.
    freed = {"experts.out", "experts.h", "combine.weights", "combine.rows"}
    if not mxfp8:
        for name in ("h1", "h3"):
            inv.add(f"experts.{name}", b * R * F, "saved", "selective")
        if ex.kernels != "cuda":  # eager silu(h1) * h3 also keeps silu(h1); fused keeps h1, h3
            inv.add("experts.act", b * R * F, "saved")
        inv.add("experts.h", b * R * F, "saved")
        inv.add("experts.d_h", b * R * F)
        inv.add("experts.d_gates", 2 * b * R * F)
        dw = {"experts.dw"} if "experts.dw" in inv.sizes else set()
        inv.moment(freed - {"experts.h"}, {"grad_out", "experts.dy_down", "experts.d_h"}, dw,
                   captured={"experts.dy_down"}, split_only=True)
        inv.moment(freed, {"grad_out", "experts.d_h", "experts.d_gates"},
                   captured={"experts.d_gates"})
        # gate and up input gradients: one paired GEMM on CUDA
        _shared_input_moments(inv, freed, {"grad_out", "experts.d_gates"}, "experts.dx_rows",
                              b * R * D, ex.kernels != "cuda", dw, set(), split_only=True)
        return
    inv.selective.discard("experts.out")  # one custom function: nothing inside is cached
    if ex.mxfp8_recipe != "mxfp8":
        _fp8_experts(inv, cfg, ex, R, freed)
        return
    if ex.mxfp8_save_activations:
        inv.saved.discard("dispatch.rows")
        inv.add("experts.rows_mx", mxfp8_nbytes((R, D)), "saved")
        inv.add("experts.h13_mx", mxfp8_nbytes((R, 2 * F)), "saved")
        inv.add("experts.h_mx", mxfp8_nbytes((R, F)), "saved")
    else:
        inv.add("experts.h13", b * R * 2 * F, "saved")
    # The FP32 SwiGLU gradient: h1, h3, dh, sigmoid (4 x R*F) and the [R, 2F] result.
    inv.add("experts.swiglu_grad32", FP32 * R * F * 6)
    inv.add("experts.d_h", b * R * F)
    replay = {"experts.d_h", "experts.swiglu_grad32", *({"experts.dw"} & inv.sizes.keys())}
    inv.moment(freed, {"grad_out", *replay}, replay, captured={"experts.dy_down"})


def _emulated_gemm(R: int, K: int, N: int, E: int, b: int, product_rows: int = 0) -> int:
    """Peak bytes inside ``moe_mxfp8.fp8_gemm.fp8_grouped_mm``'s emulation of ``[R, K] @
    [E, N, K]^T``, its result in the compute dtype included: ``dequantize_fp8`` makes each
    operand FP32 through two FP32 temporaries of its size (the data widened, the scales
    spread), each expert's FP32 product (``product_rows`` rows: one group's, the whole
    ``[R, N]`` for an ``FP8Linear``; left out where there are many groups, a segment small
    beside these) is copied into the FP32 result, which is then rounded to the compute
    dtype."""
    rounded = b * R * N if b != FP32 else 0
    operands = FP32 * (R * K + E * N * K + R * N)
    return max(3 * FP32 * R * K, FP32 * R * K + 3 * FP32 * E * N * K,
               operands + FP32 * product_rows * N, operands + rounded)


def _fp8_linear_gemm(M: int, K: int, N: int, ex: Execution, into: bool = False) -> int:
    """Bytes alive inside one GEMM of ``moe_mxfp8.FP8Linear``, ``[M, K] @ [N, K]^T`` from
    E4M3 operands, its ``[M, N]`` result included: emulated, ``_emulated_gemm``'s (one group);
    native (``torch._scaled_mm``), the result and the input scales' FP32 reciprocals (the
    weight's are held by its cache); Triton,
    the result. ``into``: the result adds to an existing ``[M, N]`` (q, k and v's input
    gradient): the Triton GEMM adds in its epilogue, the others make a result and add it.
    The GEMM is ``ex.fp8_dense_gemm``; on CUDA an ``into`` GEMM of ``native`` runs on the
    Triton GEMM (``moe_mxfp8.fp8_linear``)."""
    b = ex.compute_bytes
    if ex.fp8_dense_gemm == "emulated":
        return _emulated_gemm(M, K, N, 1, b, product_rows=M)
    if ex.fp8_dense_gemm == "native" and not (into and ex.kernels == "cuda"):
        return b * M * N + FP32 * M
    return 0 if into else b * M * N


def _fp8_wgrad_quantized(n: int, k: int, R: int, E: int, blockwise: bool) -> int:
    """Bytes of ``moe_mxfp8.quantize_wgrad_operands`` for ``[E, n, k]`` gradients over ``R``
    rows: both operands quantized per group and column into E4M3 copies transposed to
    ``[width, group_columns_width(R, E)]``, their FP32 scales and the int32 padded group
    ends (the program order made beside them is freed once they are made). ``blockwise``
    (per column and 128 tokens): groups 128-aligned, one FP32 scale per 128 columns of a
    copy, one int32 tensor of padded ends."""
    from moe_mxfp8.fp8 import TOKEN_BLOCK, group_columns_width

    if blockwise:
        width = group_columns_width(R, E, TOKEN_BLOCK)
        return (n + k) * width + FP32 * (width // TOKEN_BLOCK) * (n + k) + OFFSET * E
    return (n + k) * group_columns_width(R, E) + FP32 * E * (n + k) + OFFSET * E


def _fp8_wgrad_gemm(n: int, k: int, R: int, E: int, gemm: str, group_rows: int = 0,
                    blockwise: bool = False) -> int:
    """Temporaries of ``moe_mxfp8.fp8_wgrad_mm`` on quantized operands (``[n, width]`` and
    ``[k, width]``; its result left out): rowwise, the scales' FP32 reciprocals; emulated,
    FP32 widenings of the copies (blockwise: scaled in place) and an FP32 result, and while
    a group's product is formed (``group_rows`` rows: one group's, left out where there are
    many) its two scaled operands (rowwise) and the product. The blockwise Triton kernel
    forms the reciprocals itself and needs nothing."""
    from moe_mxfp8.fp8 import TOKEN_BLOCK, group_columns_width

    if blockwise:
        width = group_columns_width(R, E, TOKEN_BLOCK)
        if gemm != "emulated":
            return 0
        return FP32 * ((n + k) * width + E * n * k + (n * k if group_rows else 0))
    width = group_columns_width(R, E)
    nbytes = FP32 * E * (n + k)
    if gemm == "emulated":
        nbytes += FP32 * ((n + k) * width + E * n * k)
        nbytes += FP32 * ((n + k) * group_rows + n * k) if group_rows else 0
    return nbytes


def _fp8_wgrad_run(n: int, k: int, R: int, E: int, gemm: str, b: int, group_rows: int = 0,
                   blockwise: bool = False, result: bool = True) -> int:
    """The high-water mark of ``moe_mxfp8.fp8_wgrad_mm`` above its quantized operands:
    ``_fp8_wgrad_gemm``'s temporaries, with ``result`` its ``[E, n, k]`` result in the
    compute dtype (``b`` bytes), which the emulation rounds from its FP32 one after the
    widened operands are freed (nothing new where that dtype is FP32)."""
    temporaries = _fp8_wgrad_gemm(n, k, R, E, gemm, group_rows, blockwise)
    if not result:
        return temporaries
    if gemm != "emulated":
        return temporaries + b * E * n * k
    return max(temporaries, FP32 * E * n * k + (0 if b == FP32 else b * E * n * k))


def _fp8_linears_backward(inv: Inventory, prefix: str, ex: Execution, M: int, K: int,
                          outputs: list[tuple[str, int, set[str]]], dx: str, freed: set[str],
                          temps: set[str], captured: set[str]) -> None:
    """The backward of one ``moe_mxfp8.FP8Linear`` (or of several sharing their input:
    attention's q, k and v, ``FP8Linear.shared_input_forward``), as
    ``moe_mxfp8.fp8_linear._FP8LinearsFn`` runs it: per output ``(name, width N, weight
    gradient)`` in order, its gradient quantized (``dy_q``, the recipe's activation blocks;
    the previous output's released first), the input-gradient GEMM into ``dx`` ([M, K],
    made by the first, added to by the rest), then the weight gradient with ``dy_q`` and
    ``dx`` alive. The last ``dy_q`` is freed when the function returns."""
    from moe_mxfp8 import FP8_RECIPES
    from moe_mxfp8.fp8 import fp8_nbytes

    recipe = FP8_RECIPES[ex.mxfp8_recipe]
    block = recipe.act_block
    # the grouped GEMMs read it: every GEMM but native's, and on CUDA the Triton GEMM that
    # adds the further input gradients into native's (_fp8_linear_gemm)
    if (ex.fp8_dense_gemm != "native" or recipe.fp8_wgrad
            or (len(outputs) > 1 and ex.kernels == "cuda")):
        inv.add(f"{prefix}.rows", FP32, "saved")  # the function saves its int32 [1] row count
    inv.add(dx, ex.compute_bytes * M * K)
    for i, (name, N, wgrad) in enumerate(outputs):
        dy_q = f"{prefix}.{name}.dy_q"
        gemm = f"{prefix}.{name}.gemm"
        inv.add(dy_q, fp8_nbytes((M, N), block))
        inv.add(gemm, _fp8_linear_gemm(M, N, K, ex, into=i > 0))
        made = {dx} if i > 0 else set()
        inv.moment(freed, temps | {dy_q, gemm} | made, captured=captured)
        inv.moment(freed, temps | {dy_q, dx} | wgrad, wgrad, captured=captured)


def _fp8_linear_wgrad(inv: Inventory, ex: Execution, param: str, name: str, n_out: int,
                      n_in: int, M: int) -> set[str]:
    """The weight-gradient temporaries of ``moe_mxfp8.FP8Linear`` ``param``: in the recipes
    whose weight gradients run in the compute dtype, the BF16 layers' (``_dense_wgrad``:
    the layer hands the sink the same add); with FP8 weight gradients
    (``FP8Recipe.fp8_wgrad``), ``fp8_grouped_wgrad``'s operands (one group) and its
    ``[n_out, n_in]`` result in the compute dtype."""
    from moe_mxfp8 import FP8_RECIPES

    if not FP8_RECIPES[ex.mxfp8_recipe].fp8_wgrad:
        return _dense_wgrad(inv, ex, param, name, n_out, n_in)
    inv.add(f"{name}_fp8", _fp8_dense_wgrad(n_out, n_in, M, ex))
    return {f"{name}_fp8"}


def _fp8_dense_wgrad(n: int, k: int, M: int, ex: Execution) -> int:
    """The high-water mark of ``fp8_grouped_wgrad`` over one group of ``M`` rows: its
    quantized operands and ``_fp8_wgrad_run`` with the ``[n, k]`` result."""
    from moe_mxfp8 import FP8_RECIPES

    blockwise = FP8_RECIPES[ex.mxfp8_recipe].blockwise
    return (_fp8_wgrad_quantized(n, k, M, 1, blockwise)
            + _fp8_wgrad_run(n, k, M, 1, ex.fp8_dense_gemm, ex.compute_bytes, M, blockwise))


def _fp8_experts(inv: Inventory, cfg: MoEConfig, ex: Execution, R: int, freed: set[str]) -> None:
    """moe_mxfp8.FP8GroupedExperts (every FP8 recipe): one autograd function that saves the
    rows (the dispatcher's tensor) and h13 [R, 2F] in the compute dtype; its backward's
    SwiGLU kernel writes h [R, F] again beside dh13.

    Its backward keeps every result until it returns: dy's FP8 form, dh [R, F], h, dh13
    [R, 2F] and its FP8 form (the recipe's activation blocks, ``moe_mxfp8.fp8.fp8_nbytes``),
    the input gradient [R, D], dw13 [E, 2F, D], dw2 [E, D, F]. Moments, in order: the two
    input-gradient GEMMs (emulated: ``_emulated_gemm``'s FP32 operands and product; native:
    the second's FP32 scale reciprocals, the GEMM's arguments); dw13's
    GEMM and dw2's, or, where moe_model's kernel adds them (``mxfp8_wgrads_in_kernel``), the
    gate's, the up projection's and the down projection's gradient added one after
    another, the first two read from their halves of dh13 in place: no gradient tensor
    and no copy. Recipes with FP8 weight gradients
    (``FP8Recipe.fp8_wgrad``) quantize both operands of each GEMM once
    (``_fp8_wgrad_quantized``) and run it (``_fp8_wgrad_run``); with the sink, each
    weight's GEMM adds into its FP32 target (gate and up one after another from the halves
    of dh13's copy), without, dw13 and dw2 are made. The others run BF16 grouped GEMMs;
    then, with the sink, the gate's and the up projection's gradients, strided slices of
    dw13, copied one at a time to be added flat. Split: the function
    is one node (its output gradient is captured), and its whole backward replays in the
    weight pass. Checked on CPU against the module run as on an H200 (test_plan.py)."""
    from moe_mxfp8 import FP8_RECIPES
    from moe_mxfp8.fp8 import fp8_nbytes

    D, F, b = cfg.d_model, cfg.expert_hidden, ex.compute_bytes
    E = cfg.n_experts // ex.ep
    recipe = FP8_RECIPES[ex.mxfp8_recipe]
    emulated = ex.mxfp8_gemm == "emulated"
    inv.add("experts.h13", b * R * 2 * F, "saved")
    inv.add("experts.dy_q", fp8_nbytes((R, D), recipe.act_block))
    inv.add("experts.d_h", b * R * F)
    inv.add("experts.dh13", b * R * 2 * F)
    inv.add("experts.dh13_q", fp8_nbytes((R, 2 * F), recipe.act_block))
    inv.add("experts.drows", b * R * D)
    inv.add("experts.h", b * R * F)  # dw2's operand, from the SwiGLU backward
    dy = {"grad_out", "experts.dy_down", "experts.dy_q"}
    captured = {"experts.dy_down"}
    if emulated:
        inv.add("experts.gemm_dh", _emulated_gemm(R, D, F, E, b))
        inv.add("experts.gemm_drows", _emulated_gemm(R, 2 * F, D, E, b))
        inv.moment(freed, dy | {"experts.gemm_dh"}, captured=captured)
        inv.moment(freed, dy | {"experts.d_h", "experts.h", "experts.dh13", "experts.dh13_q",
                                "experts.gemm_drows"})
    inputs = dy | {"experts.d_h", "experts.h", "experts.dh13", "experts.dh13_q", "experts.drows"}
    if ex.mxfp8_gemm == "native":  # torch._scaled_grouped_mm takes the scales' reciprocals
        inv.add("experts.drows_scales_inv", FP32 * (R + E * D))  # dh13_q's rows, w13's columns
        inv.moment(freed, inputs | {"experts.drows_scales_inv"}, captured=captured)
    if mxfp8_wgrads_in_kernel(ex):  # the kernel reads the halves of dh13 where they lie
        inv.moment(freed, inputs, captured=captured)
        return
    if recipe.fp8_wgrad and ex.expert_grad_sink:
        # moe_mxfp8's FP8WeightGradientAdd: each GEMM's operands quantized once, each
        # weight's gradient added into its FP32 target by the GEMM, one weight at a time
        # (gate and up from the halves of dh13's copy); h alive throughout
        for name, n, k, weights in (("experts.wgrad13", 2 * F, D, 2), ("experts.wgrad2", D, F, 1)):
            inv.add(f"{name}_operands", _fp8_wgrad_quantized(n, k, R, E, recipe.blockwise))
            # rowwise, the rounded result is added; blockwise, the FP32 sum
            inv.add(f"{name}_add", _fp8_wgrad_run(n // weights, k, R, E, ex.mxfp8_gemm, b,
                                                  blockwise=recipe.blockwise,
                                                  result=not recipe.blockwise))
            wgrad = {f"{name}_operands", f"{name}_add"}
            inv.moment(freed, inputs, wgrad, captured=captured if weights == 2 else ())
        return
    inv.add("experts.dw13", b * E * 2 * F * D)
    inv.add("experts.dw2", b * E * D * F)
    if recipe.fp8_wgrad:  # each GEMM's quantized operands and high-water mark, its result in it
        for name, n, k in (("experts.wgrad13_gemm", 2 * F, D), ("experts.wgrad2_gemm", D, F)):
            inv.add(name, _fp8_wgrad_quantized(n, k, R, E, recipe.blockwise)
                    + _fp8_wgrad_run(n, k, R, E, ex.mxfp8_gemm, b, blockwise=recipe.blockwise))
        inv.moment(freed, inputs, {"experts.wgrad13_gemm"}, captured=captured)
        inv.moment(freed, inputs, {"experts.dw13", "experts.wgrad2_gemm"})
        return
    inv.moment(freed, inputs, {"experts.dw13"}, captured=captured)
    inv.moment(freed, inputs, {"experts.dw13", "experts.dw2"})
    if ex.expert_grad_sink:
        inv.add("experts.dw_flat", b * E * F * D)
        # h is released before the gradients are added
        inv.moment(freed, inputs - {"experts.h"}, {"experts.dw13", "experts.dw2", "experts.dw_flat"})


def mxfp8_wgrads_in_kernel(ex: Execution) -> bool:
    """Whether moe_mxfp8's experts hand their weight gradients to moe_model's kernel (their
    recipe computes them in the compute dtype: MXFP8's and the FP8 recipes without FP8
    weight gradients; a sink takes them; CUDA: ``moe_model.wire_model``)."""
    from moe_mxfp8 import FP8_RECIPES

    recipe = FP8_RECIPES.get(ex.mxfp8_recipe)
    compute_dtype_wgrads = ex.mxfp8_recipe == "mxfp8" or (recipe is not None and not recipe.fp8_wgrad)
    return compute_dtype_wgrads and ex.kernels == "cuda" and ex.expert_grad_sink


def merged_wgrad_operands(cfg: MoEConfig, layers: Iterable[int], ex: Execution, R: int) -> int:
    """Bytes of one microbatch's expert weight-gradient operands held for merging with the
    next microbatch's (moe_ddp's ``merge_microbatch_gradients``, CUDA only): per MoE layer
    whose weight gradients run in moe_model's kernel (the BF16 grouped GEMMs, moe_mxfp8's
    experts where ``mxfp8_wgrads_in_kernel``), what the three weight gradients read, the
    rows and the down projection's output gradient ([R, D] each), the gate and up gradients
    and the SwiGLU output h ([R, F] each; moe_mxfp8's experts: dh13 and the recomputed or
    dequantized h). Held from that layer's backward to the next one's."""
    if ex.kernels != "cuda":
        return 0
    D, F, b = cfg.d_model, cfg.expert_hidden, ex.compute_bytes
    in_kernel = mxfp8_wgrads_in_kernel(ex)
    moe = [layer for layer in layers if cfg.is_moe_layer(layer)
           and (layer not in ex.mxfp8_expert_layers or in_kernel)]
    return len(moe) * b * R * (2 * D + 3 * F)


def _swiglu(inv: Inventory, prefix: str, param: str, T: int, D: int, F: int, ex: Execution,
            peaks: bool) -> None:
    """A dense SwiGLU (dense layers, shared experts; ``param``: its module's name); its
    backward runs before the routed branch's (created later in the forward, so first in
    the backward). The down projection's weight gradient goes to DDP at once
    (``nn.Linear`` transposes its weight inside the call), before the SwiGLU's own
    gradient. ``peaks``: the block's forward peaks here (a dense block: at the gate
    product, act, h3 and h are alive). The CUDA gating kernel keeps h1 and h3 only; the
    eager form also keeps act. Split: the down projection's output gradient and the
    gate/up gradients are the captured dy operands."""
    b = ex.compute_bytes
    forward = ("fwd_live",) if peaks else ()
    inv.add(f"{prefix}.h1", b * T * F, "saved", "selective")
    inv.add(f"{prefix}.h3", b * T * F, "saved", "selective", *forward)
    if ex.kernels != "cuda":
        inv.add(f"{prefix}.act", b * T * F, "saved", *forward)
    inv.add(f"{prefix}.h", b * T * F, "saved", *forward)
    inv.add(f"{prefix}.out", b * T * D, "selective")
    inv.add(f"{prefix}.d_h", b * T * F)
    inv.add(f"{prefix}.d_gates", 2 * b * T * F)
    inv.add(f"{prefix}.dy_down", b * T * D)  # the output gradient (the block's, as a tensor)
    dw = _dense_wgrad(inv, ex, f"{param}.w2.weight", f"{prefix}.dw", D, F)
    inv.moment((), {"grad_out", f"{prefix}.d_h"}, dw, captured={f"{prefix}.dy_down"})
    # gate and up: same shape, one weight gradient at a time; autograd's is planned only
    # in the split backward (the ordinary one has its high-water mark elsewhere, measured)
    dw_up: set[str] = set()
    for name in ("w1", "w3"):
        dw_up = _dense_wgrad(inv, ex, f"{param}.{name}.weight", f"{prefix}.dw", F, D) or dw_up
    fp32_up = dw_up if ex.dense_grads_in_gemm else set()
    inv.moment({f"{prefix}.h"}, {"grad_out", f"{prefix}.d_h", f"{prefix}.d_gates"}, fp32_up,
               captured={f"{prefix}.d_gates"})
    _shared_input_moments(inv, {f"{prefix}.h"}, {"grad_out", f"{prefix}.d_gates"}, f"{prefix}.dx",
                          b * T * D, not ex.dense_grads_in_gemm, dw_up, set(), split_only=True)


def block_inventory(cfg: MoEConfig, layer: int, ex: Execution) -> Inventory:
    """Every tensor of block ``layer`` for one microbatch."""
    T, D, b = ex.tokens, cfg.d_model, ex.compute_bytes
    inv = Inventory()
    inv.add("input", b * T * D)
    inv.add("grad_out", b * T * D)
    moe = cfg.is_moe_layer(layer)
    inv.add("h_mid", b * T * D, "fwd_live")  # x + attention, alive until the block's last add
    _norm(inv, "mlp_norm", T, D, ex, out_saved=not moe or cfg.n_shared_experts > 0,
          input_name="h_mid")
    inv.fwd_live.add("mlp_norm.out")
    param = f"blocks.{layer}.mlp"
    if moe:
        if cfg.n_shared_experts:
            _swiglu(inv, "shared", f"{param}.shared", T, D, cfg.shared_hidden_width, ex, peaks=False)
        _router(inv, cfg, ex)
        if ex.ep_backend != "local":  # the EP transport, on one rank too (ep = 1)
            R = ep_capacity(cfg, T, ex.ep)
            _ep_dispatch(inv, cfg, ex, R)
            out_saved = _sums_at_destination(cfg, ex)
        else:
            R = local_rows(cfg, T)
            _local_dispatch(inv, cfg, ex, R, _rowwise_fp8_experts(ex, layer))
            out_saved = True
        _experts(inv, cfg, ex, R, layer in ex.mxfp8_expert_layers, out_saved)
    else:
        _swiglu(inv, "mlp", param, T, D, cfg.dense_hidden_width, ex, peaks=True)
    # the MLP norm's backward (split): the router's logits gradient is its GEMM's dy
    # operand; the fused add-and-norm's node also captures the residual gradient, the
    # block's output gradient: the tensor a dense or shared SwiGLU's down projection
    # captures too, where the block has one
    more = {"router.dlogits"} if moe else set()
    if moe:
        inv.add("router.dlogits", FP32 * T * cfg.n_experts)
    if ex.kernels == "cuda":
        swiglu = "mlp" if not moe else "shared" if cfg.n_shared_experts else None
        if swiglu is None:
            inv.add("mlp_norm.dh", b * T * D)
        more.add(f"{swiglu}.dy_down" if swiglu else "mlp_norm.dh")
    _norm_backward(inv, "mlp_norm", T, D, ex, more)
    _attention(inv, cfg, ex, layer)  # last: its backward moments free every MLP tensor registered
    return inv


@dataclass(frozen=True)
class EdgeMemory:
    """The stage's ends: token ids (first stage); final norm, head and loss (last stage)."""

    held: int  # kept until the stage's backward
    fwd_peak: int  # added on top of everything held, at the head's forward high-water mark
    bwd_peak: int  # same, at the loss's backward high-water mark
    # The split backward (zero bubble): the input pass's high-water mark (as bwd_peak), the
    # dy operands it keeps for the weight pass (the logits' gradient, the final norm's),
    # what of ``held`` it frees before the blocks' backward runs (the loss's saved tensors,
    # where the pass runs the loss's backward alone first), and the weight pass's largest
    # temporary (the head's gradient).
    input_pass_peak: int = 0
    deferred: int = 0
    freed_by_input_pass: int = 0
    weight_pass_temporaries: int = 0


def _fp8_head(ex: Execution, T: int, D: int, V: int, head_grads: int) -> tuple[int, int, int, int]:
    """An ``FP8Linear`` head (``moe_mxfp8.fp8_linear._FP8LinearsFn``): the forward's GEMM
    moment (the input's E4M3 copy and the GEMM with the logits it makes); the backward's
    largest moment beside the logits' gradient (the gradient's E4M3 copy, alive to the
    end, with the input-gradient GEMM, then with the input gradient and the weight's
    gradient: ``_fp8_linear_wgrad``'s); the head's gradients for the other moments; that
    E4M3 copy where the fused loss (CUDA) writes it beside its gradient (a rowwise recipe:
    ``moe_model.row_encoding.RowEncoder``), else 0."""
    from moe_mxfp8 import FP8_RECIPES
    from moe_mxfp8.fp8 import fp8_nbytes

    recipe = FP8_RECIPES[ex.mxfp8_recipe]
    forward = fp8_nbytes((T, D), recipe.act_block) + _fp8_linear_gemm(T, D, V, ex)
    dy_q = fp8_nbytes((T, V), recipe.act_block)
    if recipe.fp8_wgrad:
        head_grads = ex.compute_bytes * T * D + _fp8_dense_wgrad(V, D, T, ex)
    by_loss = dy_q if ex.kernels == "cuda" and recipe.act_block == (1, 0) else 0
    return forward, dy_q + max(_fp8_linear_gemm(T, V, D, ex), head_grads), head_grads, by_loss


def head_memory(cfg: MoEConfig, ex: Execution) -> EdgeMemory:
    """Final norm, head and cross-entropy (``lm_loss_sum``); the trainer and the pipeline
    pass the logits straight to the loss, so they die with it.

    Eager (CPU): logits [T,V] in BF16, an FP32 copy (none in FP32 compute), log-softmax's
    FP32 output (kept);
    backward: the loss gradient [T,V] FP32, log-softmax's input gradient FP32, then the
    BF16 logits gradient and the head's BF16 weight gradient (freed by the DDP hook).
    Fused (CUDA): the BF16 logits (kept) and 12 bytes per row; backward: the BF16
    logits gradient while the logits are alive, then the head's gradients. An FP8Linear
    head of a rowwise recipe: 16 bytes per row, and the loss's backward also writes the
    gradient's E4M3 codes, which live on through the head's backward
    (``moe_model.row_encoding.RowEncoder``).

    A tied head's weight gradient is autograd's BF16 [V, D] (no sink): on a stage that
    also holds the embedding it waits there for the embedding's (``stage_memory``).

    Split backward: where the head's GEMM is the sink's custom autograd node, the input
    pass runs the nodes above it (the loss) in a call of their own that retains nothing
    (``moe_pp.backward``: a custom root must outlive the stage outputs), so the loss's
    saved tensors are gone before the blocks' backward; a built-in head is one retaining
    call, and they stay until the weight pass.
    """
    T, D, V, b = ex.tokens, cfg.d_model, cfg.vocab_size, ex.compute_bytes
    inv = Inventory()
    inv.add("final_norm.input", b * T * D)
    _norm(inv, "final_norm", T, D, ex, out_saved=True, input_name="final_norm.input")
    norm = inv.bytes(inv.saved)
    # the input gradient, and the weight's gradient: BF16 unless the GEMM adds it to the main
    # grad, where it is an FP32 temporary when the bucket piece is not whole rows
    if ex.dense_grads_in_gemm and not cfg.tie_embeddings:
        head_dw = FP32 * V * D if "head.weight" in ex.fp32_dense_wgrads else 0
    else:
        head_dw = b * V * D
    head_grads = head_dw + b * T * D
    dlogits = b * T * V  # the head's dy operand
    # split input pass, after the loss's backward: the head's input gradient (the final norm's
    # output gradient, its gain's dy operand), then the norm's backward (see _norm_backward)
    after_loss = dlogits + b * T * D + (b if ex.kernels == "cuda" else 5 * FP32) * T * D
    deferred = dlogits + b * T * D
    head_is_sink_node = ex.dense_grads_in_gemm and not cfg.tie_embeddings
    fp8_forward = fp8_backward = 0  # an FP8Linear head's moments beyond the BF16 head's
    dy_codes = 0  # the head's E4M3 dy where the fused loss writes it (a rowwise recipe)
    if "head" in ex.fp8_linears:
        norm += FP32  # the function saves its int32 [1] row count
        fp8_forward, fp8_backward, head_grads, dy_codes = _fp8_head(ex, T, D, V, head_grads)
    if ex.kernels == "cuda":
        logits = b * T * V
        # the loss saves the logits and per row 3 FP32 statistics, 4 for an FP8 head's codes
        loss_saved = logits + (4 if dy_codes else 3) * FP32 * T
        held = norm + loss_saved
        # The loss's backward: its BF16 gradient (and an FP8 head's codes of it) beside the
        # logits; then the head's, with the logits freed and their gradient (same size) in
        # their place.
        loss_backward = held + logits + dy_codes
        freed = loss_saved if head_is_sink_node else 0
        return EdgeMemory(held=held, fwd_peak=max(held, norm + fp8_forward),
                          bwd_peak=max(loss_backward, held + head_grads, held + fp8_backward),
                          input_pass_peak=max(loss_backward, held - freed + after_loss),
                          deferred=deferred, freed_by_input_pass=freed,
                          weight_pass_temporaries=head_dw)
    log_probs = FP32 * T * V
    held = norm + log_probs
    copy32 = FP32 * T * V if b != FP32 else 0  # logits.float(): the logits themselves in FP32
    fwd = max(norm + b * T * V + copy32 + log_probs, norm + fp8_forward)
    ce_backward = held + 2 * FP32 * T * V
    head_backward = held - log_probs + b * T * V + max(head_grads, fp8_backward)
    freed = log_probs if head_is_sink_node else 0
    return EdgeMemory(held=held, fwd_peak=fwd, bwd_peak=max(ce_backward, head_backward),
                      input_pass_peak=max(ce_backward, held - freed + after_loss),
                      deferred=deferred, freed_by_input_pass=freed, weight_pass_temporaries=head_dw)


def embedding_backward(cfg: MoEConfig, ex: Execution, tied_head: bool) -> int:
    """Temporaries of the embedding's backward, the first stage's last step: its output
    gradient [T, D] and, unless the sink takes the gradient (untied, CUDA with the fused
    accumulation: only the rows seen are added), autograd's dense [V, D] one. With the
    tied head on the same stage (``tied_head``), autograd then adds that to the head's
    gradient (held since the head's backward, see ``stage_memory``) into a new [V, D]."""
    T, D, V, b = ex.tokens, cfg.d_model, cfg.vocab_size, ex.compute_bytes
    dense = 0 if ex.dense_grads_in_gemm and not cfg.tie_embeddings else b * V * D
    return b * T * D + dense + (b * V * D if tied_head else 0)


def tokens_memory(ex: Execution) -> int:
    """Token ids of a microbatch (int64 [B, S+1]), kept by the embedding's backward."""
    return INDEX * ex.micro_batch * (ex.seq_len + 1)
