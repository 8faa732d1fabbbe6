"""The Triton kernel of ``accumulate_`` (``dst += src`` into an FP32 row view) and its
launcher. Imported only when the fused path runs, so importing moe_ddp never loads Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def accumulate_kernel(dst_ptr, src_ptr, cols, dst_row_stride, BLOCK: tl.constexpr):
    col = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row = tl.program_id(1).to(tl.int64)
    mask = col < cols
    dst = dst_ptr + row * dst_row_stride + col
    src = tl.load(src_ptr + row * cols + col, mask=mask, other=0.0)
    acc = tl.load(dst, mask=mask, other=0.0)
    tl.store(dst, acc + src.to(tl.float32), mask=mask)


def accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` for an FP32 ``dst`` of 1 or 2 dims with contiguous rows and a
    contiguous ``src`` of as many elements (read row-major): one launch."""
    rows, cols = (1, dst.numel()) if dst.dim() == 1 else dst.shape
    if rows == 0 or cols == 0:
        return
    row_stride = 0 if dst.dim() == 1 else dst.stride(0)
    accumulate_kernel[(triton.cdiv(cols, _BLOCK), rows)](dst, src.reshape(-1), cols, row_stride,
                                                         BLOCK=_BLOCK, num_warps=8)
