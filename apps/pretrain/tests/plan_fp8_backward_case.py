"""What the FP8 experts' and FP8Linear's backward allocate on the GPU path, measured on CPU.

Run by ``test_plan.py`` in a child process with ``TRITON_INTERPRET=1`` (set before Triton
is imported, see ``moe_testing.run_under_triton_interpreter``): moe_mxfp8's Triton
kernels run in the interpreter as they would on CUDA (quantization, fused SwiGLU), and
the GEMMs a GPU runs (native where the recipe has one, else moe_mxfp8's Triton GEMM) are
stood in for by their output allocations (``torch._scaled_grouped_mm``,
``torch._grouped_mm``, ``triton_grouped_mm`` and ``triton_grouped_wgrad_blocks`` write one
tensor each). The layer hands
its weight gradients to a gradient sink, wired as the trainer wires it on CUDA
(``moe_model.wire_model``: the recipes with BF16 weight gradients hand them to
moe_model's kernel, whose launch adds into the FP32 target in place and allocates
nothing, so it is stood in for by nothing: in the interpreter it took half the run).

FP8Linear likewise (``LINEARS``: attention's q, k and v through
``FP8Linear.shared_input_forward``, then one layer alone), on the Triton GEMM and, for the
recipes that have one, the native ``torch._scaled_mm`` (stood in for by its output); its
weight gradients go to the sink as on CUDA, where the recipe computes them in BF16 by
moe_model's ``dense_grad_accumulate_`` (one cuBLAS GEMM into the FP32 target there:
nothing allocated, so stood in for by nothing).

Prints one JSON line ``{"shape": {...}, recipe: [held after the forward, backward
high-water mark above what was live when it started], "linears_shape": LINEARS,
"linears": {"<recipe> <gemm>": [[held, peak] of q, k and v, [held, peak] of the single
layer]}}`` and ``ok``; bytes
from ``pretrain.planner.measure.LiveBytes``.
"""

from __future__ import annotations

import gc
import json
import os

import torch
from moe_model import ModelWiring, wire_model
from moe_model import _grouped_mm_launch as grouped_mm_launch
from moe_model import linear as model_linear
from moe_model import wiring as model_wiring
from moe_mxfp8 import FP8_RECIPES, FP8GroupedExperts, FP8Linear, fp8_gemm, gemm
from moe_mxfp8 import _triton_support as triton_support
from pretrain.planner.measure import LiveBytes

assert os.environ.get("TRITON_INTERPRET") == "1", "run by moe_testing.run_under_triton_interpreter"

# test_plan.py's LOW_PRECISION model: d_model 128, expert hidden 192, 8 experts, and the
# 2 x 64 tokens of a microbatch routed top-2 (R = 256 rows)
SHAPE = {"rows": 768, "d_model": 128, "hidden": 192, "experts": 8}
# FP8Linear: M rows of K features into the output widths of q, k and v (shared input),
# then into one output width alone
LINEARS = {"rows": 128, "in": 128, "qkv": [128, 64, 64], "single": 512}


def _scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """The native FP8 GEMM's output: [R, N] from [R, K] x [E, K, N], [E, N, K] over tokens."""
    shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[1])
    return torch.zeros(shape, dtype=out_dtype)


def _triton_grouped_mm(a, b, offsets, out_dtype, fast_accum, config=None, accumulate_into=None):
    """The Triton FP8 GEMM's output: [R, N] from [R, K] x [E, N, K] (or the tensor it adds to)."""
    if accumulate_into is not None:
        return accumulate_into
    return torch.empty(a.data.shape[0], b.data.shape[1], dtype=out_dtype)


def _triton_wgrad_blocks(a_t, a_scale, b_t, b_scale, padded_ends, out_dtype, config=None,
                         accumulate_into=None):
    """The Triton blockwise FP8 weight-gradient kernel's output: [E, N, K] from [N, W], [K, W],
    or the target it adds into."""
    if accumulate_into is not None:
        return accumulate_into
    return torch.empty(padded_ends.shape[0], a_t.shape[0], b_t.shape[0], dtype=out_dtype)


def _grouped_mm(a, b, offs):
    """The BF16 grouped GEMM's output (weight gradients: [E, N, K] from [N, R] x [R, K])."""
    shape = (a.shape[0], b.shape[-1]) if b.dim() == 3 else (offs.shape[0], a.shape[0], b.shape[1])
    return torch.zeros(shape, dtype=a.dtype)


