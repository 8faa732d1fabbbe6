"""Benchmark FP8 routed experts on one GPU: the expert layer in BF16 vs FP8, quantize kernels.

    tools/from_source.sh python3 tools/bench_fp8_experts.py --out $OUT/bench_fp8_experts.json

1. Expert layer at the ``bench-1gpu`` shapes (d_model 2048, 64 experts, top-8, hidden
   1024, 16k tokens: 131072 dispatched rows), forward and forward+backward (gradients of
   the rows and the three weights by ``torch.autograd.grad``, as the training step takes
   them), for ``balanced`` routing (every expert the same rows) and ``zipf`` (top-k of a
   Zipf(1.0) over the experts, the busy ones not the low ids). Layers:
   ``moe_model.GroupedExperts`` in BF16 (the model's own, its default backend),
   ``FP8GroupedExperts`` fp8_rowwise and fp8_rowwise_gw_hp (BF16 weight gradients) with
   the native GEMMs (``torch._scaled_grouped_mm``; the default accumulation, fast in the
   forward only, and fp8_rowwise also with every GEMM fast, torchao's grouped MoE choice,
   and with none, fp8_rowwise_gw_hp also with fast input gradients); the same on the
   Triton GEMM (``gemm="triton"``) and fp8_blockwise and fp8_blockwise_gw_fp8 (FP8 weight
   gradients per 128 tokens) on it; and fp8_blockwise emulated
   (dequantize + FP32 matmuls per expert) unless ``--no-blockwise``. BF16 compute weights
   everywhere; the FP8 layers' outputs are compared with BF16's (relative error in norm).
2. The grouped GEMMs alone (the candidates side by side, balanced routing): BF16
   ``torch._grouped_mm`` against FP8 ``torch._scaled_grouped_mm`` with FP32 promotion
   (``use_fast_accum=False``, the layer's backward GEMMs by default) and with fast
   accumulation (the layer's forward GEMMs by default, ``MXFP8Config.fp8_fast_accum``), on
   the forward (2d x 3d) and weight-gradient (2d x 2d) shapes of the gate/up projection;
   and this package's Triton FP8 GEMM (``gemm="triton"``) on the forward shape with rowwise
   scales (promoted and fast) and DeepSeek-V3's blockwise ones, and the blockwise weight
   gradient's Triton kernel (operands per column and 128 tokens), also adding into an FP32
   main grad in its epilogue (a gradient sink's add) beside moe_model's BF16 kernel doing
   the same (the BF16 experts' sink path). Then the dense GEMMs of
   ``FP8Linear`` at ``bench-1gpu``'s shapes (``--head-tokens`` rows: the LM head's forward
   and input gradient, the attention projections' ``[2048, 2048]`` and ``[512, 2048]``),
   rowwise with fast accumulation, the two GEMMs the layer can take side by side: torch's
   ``_scaled_mm`` (``gemm="native"``) and the Triton GEMM over one group
   (``gemm="triton"``), beside BF16 ``torch.mm``; and the LM head's weight gradient added
   into an FP32 main grad (``[vocab, d_model]``, over the head's tokens): in BF16 as the
   layer makes it today (one cuBLAS GEMM with FP32 output, beta 1), against FP8 from
   operands quantized per column along the tokens (the quantisation timed apart; the GEMM
   on the Triton kernel adding in its epilogue, and on ``_scaled_mm`` then an add).
   Unless ``--no-tile-sweep``, also each tile of ``FP8_GEMM_TILE_CANDIDATES`` and of
   ``WGRAD_TILE_CANDIDATES``, checked against the emulated GEMM first.
3. Quantize kernels on the dispatched rows ``[131072, 2048]`` BF16 and the gate/up weight
   ``[64, 2048, 2048]`` (also both rowwise copies of it written into a cache, as the
   weight refresh does, against concatenating, transposing and copying), and the FP8 row
   codec's kernels (``encode_fp8_rows``: BF16 rows to
   packed ``uint8[R, D + 4]``; ``decode_fp8_rows``: packed to BF16), each beside its
   reference on the same GPU (several torch passes), with a device copy of the rows
   measured in the same run as the ceiling; bandwidth counts the bytes a kernel must read
   and write. Also the rowwise quantisation of an LM head's output gradient
   ``[8192, 100352]`` (``tools/sweep_cross_entropy.py`` times the cross-entropy kernels
   that make it, and write its codes in their pass).
4. Unless ``--no-tile-sweep``: each of those kernels under each launch shape of
   ``TILE_CANDIDATES`` (``moe_mxfp8._fp8_kernels._TILES``) and ``CODEC_TILE_CANDIDATES``
   (``moe_mxfp8._fp8_codec_kernels._TILES``), checked bit-exact against the torch
   reference first, so those tables can be set from one run; ``wide_rows`` on an LM
   head's output gradient ``[--head-tokens, --vocab]`` BF16.
Prints a table last and writes JSON. Needs a CUDA GPU (compute capability 9.x for the
native path); ``--help`` works anywhere.
"""

from __future__ import annotations

import argparse
import json

PARTS = ("kernels", "tiles", "gemms", "layers")


def time_s(fn, iters: int, reps: int, host_ahead: bool = False) -> float:
    """Device seconds per call (``_bench.time_ms``); ``host_ahead`` for the layers, whose
    many launches a training step issues while the device is busy."""
    from _bench import time_ms

    return time_ms(fn, warmup=1, iters=iters, reps=reps, host_ahead=host_ahead) / 1e3


