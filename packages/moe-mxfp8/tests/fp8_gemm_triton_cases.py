"""Cases of the FP8 grouped GEMM kernel (``gemm="triton"``, moe_mxfp8._fp8_gemm_kernels),
run by test_fp8_gemm_triton.py through ``moe_testing.run_under_triton_interpreter`` (a
child process with ``TRITON_INTERPRET=1`` set before Triton is imported). Each case
compares the kernel with the emulated GEMM (dequantize, FP32 matmul per expert) and
returns how many elements differ by more than FP32 summation order explains (or an error
string). Prints one line of JSON, then ``ok``."""

from __future__ import annotations

import os
from unittest import mock

assert os.environ.get("TRITON_INTERPRET") == "1", "run by moe_testing.run_under_triton_interpreter"

import torch  # noqa: E402
from case_helpers import report  # noqa: E402
from moe_mxfp8 import FP8GroupedExperts, FP8Linear, quantize_fp8, quantize_group_column_blocks  # noqa: E402
from moe_mxfp8.fp8_gemm import (  # noqa: E402
    FP8TileConfig,
    fp8_grouped_mm,
    fp8_grouped_wgrad,
    fp8_wgrad_mm,
    quantize_wgrad_operands,
    triton_grouped_mm,
    triton_grouped_wgrad_blocks,
)
from torch import nn  # noqa: E402

# An empty expert, a one-row expert, a group across tiles; rows 41.. are padding.
OFFSETS = [9, 9, 10, 41]
RECIPE_BLOCKS = {"rowwise": ((1, 0), (1, 0), True), "blockwise": ((1, 128), (128, 128), False)}
RTOL = 2e-6  # of the result's largest magnitude: FP32 sums of up to 200 terms in another order


def far(got: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> int:
    """Elements of ``got`` further from ``ref`` than ``rtol`` of ``ref``'s largest magnitude."""
    if got.shape != ref.shape:
        return -1
    tol = rtol * ref.abs().max().clamp_min(1e-30)
    return int(((got.float() - ref.float()).abs() > tol).sum())


def operands(kind: str, K: int, N: int, seed: int = 0):
    a_block, b_block, pow2 = RECIPE_BLOCKS[kind]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, K, generator=g) * torch.exp2(torch.randint(-6, 6, (48, 1), generator=g).float())
    w = torch.randn(len(OFFSETS), N, K, generator=g)
    return quantize_fp8(x, a_block, pow2), quantize_fp8(w, b_block, pow2)


