"""FP8GroupedExperts: routed SwiGLU experts whose grouped GEMMs read scaled E4M3 operands.

Shape legend: R dispatched rows (expert-major), E local experts, D d_model, F expert
hidden, 2F gate and up side by side. Weights as in the model they replace: ``w1 [E,F,D]``,
``w3 [E,F,D]``, ``w2 [E,D,F]``; ``forward(rows[R,D], group_offsets[E] int32 cumulative
ends)``, as ``MXFP8GroupedExperts``.

Recipes (``FP8_RECIPES``):
- ``fp8_rowwise`` (torchao's float8 rowwise): every GEMM operand scaled per row along
  its reduction dim with power-of-two scales; all three GEMMs in FP8, the weight
  gradients' operands scaled per expert and column (along the tokens).
- ``fp8_rowwise_gw_hp`` (torchao's "rowwise_with_gw_hp"): the same, with the weight
  gradients in the compute dtype (BF16) from unquantized operands: two thirds of the
  GEMM FLOPs in FP8, none of the four per-expert column quantizations (whichever is
  faster depends on how those passes compare with the FP8 gain on the weight-gradient
  GEMMs: ``tools/bench_fp8_experts.py`` measures both).
- ``fp8_blockwise`` (DeepSeek-V3's scales): activations and output gradients in 1x128
  tiles, weights in 128x128 blocks, FP32 scales; forward and input-gradient GEMMs in
  FP8, the weight gradients in the compute dtype. ``gemm="triton"`` or ``"emulated"``:
  no grouped GEMM with these scales exists in torch for sm_90 (a per-expert
  ``torch._scaled_mm`` loop would read the offsets on the host).
- ``fp8_blockwise_gw_fp8`` (DeepSeek-V3's recipe whole, as torchao's
  ``blockwise_fp8_training``): the same, with the weight gradients in FP8 too, both
  operands scaled per column and 128 tokens of each expert ("128x1" tiles along the
  reduction), each block's product promoted to FP32.

Per layer: ``h13 = rows @ w13^T`` (gate and up in one GEMM from a ``[E, 2F, D]`` cache),
``h = silu(h1) * h3``, ``y = h @ w2^T``; backward ``dh = dy @ w2``, ``drows = dh13 @ w13``
(weights from the caches' transposed copies scaled along the output dim), weight
gradients ``dw = dy^T @ x`` per expert. ``rows`` and ``h13`` are saved in the compute
dtype; ``h`` is recomputed.

``gemm`` (``moe_mxfp8.fp8_gemm``): ``native`` (``torch._scaled_grouped_mm``, rowwise
recipes, BF16 compute, widths multiples of 16), ``triton`` (this package's kernel for the
forward and input-gradient GEMMs, every recipe; ``fp8_rowwise``'s FP8 weight gradients
run natively), neither synchronising with the host; or ``emulated`` (dequantize, FP32
matmuls per expert: exact, reads the offsets on the host; every device).

``fast_accum``: the GEMM roles (``output``: ``h13`` and ``y``; ``grad_input``: ``dh`` and
``drows``; ``grad_weight``: the FP8 weight gradients) that the GEMMs run with the
tensor cores' fast accumulation; the others promote to FP32 (blockwise scales promote
every K block whatever it says). Default
``FAST_ACCUM_DEFAULT`` = ``("output",)``, torchao's float8 rowwise recipes' per-GEMM
configs (``moe_mxfp8.fp8_gemm`` cites them). The emulation computes in FP32 whatever it
says.

Weight gradients into a sink: like ``moe_model.GroupedExperts``, the layer has a
``grad_sink`` (a ``GradientSink``: ``accepts(param)``, ``add_gradient(param, add)``).
When it accepts a weight and the backward runs that weight's ``AccumulateGrad`` node,
the gradient is handed over as ``add(target)`` (adds it, in the GEMM's output dtype,
to the FP32 accumulator ``target``) and ``param.grad`` stays ``None``; otherwise it is
returned through autograd. FP8 weight gradients (``FP8Recipe.fp8_wgrad``) are handed
over as ``FP8WeightGradientAdd``: the GEMM of operands quantized once per GEMM (gate and
up share dh13's) runs when the sink calls it and adds into the target, blockwise in FP32
(the Triton kernel in its epilogue), rowwise as torch's GEMM rounds it.

Operands encoded by their producers (rowwise recipes, ``moe_mxfp8.row_codes``): the layer
sets a ``RowCodes`` as ``GRADIENT_ROW_ENCODER`` on its output, as ``FP8Linear`` does, and
holds one as ``INPUT_ROW_ENCODER``. moe_model's local dispatcher, gathering the rows it
hands this layer, writes their E4M3 codes and scales in the same pass, and, combining
exactly this layer's output in its dropless layout, writes ``dy``'s codes in the pass
that writes ``dy``: each one read of an ``[R, D]`` tensor fewer per layer and
microbatch, for the codes ``quantize_fp8`` gives. The GEMMs use them where they came for
exactly the tensor the layer got; anywhere else the layer quantizes as always.

Weight gradients computed later (``weight_gradient``): in the recipes whose weight
gradients run in the compute dtype from unquantized operands (``FP8Recipe.fp8_wgrad``
false), the layer can hand the sink, instead of a computed gradient, whatever
``weight_gradient(x_RK, dy_RN, offsets_E, like_EKN)`` makes of the operands (``like_EKN``
the weight viewed ``[E, K, N]``, ``dw[e] = x_e^T @ dy_e``). The trainer sets it to
``moe_model.ExpertWeightGradient.from_rows`` on CUDA: that add runs when the sink calls it,
adds the gradient to the FP32 target in the GEMM's epilogue and merges with the next
microbatches' (one launch, one read-modify-write of the target), as the BF16 experts'
weight gradients do; computing the gradient here and adding it afterwards wrote a BF16
gradient and re-read it with the FP32 target once per microbatch. ``None`` (the
default; this package stands alone): computed here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moe_mxfp8.cache import WeightCache
from moe_mxfp8.experts import (
    CachedGroupedExperts,
    WeightGradientMaker,
    check_expert_rows,
    expert_weight_gradients,
    expert_weights,
    take_over,
)
from moe_mxfp8.fp8 import FP8Tensor, quantize_fp8, quantize_weight_blocks, quantize_weight_rowwise
from moe_mxfp8.fp8_gemm import (
    FAST_ACCUM_DEFAULT,
    FP8_GEMM_ROLES,
    FP8_GEMMS,
    FP8WgradOperands,
    check_gemm_runs,
    check_native_widths,
    fp8_grouped_mm,
    fp8_wgrad_mm,
    quantize_wgrad_operands,
)
from moe_mxfp8.gemm import compute_dtype, grouped_weight_grad
from moe_mxfp8.row_codes import GRADIENT_ROW_ENCODER, INPUT_ROW_ENCODER, RowCodes
from moe_mxfp8.sink import SinkRoute, check_target, computes_now, deliver, sink_route
from moe_mxfp8.swiglu import (
    swiglu_backward,
    swiglu_backward_quantized,
    swiglu_quantized,
)


@dataclass(frozen=True)
class FP8Recipe:
    """How a recipe scales each operand (``moe_mxfp8.fp8`` blocks) and what runs natively."""

    act_block: tuple[int, int]
    weight_block: tuple[int, int]
    pow2: bool  # power-of-two scales
    fp8_wgrad: bool  # weight-gradient GEMMs in FP8 too
    native: bool  # a native grouped GEMM exists (sm_90)

    @property
    def blockwise(self) -> bool:
        """Scaled in 1x128 tiles and 128x128 blocks (its FP8 weight gradients, if any, per
        column and 128 tokens)."""
        return self.act_block == (1, 128)


FP8_RECIPES = {
    "fp8_rowwise": FP8Recipe((1, 0), (1, 0), pow2=True, fp8_wgrad=True, native=True),
    "fp8_rowwise_gw_hp": FP8Recipe((1, 0), (1, 0), pow2=True, fp8_wgrad=False, native=True),
    "fp8_blockwise": FP8Recipe((1, 128), (128, 128), pow2=False, fp8_wgrad=False, native=False),
    "fp8_blockwise_gw_fp8": FP8Recipe((1, 128), (128, 128), pow2=False, fp8_wgrad=True, native=False),
}


def check_fast_accum(fast_accum: tuple[str, ...], recipe: str, name: str) -> frozenset[str]:
    """The GEMM roles of ``fast_accum`` (a subset of ``FP8_GEMM_ROLES``) as a set; raises
    naming ``name`` for an unknown or repeated role, or ``grad_weight`` where ``recipe``
    computes the weight gradients in BF16."""
    if isinstance(fast_accum, str) or not all(isinstance(g, str) for g in fast_accum):
        raise ValueError(f"{name} must be a tuple of GEMM roles {FP8_GEMM_ROLES}, got {fast_accum!r}")
    if any(g not in FP8_GEMM_ROLES for g in fast_accum) or len(set(fast_accum)) != len(fast_accum):
        raise ValueError(f"{name} must list distinct GEMM roles of {FP8_GEMM_ROLES}, got {fast_accum!r}")
    if "grad_weight" in fast_accum and not FP8_RECIPES[recipe].fp8_wgrad:
        raise ValueError(f"{name}: recipe {recipe} computes the weight gradients in BF16; "
                         "drop grad_weight")
    return frozenset(fast_accum)


def check_layer_choices(recipe: str, gemm: str, fast_accum: tuple[str, ...]) -> frozenset[str]:
    """A layer's ``recipe``, ``gemm`` and ``fast_accum`` (``check_fast_accum``'s set);
    raises naming the argument that is wrong."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"recipe must be one of {tuple(FP8_RECIPES)}, got {recipe!r}")
    if gemm not in FP8_GEMMS:
        raise ValueError(f"gemm must be one of {FP8_GEMMS}, got {gemm!r}")
    if gemm == "native" and not FP8_RECIPES[recipe].native:
        raise ValueError(f"recipe {recipe} has no native FP8 GEMM; use gemm='triton' "
                         "or 'emulated'")
    return check_fast_accum(fast_accum, recipe, "fast_accum")