def gate_and_up(w13, hidden: int):
    """The gate and up halves of ``w13 [E, 2F, D]``, contiguous, as the experts hold them."""
    return [w13[:, :hidden].contiguous(), w13[:, hidden:].contiguous()]


def routed_offsets(kind: str, tokens: int, experts: int, top_k: int, seed: int = 0):
    """Cumulative int32 group ends of ``tokens * top_k`` rows for a routing kind."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    if kind == "balanced":
        counts = torch.full((experts,), tokens * top_k // experts, dtype=torch.int64)
    elif kind == "zipf":
        p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64)
        p = p[torch.randperm(experts, generator=gen)]
        ids = torch.multinomial(p.expand(tokens, experts), top_k, replacement=False, generator=gen)
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
    else:
        raise ValueError(f"unknown routing {kind!r}; expected balanced or zipf")
    return counts.cumsum(0).to(torch.int32).cuda()


def bench_layers(args, routing: str) -> dict:
    import torch
    from moe_model import GroupedExperts
    from moe_mxfp8 import FP8GroupedExperts
    from moe_mxfp8.fp8_gemm import FP8_GEMM_ROLES

    torch.manual_seed(0)
    bf16 = GroupedExperts(args.experts, args.d_model, args.hidden).cuda()
    for p in bf16.parameters():
        torch.nn.init.normal_(p, std=0.02)
    bf16 = bf16.to(torch.bfloat16)
    offsets = routed_offsets(routing, args.tokens, args.experts, args.top_k)
    rows_n = args.tokens * args.top_k
    rows = torch.randn(rows_n, args.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(rows)
    layers = {"bf16": bf16}
    for recipe in ("fp8_rowwise", "fp8_rowwise_gw_hp"):
        layers[recipe] = FP8GroupedExperts.from_module(bf16, recipe, "native")
    for name, roles in (("all", FP8_GEMM_ROLES), ("none", ())):
        layers[f"fp8_rowwise fast:{name}"] = FP8GroupedExperts.from_module(bf16, "fp8_rowwise", "native",
                                                                           fast_accum=roles)
    # the fastest bench-1gpu step measured (docs/performance.md): fast input gradients too
    fast_io = ("output", "grad_input")
    layers["fp8_rowwise_gw_hp fast:output,grad_input"] = FP8GroupedExperts.from_module(
        bf16, "fp8_rowwise_gw_hp", "native", fast_accum=fast_io)
    # the same recipes on this package's Triton GEMM, and DeepSeek-V3's blockwise scales
    layers["fp8_rowwise triton"] = FP8GroupedExperts.from_module(bf16, "fp8_rowwise", "triton")
    layers["fp8_rowwise_gw_hp triton"] = FP8GroupedExperts.from_module(bf16, "fp8_rowwise_gw_hp", "triton")
    layers["fp8_rowwise_gw_hp triton fast:output,grad_input"] = FP8GroupedExperts.from_module(
        bf16, "fp8_rowwise_gw_hp", "triton", fast_accum=fast_io)
    layers["fp8_rowwise triton fast:all"] = FP8GroupedExperts.from_module(
        bf16, "fp8_rowwise", "triton", fast_accum=FP8_GEMM_ROLES)
    layers["fp8_blockwise triton"] = FP8GroupedExperts.from_module(bf16, "fp8_blockwise", "triton")
    # DeepSeek-V3's recipe whole: the weight gradients in FP8 too, on their own Triton kernel
    layers["fp8_blockwise_gw_fp8 triton"] = FP8GroupedExperts.from_module(
        bf16, "fp8_blockwise_gw_fp8", "triton")
    if args.blockwise:
        layers["fp8_blockwise (emulated)"] = FP8GroupedExperts.from_module(bf16, "fp8_blockwise")
    flops = 3 * 2 * rows_n * args.d_model * args.hidden * 3  # forward + 2x backward, three GEMMs
    with torch.no_grad():
        y_ref = bf16(rows, offsets).float()
    results = {"max_rows_per_expert": int(torch.diff(offsets, prepend=offsets.new_zeros(1)).max())}
    for name, layer in layers.items():
        emulated = "emulated" in name
        iters, reps = (1, 3) if emulated else (3, 5)
        params = [layer.w1, layer.w3, layer.w2]
        fwd = time_s(lambda layer=layer: layer(rows, offsets), iters, reps, host_ahead=True)
        step = time_s(lambda layer=layer, params=params: torch.autograd.grad(
            layer(rows, offsets), [rows, *params], grad), iters, reps, host_ahead=True)
        with torch.no_grad():
            y = layer(rows, offsets).float()
        results[name] = {"forward_ms": fwd * 1e3, "fwd_bwd_ms": step * 1e3,
                         "fwd_bwd_tflops": flops / step / 1e12,
                         "rel_error_vs_bf16": float((y - y_ref).norm() / y_ref.norm())}
        if hasattr(layer, "refresh_weight_cache"):
            results[name]["weight_cache_refresh_ms"] = time_s(layer.refresh_weight_cache, 3, 5) * 1e3
    base = results["bf16"]["fwd_bwd_ms"]
    for name in layers:
        results[name]["speedup_vs_bf16"] = base / results[name]["fwd_bwd_ms"]
    return results


# Tiles of the Triton FP8 GEMM (moe_mxfp8.fp8_gemm.FP8TileConfig: block_m, block_n, block_k,
# group_m, warps, stages, TMA loads, programs per SM, TMA store), measured on the forward
# shape with rowwise (promoted and fast accumulation) and blockwise scales.
FP8_GEMM_TILE_CANDIDATES = [
    (128, 256, 128, 8, 8, 4, True, 1, True), (128, 256, 128, 8, 8, 3, True, 1, True),
    (64, 128, 128, 8, 4, 3, True, 2, True), (64, 128, 128, 8, 4, 4, True, 2, True),
    (128, 128, 128, 8, 8, 4, True, 1, True), (64, 256, 128, 8, 4, 4, True, 1, True),
    (128, 256, 128, 8, 8, 3, True, 1), (128, 256, 128, 8, 8, 4, True, 1),
    (256, 128, 128, 8, 8, 3, True, 1), (64, 256, 128, 8, 4, 4, True, 1),
    (64, 128, 128, 8, 4, 4, True, 2), (64, 128, 128, 8, 4, 3, True, 2),
    (64, 128, 128, 8, 4, 3, True, 3), (64, 128, 128, 4, 4, 3, True, 2),
    (64, 128, 128, 8, 4, 2, True, 3), (64, 256, 128, 8, 4, 2, True, 2),
    (128, 128, 128, 8, 8, 3, True, 2), (64, 128, 64, 8, 4, 6, True, 2),
]
# Tiles of the blockwise weight-gradient kernel (the same FP8TileConfig; group_m, TMA and
# programs per SM unused): an [N, K] output tile per program and expert, K steps over tokens.
WGRAD_TILE_CANDIDATES = [
    (64, 128, 128, 1, 4, 3, False), (64, 128, 128, 1, 4, 4, False), (128, 128, 128, 1, 8, 3, False),
    (128, 64, 128, 1, 4, 3, False), (64, 64, 128, 1, 4, 4, False), (128, 128, 64, 1, 8, 4, False),
    (64, 128, 64, 1, 4, 5, False), (128, 256, 128, 1, 8, 3, False),
]


def bench_gemms(args) -> dict:
    import torch
    from moe_model._grouped_mm_launch import wgrad_accumulate_
    from moe_mxfp8 import quantize_fp8, quantize_group_column_blocks, quantize_group_columns
    from moe_mxfp8.fp8_gemm import (
        FP8TileConfig,
        default_fp8_tiles,
        default_wgrad_tiles,
        fp8_grouped_mm,
        fp8_grouped_wgrad,
        triton_grouped_mm,
        triton_grouped_wgrad_blocks,
    )

    rows_n, E, D, F2 = args.tokens * args.top_k, args.experts, args.d_model, 2 * args.hidden
    offsets = routed_offsets("balanced", args.tokens, E, args.top_k)
    x = torch.randn(rows_n, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, F2, D, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(rows_n, F2, device="cuda", dtype=torch.bfloat16)
    xq, wq = quantize_fp8(x), quantize_fp8(w)
    xs, ws = xq.scale.reciprocal().view(-1), wq.scale.reciprocal().squeeze(-1)
    dy_t, dy_s, ends = quantize_group_columns(dy, offsets)
    x_t, x_s, _ = quantize_group_columns(x, offsets)
    dy_s, x_s = dy_s.reciprocal().view(-1), x_s.reciprocal().view(-1)
    flops = 2 * rows_n * D * F2

    def fp8_fwd(fast):
        return lambda: torch._scaled_grouped_mm(xq.data, wq.data.transpose(-2, -1), xs, ws,
                                                offs=offsets, out_dtype=torch.bfloat16,
                                                use_fast_accum=fast)

    def fp8_wgrad(fast):
        return lambda: torch._scaled_grouped_mm(dy_t, x_t.t(), dy_s, x_s, offs=ends,
                                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    xb, wb = quantize_fp8(x, (1, 128), pow2=False), quantize_fp8(w, (128, 128), pow2=False)
    dy_bt, dy_bs, block_ends = quantize_group_column_blocks(dy, offsets)
    x_bt, x_bs, _ = quantize_group_column_blocks(x, offsets)

    def wgrad_blocks(cfg=None, accumulate_into=None):
        return lambda: triton_grouped_wgrad_blocks(dy_bt, dy_bs, x_bt, x_bs, block_ends,
                                                   torch.bfloat16, cfg, accumulate_into)

    # a sink's FP32 main grad of the [E, 2F, D] weight: the BF16 experts' kernel adds into
    # it in its epilogue (moe_model), as the FP8 blockwise kernel does
    main_grad = torch.zeros(E, F2, D, device="cuda")
    operands = {"rowwise": (xq, wq), "blockwise": (xb, wb)}

    def fp8_triton(scales, fast, cfg=None):
        a, b = operands[scales]
        return lambda: triton_grouped_mm(a, b, offsets, torch.bfloat16, fast, cfg)

    cases = {
        "forward bf16 _grouped_mm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets),
        "forward fp8 _scaled_grouped_mm": fp8_fwd(False),
        "forward fp8 _scaled_grouped_mm fast_accum": fp8_fwd(True),
        "forward fp8 triton rowwise": fp8_triton("rowwise", False),
        "forward fp8 triton rowwise fast_accum": fp8_triton("rowwise", True),
        "forward fp8 triton blockwise": fp8_triton("blockwise", False),
        "wgrad bf16 _grouped_mm": lambda: torch._grouped_mm(dy.t(), x, offs=offsets),
        "wgrad fp8 _scaled_grouped_mm": fp8_wgrad(False),
        "wgrad fp8 _scaled_grouped_mm fast_accum": fp8_wgrad(True),
        "wgrad fp8 triton blockwise (128 tokens)": wgrad_blocks(),
        "wgrad bf16 moe_model kernel into FP32": lambda: wgrad_accumulate_(
            main_grad.view(-1), x, dy, offsets, w.transpose(1, 2)),
        "wgrad fp8 triton blockwise (128 tokens) into FP32": wgrad_blocks(accumulate_into=main_grad),
    }
    results = {}
    for name, fn in cases.items():
        seconds = time_s(fn, 5, 5)
        results[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
    results.update(bench_dense_gemms(args))
    if not args.tile_sweep:
        return results
    # every tile candidate is checked against the emulated GEMM (FP32) before it is timed
    refs = {k: fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", False) for k, (a, b) in operands.items()}
    for tile in FP8_GEMM_TILE_CANDIDATES:
        cfg = FP8TileConfig(*tile)
        for scales, fast in (("rowwise", False), ("rowwise", True), ("blockwise", False)):
            default = default_fp8_tiles(x.device, scales == "blockwise", fast)
            name = f"sweep {scales}{' fast' if fast else ''} {tile}" + (" *" if cfg == default else "")
            try:
                got = fp8_triton(scales, fast, cfg)().float()
                err = float((got - refs[scales]).norm() / refs[scales].norm())
                if not err < (1e-2 if fast else 5e-3):  # BF16 output: ~2e-3; fast: FAST_ACCUM_REL
                    results[name] = {"error": f"relative error {err:.3g} against the emulation"}
                    continue
                seconds = time_s(fp8_triton(scales, fast, cfg), 5, 5)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
                results[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            results[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "rel_error": err}
    ref = fp8_grouped_wgrad(dy, x, offsets, False, torch.float32, "emulated", False, blockwise=True)
    for tile in WGRAD_TILE_CANDIDATES:
        cfg = FP8TileConfig(*tile)
        name = f"sweep wgrad blockwise {tile}" + (" *" if cfg == default_wgrad_tiles(x.device) else "")
        try:
            got = wgrad_blocks(cfg)().float()
            err = float((got - ref).norm() / ref.norm())
            if not err < 5e-3:  # BF16 output: ~2e-3
                results[name] = {"error": f"relative error {err:.3g} against the emulation"}
                continue
            seconds = time_s(wgrad_blocks(cfg), 5, 5)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit
            results[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        results[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "rel_error": err}
    return results


KV_WIDTH = 512  # bench-1gpu's k and v projections: 4 KV heads of 128


def bench_dense_gemms(args) -> dict:
    """``FP8Linear``'s GEMMs, rowwise with fast accumulation: ``_scaled_mm`` against the
    Triton GEMM over one group, and BF16 (module notes, item 2)."""
    M, D, V = args.head_tokens, args.d_model, args.vocab
    shapes = {"head forward": (V, D), "head input gradient": (D, V), "q/o forward": (D, D),
              "k/v forward": (KV_WIDTH, D), "k/v input gradient": (D, KV_WIDTH)}
    results = {}
    for name, (N, K) in shapes.items():
        for gemm, r in _dense_gemm_rates(M, N, K).items():
            results[f"dense {name} [{M}, {K}] x [{N}, {K}] {gemm}"] = r
    for case, r in _head_weight_gradient_rates(M, D, V).items():
        results[f"dense head weight gradient [{V}, {D}] over {M} tokens {case}"] = r
    return results


def _head_weight_gradient_rates(M: int, D: int, V: int) -> dict:
    """``main += dy^T @ x`` for the LM head (``dy [M, V]``, ``x [M, D]``, ``main`` FP32
    ``[V, D]``): BF16 as ``moe_model.linear`` adds it, and the FP8 alternative's parts."""
    import torch
    from moe_model.linear import dense_grad_accumulate_
    from moe_mxfp8 import quantize_group_columns
    from moe_mxfp8.fp8 import FP8Tensor
    from moe_mxfp8.fp8_gemm import triton_grouped_mm

    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(M, V, device="cuda", dtype=torch.bfloat16) * 1e-4
    main = torch.zeros(V, D, device="cuda", dtype=torch.float32)
    one = torch.tensor([M], dtype=torch.int32, device="cuda")
    dy_t, dy_scale, _ = quantize_group_columns(dy, one)  # [V, W]: the tokens, padded to 16
    x_t, x_scale, _ = quantize_group_columns(x, one)
    a = FP8Tensor(dy_t[:, :M].contiguous(), dy_scale.view(V, 1), (1, 0))
    b = FP8Tensor(x_t[:, :M].contiguous().view(1, D, M), x_scale.view(1, D, 1), (1, 0))
    a_inv, b_inv = dy_scale.reciprocal().view(V, 1), x_scale.reciprocal().view(1, D)
    all_rows = torch.tensor([V], dtype=torch.int32, device="cuda")
    quantisation = "fp8 column quantisation of dy and x"
    cases = {
        "bf16 addmm (FP32 out, beta 1)": lambda: dense_grad_accumulate_(main.view(-1), x, dy),
        quantisation: lambda: (quantize_group_columns(dy, one), quantize_group_columns(x, one)),
        "fp8 triton, added in the epilogue": lambda: triton_grouped_mm(a, b, all_rows, torch.float32, True,
                                                                       accumulate_into=main),
        "fp8 native _scaled_mm FP32, then add_": lambda: main.add_(torch._scaled_mm(
            a.data, b.data[0].t(), a_inv, b_inv, out_dtype=torch.float32, use_fast_accum=True)),
    }
    rates = {}
    for case, fn in cases.items():
        seconds = time_s(fn, 5, 3, host_ahead=True)
        rates[case] = ({"ms": seconds * 1e3, "tb_per_s": 3 * M * (V + D) / seconds / 1e12}  # read 2, write 1
                       if case == quantisation else
                       {"ms": seconds * 1e3, "tflops": 2 * M * D * V / seconds / 1e12})
    return rates


