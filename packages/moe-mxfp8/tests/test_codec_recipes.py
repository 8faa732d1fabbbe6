"""Which expert recipes compute on a dispatch payload's values: each codec's
``exact_recipes`` must be exactly the recipes whose forward activation quantization
(along the row, as the experts' first GEMM reads it) maps the decoded rows to themselves.
The others must round them again, or the list would refuse a pairing for nothing."""

from __future__ import annotations

import pytest
import torch
from moe_mxfp8 import (
    FP8_RECIPES,
    RECIPES,
    FP8RowCodec,
    MXFP8RowCodec,
    quantize_dequantize,
    quantize_fp8,
)


def _activation_round_trip(recipe: str, x: torch.Tensor) -> torch.Tensor:
    """What experts of ``recipe`` compute on for rows ``x`` (the reference path)."""
    if recipe == "mxfp8":
        return quantize_dequantize(x, x.dtype, backend="reference")[0]
    r = FP8_RECIPES[recipe]
    return quantize_fp8(x, r.act_block, r.pow2, backend="reference").dequantize(x.dtype)


def _rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows spanning six decades across their 32-blocks, a zero row, and a row whose
    largest rowwise code is 240 (mantissa 1.875) in a block of its own."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(48, 256, generator=gen) * torch.logspace(-3, 3, 256)
    x[5] = 0
    x[6] = torch.randn(256, generator=gen) * 1e-3
    x[6, 40], x[6, 200] = 240.0, 448.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("codec", [FP8RowCodec(), MXFP8RowCodec(backend="reference")],
                         ids=["fp8_rowwise", "mxfp8"])
def test_exact_recipes_are_those_that_keep_the_decoded_rows(codec, dtype):
    decoded = codec.decode(codec.encode(_rows(dtype)), dtype)
    kept = {recipe for recipe in RECIPES
            if torch.equal(_activation_round_trip(recipe, decoded), decoded)}
    assert kept == set(codec.exact_recipes)