class _Sink:
    """Takes every weight's gradient into an FP32 flat accumulator, as moe_ddp does."""

    def __init__(self, params: tuple[torch.nn.Parameter, ...]) -> None:
        self.targets = {id(p): torch.zeros(p.numel()) for p in params}

    def accepts(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.targets

    def add_gradient(self, param: torch.nn.Parameter, add) -> None:
        add(self.targets[id(param)])


def measure(recipe: str) -> list[int]:
    R, D, F, E = (SHAPE[k] for k in ("rows", "d_model", "hidden", "experts"))
    torch.manual_seed(0)
    w1, w3, w2 = (torch.nn.Parameter(torch.randn(*s, dtype=torch.bfloat16) / 8)
                  for s in ((E, F, D), (E, F, D), (E, D, F)))
    native = FP8_RECIPES[recipe].native
    layer = FP8GroupedExperts(w1, w3, w2, recipe, "native" if native else "triton")
    # as the trainer wires it: recipes with BF16 weight gradients hand them to moe_model's kernel
    wire_model(layer, ModelWiring(gradient_sink=_Sink((w1, w3, w2))))
    x = torch.randn(R, D, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(R, D, dtype=torch.bfloat16)
    offsets = torch.linspace(R / E, R, E).round().to(torch.int32)
    with LiveBytes() as live:
        y = layer(x, offsets)
        held = live.live - y.untyped_storage().nbytes()
        start = live.live
        live.reset_peak()
        torch.autograd.backward(y, dy)
        return [held, live.peak - start]


def _scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
    """The native dense FP8 GEMM's output: [M, N] from [M, K] x [K, N]."""
    return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)


def measure_linears(recipe: str, gemm_name: str) -> list[list[int]]:
    M, K = LINEARS["rows"], LINEARS["in"]
    results = []
    for widths in (LINEARS["qkv"], [LINEARS["single"]]):
        torch.manual_seed(0)
        layers = [FP8Linear(torch.nn.Parameter(torch.randn(n, K, dtype=torch.bfloat16) / 8), None,
                            recipe, gemm_name) for n in widths]
        for layer in layers:
            layer.refresh_weight_cache()
            wire_model(layer, ModelWiring(gradient_sink=_Sink((layer.weight,))))
        x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
        dys = [torch.randn(M, n, dtype=torch.bfloat16) for n in widths]
        with LiveBytes() as live:
            ys = FP8Linear.shared_input_forward(x, tuple(layers))
            held = live.live - sum(y.untyped_storage().nbytes() for y in ys)
            start = live.live
            live.reset_peak()
            torch.autograd.backward(ys, dys)
            results.append([held, live.peak - start])
    return results


def main() -> None:
    torch.manual_seed(0)
    triton_support.fused_kernels_enabled = lambda device: True  # the kernels, as on CUDA
    model_wiring.fused_kernels_enabled = lambda device: True  # moe_model's, too
    fp8_gemm.fp8_native_available = lambda device: True  # the layers check through fp8_gemm
    fp8_gemm.fp8_triton_available = lambda device: True
    fp8_gemm.triton_grouped_mm = _triton_grouped_mm
    fp8_gemm.triton_grouped_wgrad_blocks = _triton_wgrad_blocks
    gemm._fits_grouped_mm = lambda a, b: True
    torch._scaled_grouped_mm = _scaled_grouped_mm
    torch._grouped_mm = _grouped_mm
    torch._scaled_mm = _scaled_mm
    model_linear._addmm_ = lambda out, a, b: None  # cuBLAS adds into the FP32 target in place
    grouped_mm_launch._launch_wgrad = lambda *args: None  # the kernel adds into it in place
    from triton.runtime.interpreter import GridExecutor

    launch = GridExecutor.__call__

    def launch_and_collect(self, *args, **kwargs):
        """A launch, then a collection: the interpreter leaves reference cycles that hold
        the kernel's tensor arguments, which a compiled kernel's launch does not."""
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    GridExecutor.__call__ = launch_and_collect
    linears = {f"{r} {g}": measure_linears(r, g) for r in FP8_RECIPES
               for g in (("triton", "native") if FP8_RECIPES[r].native else ("triton",))}
    print(json.dumps({"shape": SHAPE, **{r: measure(r) for r in FP8_RECIPES},
                      "linears_shape": LINEARS, "linears": linears}))
    print("ok")


if __name__ == "__main__":
    main()