def _dense_gemm_rates(M: int, N: int, K: int) -> dict:
    """``[M, K] @ [N, K]^T`` by each GEMM ``FP8Linear`` can take, and BF16."""
    import torch
    from moe_mxfp8 import quantize_fp8
    from moe_mxfp8.fp8_linear import _mm

    a_bf, b_bf = (torch.randn(n, K, device="cuda", dtype=torch.bfloat16) for n in (M, N))
    a, b = quantize_fp8(a_bf), quantize_fp8(b_bf)
    rows = torch.full((1,), M, dtype=torch.int32, device="cuda")
    b_inv = b.scale.reciprocal()  # held by the weight cache, derived once per refresh
    cases = {  # the layer's own GEMM call: the input's scale inverted, the one-group view
        "native _scaled_mm": lambda: _mm(a, b, None, "native", torch.bfloat16, True, None,
                                         (a.scale.reciprocal(), b_inv)),
        "triton": lambda: _mm(a, b, rows, "triton", torch.bfloat16, True),
        "bf16 mm": lambda: torch.mm(a_bf, b_bf.t()),
    }
    rates = {}
    for gemm, fn in cases.items():
        # device time with the host queueing ahead, as in a step replayed from CUDA graphs:
        # at the k and v projections' sizes a GEMM takes less than launching it
        seconds = time_s(fn, 5, 5, host_ahead=True)
        rates[gemm] = {"ms": seconds * 1e3, "tflops": 2 * M * N * K / seconds / 1e12}
    return rates