class FP8WeightCache(WeightCache):
    """``rows``: the weight ``[..., out, in]`` scaled along ``in``; ``cols``: its transpose
    ``[..., in, out]`` (contiguous) scaled along ``out``, the input-gradient GEMM's operand.

    ``dequant_scales``: also keep ``rows_dequant`` and ``cols_dequant``, each copy's
    ``1 / scale`` (what ``torch._scaled_mm`` multiplies by), derived in every refresh (in
    place with the copies), so that a GEMM call inverts no weight scale: a launch fewer
    per dense GEMM, which matters at the small projections' sizes. ``None`` without."""

    def __init__(self, params: tuple[nn.Parameter, ...], recipe: FP8Recipe,
                 dequant_scales: bool = False) -> None:
        self.recipe = recipe
        self.dequant_scales = dequant_scales
        self.rows_dequant: torch.Tensor | None = None
        self.cols_dequant: torch.Tensor | None = None
        super().__init__(params)

    @torch.no_grad()
    def refresh(self, params: tuple[nn.Parameter, ...], in_place: bool = False) -> None:
        super().refresh(params, in_place)
        if not self.dequant_scales:
            return
        for name, copy in (("rows_dequant", self.rows), ("cols_dequant", self.cols)):
            held = getattr(self, name)
            if in_place and held is not None and held.shape == copy.scale.shape and held.device == copy.scale.device:
                torch.reciprocal(copy.scale, out=held)  # the address a captured graph reads
            else:
                setattr(self, name, copy.scale.reciprocal())

    @property
    def nbytes(self) -> int:
        held = [t for t in (self.rows_dequant, self.cols_dequant) if t is not None]
        return super().nbytes + sum(t.nbytes for t in held)

    def _derive(self, parts: list[torch.Tensor], into: tuple[Any, Any] | None
                ) -> tuple[FP8Tensor, FP8Tensor]:
        r = self.recipe
        if r.weight_block == (1, 0):  # rowwise: the transpose scales other lines
            return quantize_weight_rowwise(parts, r.pow2, out=into)
        return quantize_weight_blocks(parts, r.pow2, out=into)


