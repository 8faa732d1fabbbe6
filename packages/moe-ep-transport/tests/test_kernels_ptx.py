"""Compile the Triton kernels for Hopper (sm_90) without a GPU and inspect the PTX.

Two properties the design relies on: the put kernel stores 128-bit vectors through
peer pointers (bandwidth), and the top-k sum has no fused multiply-add (so it
equals the PyTorch reference bit for bit).
"""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
from moe_ep_transport import kernels  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

_HOPPER = GPUTarget("cuda", 90, 32)


def _ptx(fn, signature: dict[str, str], constexprs: dict, **options) -> str:
    """PTX as a launch would build it: pointers 16-byte aligned, ``width`` a multiple of 16."""
    names = list(signature)
    aligned = [n for n, t in signature.items() if t.startswith("*")] + ["width"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=_HOPPER, options=options).asm["ptx"]


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"\b{re.escape(op)}\b", ptx))


def test_put_rows_stores_128_bit_vectors_through_peer_pointers() -> None:
    sig = {"src_ptr": "*i32", "src_index_ptr": "*i64", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64",
           "dst_table_ptr": "*i64", "meta_src_ptr": "*i64", "meta_table_ptr": "*i64",
           "n_rows": "i32", "width": "i32", "HAS_META": "constexpr", "BLOCK_R": "constexpr",
           "BLOCK_W": "constexpr"}
    ptx = _ptx(kernels._put_rows_kernel, sig, {"HAS_META": True, "BLOCK_R": 4, "BLOCK_W": 1024}, num_warps=8)
    assert _count(ptx, "st.global.v4.b32") > 0 and _count(ptx, "st.global.b32") == 0


def test_topk_sum_has_no_fused_multiply_add() -> None:
    sig = {"primary_ptr": "*bf16", "secondary_ptr": "*bf16", "sel_ptr": "*i64", "row_ptr": "*i64",
           "w_ptr": "*fp32", "y_ptr": "*bf16", "rows_out_ptr": "*bf16", "width": "i32",
           "K": "constexpr", "STORE_ROWS": "constexpr", "BLOCK_W": "constexpr"}
    consts = {"K": 8, "STORE_ROWS": True, "BLOCK_W": 1024}
    ptx = _ptx(kernels._topk_gather_sum_kernel, sig, consts, num_warps=4, enable_fp_fusion=False)
    assert _count(ptx, "fma.rn.f32") == 0 and _count(ptx, "mul.rn.f32") > 0
    assert _count(ptx, "ld.global.v4.b32") > 0  # 8 BF16 per load
    fused = _ptx(kernels._topk_gather_sum_kernel, sig, consts, num_warps=4, enable_fp_fusion=True)
    assert _count(fused, "fma.rn.f32") > 0  # the option is what keeps products and sums apart