# Launch shapes per kernel kind of moe_mxfp8._fp8_kernels (its _TILES): BlockTile(elements,
# warps[, groups[, chunk_rows]]) for the block kinds (groups: scale blocks side by side per
# program; chunk_rows: 128x128 blocks in two passes of that many rows),
# ColumnTile(rows, cols, warps[, reverse[, longest_first]]) for the per-expert columns
# (timed on Zipf routing and, as balanced_tb_per_s, on balanced routing).
TILE_CANDIDATES = {
    "rows": [(2048, 2), (4096, 4), (1024, 2), (2048, 1), (4096, 2), (8192, 4)],
    "wide_rows": [(4096, 4), (2048, 2), (2048, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 16)],
    "tiles": [(1024, 1, 8), (2048, 2, 16), (4096, 4), (2048, 1, 16), (4096, 2, 16), (2048, 2, 8),
              (512, 1, 4), (1024, 1, 4), (1024, 2, 8), (2048, 1, 8)],
    "blocks": [(16384, 8, 1, 64), (16384, 4, 1, 32), (16384, 8, 1, 32), (16384, 4, 1, 64),
               (16384, 16, 1, 64), (16384, 8, 1, 128), (16384, 16, 2), (16384, 4),
               (16384, 8, 2, 64), (16384, 8), (16384, 16), (16384, 4, 1, 16), (16384, 8, 2, 32),
               (16384, 8, 4, 32)],
    # the "blocks" kernel writing a weight's both 128x128-block copies (quantize_weight_blocks)
    "weight_blocks": [(16384, 8, 1, 64), (16384, 4, 1, 32), (16384, 8, 1, 32), (16384, 4, 1, 64),
                      (16384, 16, 1, 64), (16384, 8, 1, 128), (16384, 16, 2), (16384, 8),
                      (16384, 8, 2, 32)],
    "group_columns": [(512, 32, 8, True, True), (128, 64, 8), (128, 64, 8, True), (256, 64, 8),
                      (256, 32, 4, True), (256, 32, 4, True, True), (256, 64, 8, True, True),
                      (256, 16, 4, True, True), (512, 16, 4, True, True), (256, 32, 8, True, True)],
    # per column and 128 tokens (the blockwise weight gradients' operands): 128 rows a program
    "column_blocks": [(128, 32, 4), (128, 64, 4), (128, 32, 2), (128, 128, 4), (128, 128, 8),
                      (128, 64, 8), (128, 16, 1), (128, 256, 8)],
}
# moe_mxfp8._swiglu_kernels._TILES: BlockTile(elements, warps), whole rows per program.
_SWIGLU_SHAPES = [(2048, 4), (1024, 1), (1024, 2), (1024, 4), (2048, 2), (2048, 8), (4096, 4),
                  (4096, 8), (8192, 8)]