class _FP8ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows_RD: torch.Tensor, offsets_E: torch.Tensor, w1: torch.Tensor,
                w3: torch.Tensor, w2: torch.Tensor, layer: FP8GroupedExperts, dtype: torch.dtype,
                routes: tuple[SinkRoute | None, ...], grad_rows: RowCodes | None,
                rows_q: FP8Tensor | None) -> torch.Tensor:
        r, gemm, fast = layer.recipe, layer.gemm, layer.fast_accum
        if rows_q is None:
            rows_q = quantize_fp8(rows_RD, r.act_block, r.pow2)
        out_fast = "output" in fast
        h13_R2F = fp8_grouped_mm(rows_q, layer.w13_cache.rows, offsets_E, dtype, gemm, out_fast)
        h_q = swiglu_quantized(h13_R2F, r.act_block, r.pow2)
        y_RD = fp8_grouped_mm(h_q, layer.w2_cache.rows, offsets_E, dtype, gemm, out_fast)
        ctx.save_for_backward(offsets_E, rows_RD, h13_R2F)
        # The backward uses the weight copies this forward saw, whatever happens in between.
        ctx.w13_cols, ctx.w2_cols = layer.w13_cache.cols, layer.w2_cache.cols
        ctx.recipe, ctx.gemm, ctx.fast, ctx.dtype, ctx.routes = r, gemm, fast, dtype, routes
        ctx.grad_rows = grad_rows
        ctx.params = (w1, w3, w2)
        ctx.weight_gradient = None if r.fp8_wgrad else layer.weight_gradient
        return y_RD

    @staticmethod
    def backward(ctx: Any, dy_RD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        r, gemm, dtype = ctx.recipe, ctx.gemm, ctx.dtype
        dgrad_fast, wgrad_fast = "grad_input" in ctx.fast, "grad_weight" in ctx.fast
        offsets_E, rows_RD, h13_R2F = ctx.saved_tensors
        dy_RD = dy_RD.to(dtype).contiguous()  # e.g. the expanded gradient of a sum
        dy_q = None if ctx.grad_rows is None else ctx.grad_rows.take(dy_RD)
        if dy_q is None:
            dy_q = quantize_fp8(dy_RD, r.act_block, r.pow2)
        dh_RF = fp8_grouped_mm(dy_q, ctx.w2_cols, offsets_E, dtype, gemm, dgrad_fast)
        # a weight's gradient is computed where autograd wants it back, or where its sink
        # takes it in a backward that runs the weight's node (not a pipeline's input pass)
        wanted = [computes_now(route, ctx.needs_input_grad[2 + i]) for i, route in enumerate(ctx.routes)]
        hidden = h13_R2F.shape[1] // 2
        # h = swiglu(h13), which w2's gradient reads, written by the SwiGLU backward kernel
        h_RF = h13_R2F.new_empty(h13_R2F.shape[0], hidden) if wanted[2] else None
        drows = None
        if ctx.needs_input_grad[0]:
            dh13_R2F, dh13_q = swiglu_backward_quantized(h13_R2F, dh_RF, dtype, r.act_block, r.pow2,
                                                         h_out=h_RF)
            drows = fp8_grouped_mm(dh13_q, ctx.w13_cols, offsets_E, dtype, gemm, dgrad_fast)
        else:
            dh13_R2F = swiglu_backward(h13_R2F, dh_RF, dtype, h_out=h_RF)
        if r.fp8_wgrad:
            grads = _fp8_weight_gradients(ctx, wanted, rows_RD, dh13_R2F, h_RF, dy_RD, offsets_E,
                                          wgrad_fast)
        else:
            grads = expert_weight_gradients(ctx, wanted, rows_RD, dh13_R2F, h_RF, dy_RD, offsets_E,
                                            lambda dy, x: grouped_weight_grad(dy, x, offsets_E))
        del h_RF  # not alive while the gradients are added
        return drows, None, *deliver(ctx.params, grads, ctx.routes, wanted), None, None, None, None, None


def _fp8_weight_gradients(ctx: Any, wanted: list[bool], rows_RD: torch.Tensor,
                          dh13_R2F: torch.Tensor, h_RF: torch.Tensor | None, dy_RD: torch.Tensor,
                          offsets_E: torch.Tensor, fast_accum: bool) -> list[torch.Tensor | None]:
    """The FP8 weight gradients (``FP8Recipe.fp8_wgrad``) of w1, w3 and w2, as
    ``expert_weight_gradients`` returns them for ``deliver``: each GEMM's operands are
    quantized once (gate and up read the halves of one quantized ``dh13``), and a weight
    its sink takes is handed over as an add that runs the GEMM into the FP32 target
    (``FP8WeightGradientAdd``; ``wanted`` is then cleared), so no BF16 gradient is
    written, read back and added, and blockwise sums are never rounded below FP32."""
    r, hidden = ctx.recipe, dh13_R2F.shape[1] // 2
    grads: list[torch.Tensor | None] = [None, None, None]

    def gradient(i: int, ops: FP8WgradOperands) -> torch.Tensor | None:
        """Weight ``i``'s gradient, or ``None`` where it went to the sink (``wanted`` cleared)."""
        route = ctx.routes[i]
        if route is None:
            return fp8_wgrad_mm(ops, ctx.dtype, ctx.gemm, fast_accum)
        route[0].add_gradient(ctx.params[i], FP8WeightGradientAdd(ops, ctx.dtype, ctx.gemm, fast_accum))
        wanted[i] = False
        return None

    if wanted[0] or wanted[1]:
        ops13 = quantize_wgrad_operands(dh13_R2F, rows_RD, offsets_E, r.pow2, r.blockwise)
        if all(ctx.routes[i] is None for i in (0, 1) if wanted[i]):  # one GEMM for both
            dw13 = fp8_wgrad_mm(ops13, ctx.dtype, ctx.gemm, fast_accum)
            grads[0], grads[1] = dw13[:, :hidden], dw13[:, hidden:]
        else:
            for i in (0, 1):
                if wanted[i]:
                    grads[i] = gradient(i, ops13.dy_columns(i * hidden, (i + 1) * hidden))
        del ops13  # not alive beside the down projection's operands
    if wanted[2]:  # then h_RF is there: the backward makes it for this gradient
        grads[2] = gradient(2, quantize_wgrad_operands(dy_RD, h_RF, offsets_E, r.pow2, r.blockwise))
    return grads


class FP8WeightGradientAdd:
    """A sink's add of an expert weight's FP8 gradient (``fp8_wgrad_mm`` of quantized
    operands) into its FP32 target, which holds the ``[E, N, K]`` weight's elements in
    storage order (``GradientSink.add_gradient``: 1-D, or ``[rows, cols]`` with contiguous
    rows). Where the target can be viewed ``[E, N, K]`` the GEMM adds into it (blockwise on
    Triton: in the kernel's epilogue); otherwise the gradient is computed and added."""

    def __init__(self, ops: FP8WgradOperands, dtype: torch.dtype, gemm: str, fast_accum: bool) -> None:
        self.ops, self.dtype, self.gemm, self.fast_accum = ops, dtype, gemm, fast_accum

    def __call__(self, target: torch.Tensor) -> None:
        shape = (self.ops.offsets.shape[0], self.ops.dy_t.shape[0], self.ops.x_t.shape[0])
        check_target(target, shape[0] * shape[1] * shape[2])
        try:
            view = target.view(shape)
        except RuntimeError:  # rows of a bucket that do not split into the weight's rows
            view = None
        dw = fp8_wgrad_mm(self.ops, self.dtype, self.gemm, self.fast_accum,
                          accumulate_into=target.new_zeros(shape) if view is None else view)
        if view is None:
            target.add_(dw.reshape(target.shape))


class FP8GroupedExperts(CachedGroupedExperts):
    """Grouped SwiGLU experts on FP8 GEMMs (a recipe of ``FP8_RECIPES``), holding the given
    ``w1``/``w3``/``w2``; ``fast_accum``: see the module notes."""

    def __init__(self, w1: nn.Parameter, w3: nn.Parameter, w2: nn.Parameter,
                 recipe: str = "fp8_rowwise", gemm: str = "emulated",
                 fast_accum: tuple[str, ...] = FAST_ACCUM_DEFAULT) -> None:
        super().__init__()
        self.fast_accum = check_layer_choices(recipe, gemm, fast_accum)
        if w1.dim() != 3 or w1.shape != w3.shape:
            raise ValueError(
                f"w1 and w3 must both be [E, F, D], got {tuple(w1.shape)} and {tuple(w3.shape)}"
            )
        E, F_, D = w1.shape
        if tuple(w2.shape) != (E, D, F_):
            raise ValueError(f"w2 must be [E, D, F] = {(E, D, F_)}, got {tuple(w2.shape)}")
        if gemm == "native":
            check_native_widths(D, F_)
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.recipe_name, self.recipe, self.gemm = recipe, FP8_RECIPES[recipe], gemm
        self.grad_sink: Any = None  # a GradientSink, see the module docstring
        self.weight_gradient: WeightGradientMaker | None = None  # see the module docstring
        # a rowwise recipe's input rows may come quantized by the dispatcher (module notes)
        if self.recipe.act_block == (1, 0):
            setattr(self, INPUT_ROW_ENCODER, RowCodes(self.recipe.pow2))
        self.w13_cache = FP8WeightCache((w1, w3), self.recipe)
        self.w2_cache = FP8WeightCache((w2,), self.recipe)

    @classmethod
    def from_module(cls, experts: nn.Module, recipe: str = "fp8_rowwise", gemm: str = "emulated",
                    fast_accum: tuple[str, ...] = FAST_ACCUM_DEFAULT) -> FP8GroupedExperts:
        """Take over a grouped-experts module's own ``w1``/``w3``/``w2`` parameters (matched
        by structure), its public plain attributes and its ``grad_sink``, as
        ``MXFP8GroupedExperts.from_module`` does. Narrow expert ranges before converting."""
        return take_over(experts, cls(*expert_weights(experts), recipe, gemm, fast_accum))

    def forward(self, rows_RD: torch.Tensor, group_offsets: torch.Tensor) -> torch.Tensor:
        check_expert_rows(self, rows_RD, group_offsets)
        dtype = compute_dtype(rows_RD)
        check_gemm_runs(type(self).__name__, self.gemm, rows_RD, dtype)
        routes = tuple(sink_route(self.grad_sink, w) for w in (self.w1, self.w3, self.w2))
        # a rowwise recipe's dy may come quantized by whatever computes it (module notes)
        grad_rows = (RowCodes(self.recipe.pow2)
                     if self.recipe.act_block == (1, 0) and torch.is_grad_enabled() else None)
        rows_RD = rows_RD.to(dtype)
        received = getattr(self, INPUT_ROW_ENCODER, None)
        rows_q = None if received is None else received.take(rows_RD)
        with torch.autocast(rows_RD.device.type, enabled=False):
            y_RD = _FP8ExpertsFn.apply(rows_RD, group_offsets, self.w1, self.w3,
                                       self.w2, self, dtype, routes, grad_rows, rows_q)
        if grad_rows is not None:
            setattr(y_RD, GRADIENT_ROW_ENCODER, grad_rows)
        return y_RD

    def extra_repr(self) -> str:
        E, F_, D = self.w1.shape
        fast = ",".join(sorted(self.fast_accum)) or "none"
        return (f"experts={E}, d_model={D}, hidden={F_}, recipe={self.recipe_name}, gemm={self.gemm}, "
                f"fast_accum={fast}")