def cases():
    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
    end = OFFSETS[-1]
    # K 200: two 128-wide scale blocks, the second cut, and a partial K step; N 144: two
    # weight blocks along N and a partial n-tile; K 160, N 128 take whole steps and tiles.
    for kind in RECIPE_BLOCKS:
        for K, N in ((200, 144), (160, 128)):
            for fast in (False, True):
                def gemm(kind=kind, K=K, N=N, fast=fast):
                    a, b = operands(kind, K, N)
                    ref = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", fast)[:end]
                    got = fp8_grouped_mm(a, b, offsets, torch.float32, "triton", fast)[:end]
                    got16 = fp8_grouped_mm(a, b, offsets, torch.bfloat16, "triton", fast)[:end]
                    # BF16 output within one BF16 unit of the FP32 one (the interpreter
                    # truncates where the GPU rounds to nearest)
                    off16 = (got16.float() - got).abs() > got.abs() * 2.0**-7
                    return far(got, ref) + int(off16.sum())

                yield f"gemm/{kind}/K{K}xN{N}/fast={fast}", gemm

    def wide_k_step():  # a K step of 32 over blockwise scales of 128: four steps per scale
        a, b = operands("blockwise", 200, 144, seed=1)
        ref = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", False)[:end]
        cfg = FP8TileConfig(16, 32, 32, 1, 1, 1, False)
        return far(triton_grouped_mm(a, b, offsets, torch.float32, False, cfg)[:end], ref)

    yield "gemm/blockwise/k_step32", wide_k_step

    def wide_tile():  # an n-tile wider than a weight block: a scale per column, not per tile
        a, b = operands("blockwise", 200, 272, seed=5)  # N 272: three weight blocks, the last cut
        ref = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", False)[:end]
        cfg = FP8TileConfig(16, 256, 32, 1, 1, 1, False)
        return far(triton_grouped_mm(a, b, offsets, torch.float32, False, cfg)[:end], ref)

    yield "gemm/blockwise/wide_tile", wide_tile

    def accumulate():  # y += a @ b^T in the epilogue: FP32 and BF16 results, padding rows kept
        a, b = operands("rowwise", 200, 144, seed=2)
        ref = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", False)
        errors = 0
        for dtype in (torch.float32, torch.bfloat16):
            start = torch.randn(48, 144, generator=torch.Generator().manual_seed(4)).to(dtype)
            got = start.clone()
            out = fp8_grouped_mm(a, b, offsets, dtype, "triton", False, accumulate_into=got)
            want = ref[:end] + start[:end].float()
            if dtype == torch.float32:
                errors += far(got[:end], want)
            else:  # one rounding of the FP32 sum (the interpreter truncates: within one unit)
                errors += int(((got[:end].float() - want).abs() > want.abs() * 2.0**-7 + 1e-30).sum())
            errors += int(out is not got) + int(not torch.equal(got[end:], start[end:]))
        return errors

    yield "gemm/rowwise/accumulate", accumulate

    def tma_store():  # the tile leaves by TMA in two halves, confined to its group's rows
        errors = 0
        cfg = FP8TileConfig(16, 32, 16, 2, 1, 1, True, 1, True)
        fill = torch.empty  # every fresh result starts as a sentinel, to see what is written
        sentinel = 7.0

        def filled(*shape, **kwargs):
            return fill(*shape, **kwargs).fill_(sentinel)

        for kind, fast, dtype in (("rowwise", True, torch.bfloat16), ("rowwise", False, torch.float32),
                                  ("blockwise", False, torch.bfloat16)):
            a, b = operands(kind, 160, 144, seed=3)  # N 144: the last n-tile's right half is cut
            ref = fp8_grouped_mm(a, b, offsets, torch.float32, "emulated", fast)[:end]
            with mock.patch.object(torch, "empty", filled):
                got = triton_grouped_mm(a, b, offsets, dtype, fast, cfg)
            if dtype == torch.float32:
                errors += far(got[:end], ref)
            else:  # one rounding of the FP32 result (the interpreter truncates: within one unit)
                errors += int(((got[:end].float() - ref).abs() > ref.abs() * 2.0**-7 + 1e-30).sum())
            errors += int((got[end:] != sentinel).sum())  # the last group's tile overhangs its end
        return errors

    yield "gemm/tma_store", tma_store

    def wgrad_blocks():
        """The blockwise weight-gradient kernel: experts of 0, 1, 129 and 300 rows (one,
        two and three 128-token blocks), widths cut by the tiles, K steps of 16 and 64, FP32
        and BF16 results."""
        g = torch.Generator().manual_seed(6)
        dy = torch.randn(440, 72, generator=g) * torch.exp2(torch.randint(-6, 6, (440, 1), generator=g).float())
        x = torch.randn(440, 40, generator=g)
        offsets_w = torch.tensor([0, 1, 130, 430], dtype=torch.int32)
        total = 0
        for out_dtype in (torch.float32, torch.bfloat16):
            ref = fp8_grouped_wgrad(dy, x, offsets_w, False, torch.float32, "emulated", False, True)
            got = fp8_grouped_wgrad(dy, x, offsets_w, False, out_dtype, "triton", False, True)
            total += far(got, ref) if out_dtype == torch.float32 else int(
                ((got.float() - ref).abs() > ref.abs() * 2.0**-7 + RTOL * ref.abs().max()).sum())
        dy_t, dy_s, ends = quantize_group_column_blocks(dy, offsets_w)
        x_t, x_s, _ = quantize_group_column_blocks(x, offsets_w)
        ref = fp8_grouped_wgrad(dy, x, offsets_w, False, torch.float32, "emulated", False, True)
        tiles = FP8TileConfig(32, 16, 64, 1, 1, 1, False)
        total += far(triton_grouped_wgrad_blocks(dy_t, dy_s, x_t, x_s, ends, torch.float32, tiles), ref)
        # added in the epilogue to an FP32 target in place, for dy's columns 8:40 alone (a
        # gate or up half), into a strided view of a wider buffer
        ops = quantize_wgrad_operands(dy, x, offsets_w, False, True).dy_columns(8, 40)
        buffer = torch.randn(4, 32, 48, generator=g)
        before = buffer.clone()
        target = buffer[:, :, 4:44]
        assert fp8_wgrad_mm(ops, torch.bfloat16, "triton", False, accumulate_into=target) is target
        total += far(target - before[:, :, 4:44], ref[:, 8:40])
        total += int((buffer[:, :, :4] != before[:, :, :4]).sum() + (buffer[:, :, 44:] != before[:, :, 44:]).sum())
        return total

    yield "wgrad/blockwise", wgrad_blocks

    for recipe in ("fp8_rowwise", "fp8_rowwise_gw_hp", "fp8_blockwise", "fp8_blockwise_gw_fp8"):
        def layer(recipe=recipe):
            g = torch.Generator().manual_seed(2)
            E, D, F = len(OFFSETS), 144, 136
            w1, w3 = (torch.randn(E, F, D, generator=g) * 0.2 for _ in range(2))
            w2 = torch.randn(E, D, F, generator=g) * 0.2
            rows = torch.randn(48, D, generator=g)
            dy = torch.randn(48, D, generator=g)
            results = []
            for gemm in ("emulated", "triton"):
                params = [nn.Parameter(w.clone()) for w in (w1, w3, w2)]
                experts = FP8GroupedExperts(*params, recipe=recipe, gemm=gemm, fast_accum=())
                x = rows.clone().requires_grad_()
                y = experts(x, offsets)
                y[:end].backward(dy[:end])
                results.append([y[:end], x.grad[:end], *(p.grad for p in params)])
            return sum(far(got, ref, 2e-5) for got, ref in zip(results[1], results[0], strict=True))

        yield f"layer/{recipe}", layer

        def linear(recipe=recipe):
            g = torch.Generator().manual_seed(3)
            w = torch.randn(136, 144, generator=g) * 0.2
            x, dy = torch.randn(37, 144, generator=g), torch.randn(37, 136, generator=g)
            results = []
            for gemm in ("emulated", "triton"):
                weight = nn.Parameter(w.clone())
                xg = x.clone().requires_grad_()
                y = FP8Linear(weight, recipe=recipe, gemm=gemm, fast_accum=())(xg)
                y.backward(dy)
                results.append([y.detach(), xg.grad, weight.grad])
            return sum(far(got, ref, 2e-5) for got, ref in zip(results[1], results[0], strict=True))

        yield f"linear/{recipe}", linear

        def shared(recipe=recipe):  # q, k and v: one quantisation, input gradients added in the GEMMs
            g = torch.Generator().manual_seed(5)
            ws = [torch.randn(n, 144, generator=g) * 0.2 for n in (136, 128, 128)]
            x = torch.randn(37, 144, generator=g)
            dys = [torch.randn(37, w.shape[0], generator=g) for w in ws]
            results = []
            for gemm in ("emulated", "triton"):
                weights = [nn.Parameter(w.clone()) for w in ws]
                layers = tuple(FP8Linear(w, recipe=recipe, gemm=gemm, fast_accum=()) for w in weights)
                xg = x.clone().requires_grad_()
                ys = FP8Linear.shared_input_forward(xg, layers)
                torch.autograd.backward(ys, dys)
                results.append([*(y.detach() for y in ys), xg.grad, *(w.grad for w in weights)])
            return sum(far(got, ref, 2e-5) for got, ref in zip(results[1], results[0], strict=True))

        yield f"shared/{recipe}", shared


def main() -> None:
    report(cases())


if __name__ == "__main__":
    main()