# sweep kinds that time another entry point of a kernel kind's launch shapes
TILE_KEY = {"weight_blocks": "blocks"}
SWIGLU_TILE_CANDIDATES = {"swiglu": _SWIGLU_SHAPES, "swiglu_backward": _SWIGLU_SHAPES}
# moe_mxfp8._fp8_codec_kernels._TILES: RowTile(elements, warps).
CODEC_TILE_CANDIDATES = {
    "encode": [(2048, 2), (2048, 4), (1024, 1), (1024, 2), (4096, 4), (8192, 8)],
    "decode": [(2048, 2), (2048, 4), (1024, 1), (1024, 2), (4096, 4), (8192, 8)],
}


def sweep_tiles(args) -> dict:
    import torch
    from moe_mxfp8 import (
        _fp8_codec_kernels,
        _fp8_kernels,
        _swiglu_kernels,
        decode_fp8_rows,
        encode_fp8_rows,
        quantize_fp8,
        quantize_group_column_blocks,
        quantize_group_columns,
        quantize_weight_blocks,
        swiglu_backward_quantized,
        swiglu_quantized,
    )

    rows_n = args.tokens * args.top_k
    x = torch.randn(rows_n, args.d_model, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.experts, 2 * args.hidden, args.d_model, device="cuda", dtype=torch.bfloat16)
    offsets = routed_offsets("zipf", args.tokens, args.experts, args.top_k)
    balanced = routed_offsets("balanced", args.tokens, args.experts, args.top_k)
    n, nw = x.numel(), w.numel()
    out = torch.empty_like(x)
    copy = 4 * n / time_s(lambda: out.copy_(x), 10, 7)

    def blocks(t, block, pow2, backend="auto"):
        q = quantize_fp8(t, block, pow2, backend=backend)
        return [q.data.view(torch.uint8), q.scale]

    def weight_blocks(parts, backend="auto"):
        rows, cols = quantize_weight_blocks(parts, backend=backend)
        return [rows.data.view(torch.uint8), rows.scale, cols.data.view(torch.uint8), cols.scale]

    def columns(t, backend="auto"):
        data_t, scale, ends = quantize_group_columns(t, offsets[-8:] - offsets[-9], True, backend)
        return [data_t[:, :int(ends[-1])].view(torch.uint8), scale]

    def column_blocks(t, backend="auto"):
        data_t, scale, _ = quantize_group_column_blocks(t, offsets[-8:] - offsets[-9], False, backend)
        return [data_t.view(torch.uint8), scale]

    head = x[:4096]
    gate_up = gate_and_up(w, args.hidden)
    tail = x[int(offsets[-9]):int(offsets[-1])]  # the last 8 experts' rows, for the check
    packed = encode_fp8_rows(x)
    # the experts' SwiGLU: h13 [R, 2F] (and dh [R, F] for the backward, which also writes h)
    h13 = torch.randn(rows_n, 2 * args.hidden, device="cuda", dtype=torch.bfloat16)
    dh = torch.randn(rows_n, args.hidden, device="cuda", dtype=torch.bfloat16)
    h_out = torch.empty_like(dh)

    def swiglu_fwd(t, b="auto"):
        q = swiglu_quantized(t, (1, 0), True, b)
        return [q.data.view(torch.uint8), q.scale]

    def swiglu_bwd(t, b="auto"):
        h = h_out[:t.shape[0]]
        dh13, q = swiglu_backward_quantized(t, dh[:t.shape[0]], t.dtype, (1, 0), True, b, h)
        return [dh13, q.data.view(torch.uint8), q.scale, h]
    nh = dh.numel()
    # an LM head's output gradient: one microbatch's tokens by the vocabulary
    logits = torch.randn(args.head_tokens, args.vocab, device="cuda", dtype=torch.bfloat16)
    work = {
        "rows": (lambda t, b="auto": blocks(t, (1, 0), True, b), x, head, 3 * n + 4 * rows_n),
        "wide_rows": (lambda t, b="auto": blocks(t, (1, 0), True, b), logits, logits[:64],
                      3 * logits.numel() + 4 * logits.shape[0]),
        "tiles": (lambda t, b="auto": blocks(t, (1, 128), False, b), x, head, 3 * n + n // 32),
        "blocks": (lambda t, b="auto": blocks(t, (128, 128), False, b), w, w[:2], 3 * nw),
        # both copies, as the blockwise weight cache refreshes: read once, written twice
        "weight_blocks": (weight_blocks, gate_up, [p[:2] for p in gate_up], 4 * nw),
        "group_columns": (None, x, tail, 3 * n + 4 * args.experts * args.d_model),
        "column_blocks": (None, x, tail, 3 * n + 4 * (n // 128 + args.experts * args.d_model)),
        "encode": (lambda t, b="auto": [encode_fp8_rows(t, b)], x, head, 3 * n + 4 * rows_n),
        "decode": (lambda t, b="auto": [decode_fp8_rows(t, torch.bfloat16, b)], packed, packed[:4096],
                   3 * n + 4 * rows_n),
        # bytes: h13 read, the E4M3 rows and scales written (the backward: h13 and dh read;
        # dh13, its E4M3 rows, scales and h written)
        "swiglu": (swiglu_fwd, h13, h13[:4096], 4 * nh + nh + 4 * rows_n),
        "swiglu_backward": (swiglu_bwd, h13, h13[:4096], (4 + 2) * nh + (4 + 2 + 2) * nh + 4 * rows_n),
    }
    defaults = {_fp8_kernels: dict(_fp8_kernels._TILES), _fp8_codec_kernels: dict(_fp8_codec_kernels._TILES),
                _swiglu_kernels: dict(_swiglu_kernels._TILES)}
    # The SwiGLU kernels compute in FP32 with exp, which the torch reference rounds
    # differently: their candidates are checked against the default shape's bytes instead.
    groups = [(_fp8_kernels, kind, cands) for kind, cands in TILE_CANDIDATES.items()]
    groups += [(_fp8_codec_kernels, kind, cands) for kind, cands in CODEC_TILE_CANDIDATES.items()]
    groups += [(_swiglu_kernels, kind, cands) for kind, cands in SWIGLU_TILE_CANDIDATES.items()]
    groups = [g for g in groups if args.tile_kinds is None or g[1] in args.tile_kinds]
    expected = {kind: [t.clone() for t in work[kind][0](work[kind][2])]
                for _, kind, _ in groups if kind in SWIGLU_TILE_CANDIDATES}
    results = {"copy_tb_per_s": copy / 1e12}
    try:
        for module, kind, candidates in groups:
            fn, full, sample, nbytes = work[kind]
            default, key = defaults[module], TILE_KEY.get(kind, kind)

            def check(kind=kind, fn=fn, sample=sample):
                if kind == "group_columns":
                    return columns(sample), columns(sample, "reference")
                if kind == "column_blocks":
                    return column_blocks(sample), column_blocks(sample, "reference")
                return fn(sample), expected[kind] if kind in expected else fn(sample, "reference")

            def timed(kind=kind, fn=fn, full=full):
                if kind == "column_blocks":
                    return quantize_group_column_blocks(full, offsets, False)
                return (quantize_group_columns(full, offsets, True) if kind == "group_columns"
                        else fn(full))

            for cand in candidates:
                tile_cls = (_fp8_codec_kernels.RowTile if module is _fp8_codec_kernels
                            else _fp8_kernels.ColumnTile if kind in ("group_columns", "column_blocks")
                            else _fp8_kernels.BlockTile)
                tile = tile_cls(*cand)
                entry = {"tile": list(cand), "default": tile == default[key]}
                module._TILES[key] = tile  # what the launchers read at every call
                try:
                    got, ref = check()
                    bad = sum(int((g.view(torch.uint8) != r.view(torch.uint8)).sum())
                              for g, r in zip(got, ref, strict=True))
                    if bad:
                        entry["error"] = f"{bad} bytes differ from the torch reference"
                    else:
                        rate = nbytes / time_s(timed, 10, 5)
                        entry.update(tb_per_s=rate / 1e12, fraction_of_copy=rate / copy)
                        if kind == "group_columns":
                            entry["balanced_tb_per_s"] = nbytes / time_s(
                                lambda: quantize_group_columns(x, balanced, True), 10, 5) / 1e12
                except Exception as e:  # noqa: BLE001 - a candidate that fails is reported
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                results[f"{kind} {cand}"] = entry
            module._TILES[key] = default[key]
    finally:
        for module, default in defaults.items():
            module._TILES.update(default)
    return results


def bench_kernels(args) -> dict:
    import torch
    from moe_mxfp8 import (
        decode_fp8_rows,
        decode_fp8_rows_reference,
        encode_fp8_rows,
        encode_fp8_rows_reference,
        quantize_fp8,
        quantize_group_column_blocks,
        quantize_group_columns,
        quantize_weight_blocks,
        quantize_weight_rowwise,
    )

    rows_n = args.tokens * args.top_k
    x = torch.randn(rows_n, args.d_model, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(args.experts, 2 * args.hidden, args.d_model, device="cuda", dtype=torch.bfloat16)
    offsets = routed_offsets("zipf", args.tokens, args.experts, args.top_k)
    balanced = routed_offsets("balanced", args.tokens, args.experts, args.top_k)
    n, nw = x.numel(), w.numel()
    out = torch.empty_like(x)
    packed = encode_fp8_rows(x)
    wide = torch.randn(8192, 100352, device="cuda", dtype=torch.bfloat16)
    # the gate/up weight cache's refresh in place: both copies of [w1; w3] written into the
    # cache's tensors, and the way without quantize_weight_rowwise (concatenate, transpose in
    # BF16, quantize each, copy into the cache); both counted as the bytes that must move
    gate, up = gate_and_up(w, args.hidden)
    cache = quantize_weight_rowwise([gate, up])
    block_cache = quantize_weight_blocks([gate, up])

    def copies_through_transpose():
        whole = torch.cat([gate, up], dim=-2)
        for dst, src in ((cache[0], whole), (cache[1], whole.mT.contiguous())):
            q = quantize_fp8(src, (1, 0), True)
            dst.data.copy_(q.data)
            dst.scale.copy_(q.scale)
    cases = {
        "device copy (ceiling)": (lambda: out.copy_(x), 4 * n),
        "rowwise rows [R, D]": (lambda: quantize_fp8(x, (1, 0), True), 3 * n + 4 * rows_n),
        "1x128 tiles [R, D]": (lambda: quantize_fp8(x, (1, 128), False), 3 * n + 4 * n // 128),
        "per-expert columns, transposed [R, D]": (
            lambda: quantize_group_columns(x, offsets, True), 3 * n + 4 * args.experts * args.d_model),
        "per-expert columns, transposed [R, D], balanced": (
            lambda: quantize_group_columns(x, balanced, True), 3 * n + 4 * args.experts * args.d_model),
        # the blockwise weight gradients' operand: a scale per column and 128 tokens of an expert
        "128-token column blocks, transposed [R, D]": (
            lambda: quantize_group_column_blocks(x, offsets, False),
            3 * n + 4 * (n // 128 + args.experts * args.d_model)),
        "rowwise weight [E, 2F, D]": (lambda: quantize_fp8(w, (1, 0), True), 3 * nw),
        # an LM head's output gradient: rows of the vocabulary, walked in chunks
        "rowwise rows [8192, 100352]": (lambda: quantize_fp8(wide, (1, 0), True),
                                        3 * wide.numel() + 4 * wide.shape[0]),
        "128x128 weight [E, 2F, D]": (lambda: quantize_fp8(w, (128, 128), False), 3 * nw),
        "rowwise weight copies, gate and up [E, 2F, D]": (
            lambda: quantize_weight_rowwise([gate, up], True, out=cache), 4 * nw),
        "the same through a BF16 transpose": (copies_through_transpose, 4 * nw),
        "128x128 weight copies, gate and up [E, 2F, D]": (
            lambda: quantize_weight_blocks([gate, up], out=block_cache), 4 * nw),
        # the row codec: BF16 rows <-> packed uint8 [R, D + 4], the kernel and the reference
        "row codec encode [R, D]": (lambda: encode_fp8_rows(x), 3 * n + 4 * rows_n),
        "row codec encode, reference": (lambda: encode_fp8_rows_reference(x), 3 * n + 4 * rows_n),
        "row codec decode to BF16 [R, D]": (lambda: decode_fp8_rows(packed, torch.bfloat16), 3 * n + 4 * rows_n),
        "row codec decode, reference": (lambda: decode_fp8_rows_reference(packed, torch.bfloat16),
                                        3 * n + 4 * rows_n),
    }
    results = {}
    for name, (fn, nbytes) in cases.items():
        seconds = time_s(fn, 10, 7)
        results[name] = {"ms": seconds * 1e3, "bytes": nbytes, "tb_per_s": nbytes / seconds / 1e12}
    copy = results["device copy (ceiling)"]["tb_per_s"]
    for r in results.values():
        r["fraction_of_copy"] = r["tb_per_s"] / copy
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--out", default="bench_fp8_experts.json", help="JSON report path")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=100352,
                    help="row width of the wide-row sweep (an LM head's output gradient)")
    ap.add_argument("--head-tokens", type=int, default=8192, help="rows of the wide-row sweep")
    ap.add_argument("--tile-kinds", nargs="+", default=None,
                    choices=[*TILE_CANDIDATES, *CODEC_TILE_CANDIDATES, *SWIGLU_TILE_CANDIDATES],
                    help="the kernels the tile sweep covers (default: all)")
    ap.add_argument("--routing", default="balanced,zipf", help="comma-separated: balanced, zipf")
    ap.add_argument("--no-tile-sweep", dest="tile_sweep", action="store_false",
                    help="skip measuring the quantize kernels' launch shapes and the Triton "
                         "FP8 GEMM's tiles")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {','.join(PARTS)} (the numbered "
                         "items above: kernels and tiles are 3 and 4)")
    ap.add_argument("--no-blockwise", dest="blockwise", action="store_false",
                    help="skip the emulated fp8_blockwise layer (FP32 matmuls, the slowest part)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")

    import torch
    from moe_mxfp8 import fp8_native_available

    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_experts needs a CUDA GPU")
    if not fp8_native_available(torch.device("cuda")):
        raise SystemExit("bench_fp8_experts needs torch._scaled_grouped_mm on compute capability 9.x")
    kernels = bench_kernels(args) if "kernels" in parts else {}
    tiles = sweep_tiles(args) if args.tile_sweep and "tiles" in parts else None
    gemms = bench_gemms(args) if "gemms" in parts else {}
    layers = ({kind: bench_layers(args, kind) for kind in args.routing.split(",")}
              if "layers" in parts else {})
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": vars(args), "kernels": kernels, "tile_sweep": tiles, "gemms": gemms, "experts": layers}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)

    print(f"\n{report['device']}, torch {torch.__version__}; rows [{args.tokens * args.top_k}, "
          f"{args.d_model}], {args.experts} experts, hidden {args.hidden}")
    if kernels:  # each table only where its part ran
        print(f"{'kernel':40s} {'ms':>8s} {'TB/s':>7s} {'of copy':>8s}")
        for name, r in kernels.items():
            print(f"{name:40s} {r['ms']:8.3f} {r['tb_per_s']:7.2f} {r['fraction_of_copy']:8.0%}")
    if tiles is not None:
        print(f"\n{'launch shape (sweep)':40s} {'TB/s':>7s} {'of copy':>8s}")
        for name, r in tiles.items():
            if isinstance(r, dict):
                mark = " *" if r["default"] else ""
                rate = (f"{r['tb_per_s']:7.2f} {r['fraction_of_copy']:8.0%}" if "error" not in r
                        else r["error"][:60])
                print(f"{name + mark:40s} {rate}")
    if gemms:
        print(f"\n{'GEMMs (grouped: gate/up shapes, balanced; dense: FP8Linear)':72s} {'ms':>8s} "
              f"{'TFLOP/s':>8s}")
        for name, r in gemms.items():
            rate = (r["error"][:60] if "error" in r else f"{r['ms']:8.3f} {r['tflops']:8.0f}" if "tflops" in r
                    else f"{r['ms']:8.3f} {r['tb_per_s']:8.2f} TB/s")
            print(f"{name:72s} {rate}")
    if layers:
        print(f"\n{'routing':9s} {'layer':48s} {'fwd ms':>8s} {'f+b ms':>8s} {'TFLOP/s':>8s} "
              f"{'vs bf16':>8s} {'rel err':>8s}")
        for kind, res in layers.items():
            for name, r in res.items():
                if isinstance(r, dict):
                    print(f"{kind:9s} {name:48s} {r['forward_ms']:8.2f} {r['fwd_bwd_ms']:8.2f} "
                          f"{r['fwd_bwd_tflops']:8.0f} {r['speedup_vs_bf16']:7.2f}x "
                          f"{r['rel_error_vs_bf16']:8.4f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
