"""Triton kernels of the transports: row put through peer pointers, receive finish, top-k sum.

Import this module only where a kernel is launched (it imports triton).
Row tensors are 2-D and contiguous; a row is ``width`` elements of its dtype
(callers view rows as 32-bit words when they only move them).

Pointer tables are int64 tensors of byte addresses (one per destination rank); a
peer's address comes from NVSHMEM (``nvshmem_ptr``), so a plain store reaches the
peer's memory over NVLink. The addresses are 16-byte aligned, which the put kernel
states with ``tl.multiple_of`` on the pointers so that its stores vectorise
(128-bit; checked on the compiled PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_W = 1024  # elements of one row chunk (4 KiB of 32-bit words)


@triton.jit
def _put_rows_kernel(
    src_ptr, src_index_ptr, dst_rank_ptr, dst_row_ptr, dst_table_ptr,
    meta_src_ptr, meta_table_ptr, n_rows, width,
    HAS_META: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank = tl.load(dst_rank_ptr + rows, mask=rows < n_rows, other=-1)
    ok = rank >= 0
    src_row = tl.load(src_index_ptr + rows, mask=ok, other=0)
    dst_row = tl.load(dst_row_ptr + rows, mask=ok, other=0)
    base = tl.load(dst_table_ptr + rank, mask=ok, other=0).to(tl.pointer_type(src_ptr.dtype.element_ty))
    dst = tl.multiple_of(base, 16) + dst_row * width
    src = src_ptr + src_row * width
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (cols < width)[None, :]
        v = tl.load(src[:, None] + cols[None, :], mask=m)
        tl.store(dst[:, None] + cols[None, :], v, mask=m)
    if HAS_META:
        meta_base = tl.load(meta_table_ptr + rank, mask=ok, other=0).to(tl.pointer_type(tl.int64))
        meta = tl.load(meta_src_ptr + rows, mask=ok, other=0)
        tl.store(meta_base + dst_row, meta, mask=ok)


@triton.jit
def _finish_receive_kernel(
    out_ptr, inbox_ptr, row_src_ptr, me, n_rows, width,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    src = tl.load(row_src_ptr + rows, mask=rows < n_rows, other=me)
    remote = (src != me) & (src >= 0)
    write = remote | (src < 0)  # padding rows are written as zeros
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        cm = (cols < width)[None, :]
        offs = rows.to(tl.int64)[:, None] * width + cols[None, :]
        v = tl.load(inbox_ptr + offs, mask=remote[:, None] & cm, other=0)
        tl.store(out_ptr + offs, v, mask=write[:, None] & cm)


@triton.jit
def _topk_gather_sum_kernel(
    primary_ptr, secondary_ptr, sel_ptr, row_ptr, w_ptr, y_ptr, rows_out_ptr, width,
    K: tl.constexpr, STORE_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = cols < width
    acc = tl.zeros([BLOCK_W], dtype=w_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        i = t * K + j
        sel = tl.load(sel_ptr + i)
        row = tl.load(row_ptr + i)
        w = tl.load(w_ptr + i)
        base = tl.where(sel == 1, secondary_ptr, primary_ptr)
        limit = tl.where(sel >= 0, width, 0)  # a dropped slot reads nothing (zeros)
        x = tl.load(base + row * width + cols, mask=cols < limit, other=0.0)
        acc = acc + x.to(w_ptr.dtype.element_ty) * w
        if STORE_ROWS:
            tl.store(rows_out_ptr + i.to(tl.int64) * width + cols, x, mask=cm)
    tl.store(y_ptr + t.to(tl.int64) * width + cols, acc.to(y_ptr.dtype.element_ty), mask=cm)


def _block_w(width: int) -> int:
    return min(_MAX_BLOCK_W, triton.next_power_of_2(max(width, 1)))


def put_rows(
    src_SW: torch.Tensor,
    src_index_N: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    dst_table: torch.Tensor,
    meta_N: torch.Tensor | None = None,
    meta_table: torch.Tensor | None = None,
) -> None:
    """``dst[dst_rank[i]][dst_row[i]] = src[src_index[i]]`` for every ``i`` with ``dst_rank >= 0``.

    ``dst_table[r]`` is the byte address of rank ``r``'s destination rows (same dtype
    and width as ``src``). With ``meta_N``, also ``meta_dst[dst_rank[i]][dst_row[i]] = meta[i]``
    (int64) at the addresses of ``meta_table``.
    """
    n = dst_rank_N.numel()
    if n == 0:
        return
    width = src_SW.shape[1]
    has_meta = meta_N is not None
    block_r = 4
    _put_rows_kernel[(triton.cdiv(n, block_r),)](
        src_SW, src_index_N, dst_rank_N, dst_row_N, dst_table,
        meta_N if has_meta else dst_row_N, meta_table if has_meta else dst_table, n, width,
        HAS_META=has_meta, BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8,
    )


def finish_receive(out_CW: torch.Tensor, inbox_CW: torch.Tensor, row_src_C: torch.Tensor, me: int) -> None:
    """Copy rows that came from other ranks from the inbox into ``out``; zero padding rows.

    Rows this rank sent to itself were written into ``out`` directly by the put.
    """
    n = out_CW.shape[0]
    if n == 0:
        return
    width = out_CW.shape[1]
    block_r = 4
    _finish_receive_kernel[(triton.cdiv(n, block_r),)](
        out_CW, inbox_CW, row_src_C, me, n, width,
        BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8,
    )


def topk_gather_sum(
    primary_RD: torch.Tensor,
    secondary_RD: torch.Tensor,
    sel_N: torch.Tensor,
    row_N: torch.Tensor,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y[t] = sum_j w[t*k+j] * src(t*k+j)`` in ``w``'s dtype, slot order, no fused multiply-add.

    Slot ``i`` reads ``primary[row[i]]`` (``sel == 0``), ``secondary[row[i]]``
    (``sel == 1``) or zeros (``sel < 0``). FMA contraction is disabled so the sum
    equals the unfused PyTorch reference bit for bit.
    """
    n = sel_N.numel()
    T = n // top_k
    width = primary_RD.shape[1]
    y = torch.empty(T, width, dtype=out_dtype, device=primary_RD.device)
    rows_out = (
        torch.empty(n, width, dtype=primary_RD.dtype, device=primary_RD.device) if store_rows else None
    )
    if T == 0:
        return y, rows_out
    block_w = _block_w(width)
    _topk_gather_sum_kernel[(T, triton.cdiv(width, block_w))](
        primary_RD, secondary_RD, sel_N, row_N, w_N, y, rows_out if store_rows else y, width,
        K=top_k, STORE_ROWS=store_rows, BLOCK_W=block_w, num_warps=4, enable_fp_fusion=False,
    )
    return y, rows_out
