"""Triton kernels of the transports: row put through peer pointers, receive finish, top-k sum.

Import this module only where a kernel is launched (it imports triton).
Row tensors are 2-D and contiguous; a row is ``width`` elements of its dtype
(callers view rows as 32-bit words when they only move them).

Pointer tables are int64 tensors of slab byte addresses (one per destination
rank); a peer's address comes from NVSHMEM (``nvshmem_ptr``), so a plain store
reaches the peer's memory over NVLink. The offset into the slab and the local
destination are kernel arguments (no per-call table arithmetic). The addresses are
16-byte aligned, which the put kernel states with ``tl.multiple_of`` on the
pointers so that its stores vectorise (128-bit; checked on the compiled PTX).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_W = 1024  # elements of one row chunk (4 KiB of 32-bit words)


@triton.jit
def _put_rows_kernel(
    src_ptr, src_index_ptr, dst_rank_ptr, dst_row_ptr, table_ptr, byte_offset, local_addr, me,
    meta_src_ptr, n_rows, width,
    HAS_LOCAL: tl.constexpr, SKIP_LOCAL: tl.constexpr, HAS_META: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rank = tl.load(dst_rank_ptr + rows, mask=rows < n_rows, other=-1)
    ok = rank >= 0
    if SKIP_LOCAL:
        ok = ok & (rank != me)
    src_row = tl.load(src_index_ptr + rows, mask=ok, other=0)
    dst_row = tl.load(dst_row_ptr + rows, mask=ok, other=0)
    slab = tl.load(table_ptr + rank, mask=ok, other=0)
    addr = slab + byte_offset
    if HAS_LOCAL:
        addr = tl.where(rank == me, local_addr, addr)
    dst = tl.multiple_of(addr.to(tl.pointer_type(src_ptr.dtype.element_ty)), 16) + dst_row * width
    src = src_ptr + src_row * width
    for c0 in range(0, width, BLOCK_W):
        cols = c0 + tl.arange(0, BLOCK_W)
        m = ok[:, None] & (cols < width)[None, :]
        v = tl.load(src[:, None] + cols[None, :], mask=m)
        tl.store(dst[:, None] + cols[None, :], v, mask=m)
    if HAS_META:
        meta = tl.load(meta_src_ptr + rows, mask=ok, other=0)
        tl.store(slab.to(tl.pointer_type(tl.int64)) + dst_row, meta, mask=ok)


@triton.jit
def _finish_receive_kernel(
    out_ptr, inbox_ptr, row_src_ptr, origin_out_ptr, origin_in_ptr, me, n_rows, width,
    HAS_ORIGIN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
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
    if HAS_ORIGIN:
        origin = tl.load(origin_in_ptr + rows, mask=rows < n_rows)
        tl.store(origin_out_ptr + rows, origin, mask=rows < n_rows)


@triton.jit
def _topk_gather_sum_kernel(
    inbox_ptr, local_ptr, dst_rank_ptr, dst_row_ptr, w_ptr, y_ptr, rows_out_ptr, me, width,
    K: tl.constexpr, STORE_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    cm = cols < width
    acc = tl.zeros([BLOCK_W], dtype=w_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        i = t.to(tl.int64) * K + j
        rank = tl.load(dst_rank_ptr + i)
        local = rank == me
        base = tl.where(local, local_ptr, inbox_ptr)
        row = tl.where(local, tl.load(dst_row_ptr + i), i)
        limit = tl.where(rank >= 0, width, 0)  # a dropped slot reads nothing (zeros) ...
        x = tl.load(base + row * width + cols, mask=cols < limit, other=0.0)
        w = tl.where(rank >= 0, tl.load(w_ptr + i), 0.0)  # ... with weight zero
        acc = acc + x.to(w_ptr.dtype.element_ty) * w
        if STORE_ROWS:
            tl.store(rows_out_ptr + i * width + cols, x, mask=cm)
    tl.store(y_ptr + t.to(tl.int64) * width + cols, acc.to(y_ptr.dtype.element_ty), mask=cm)


def _block_w(width: int) -> int:
    return min(_MAX_BLOCK_W, triton.next_power_of_2(max(width, 1)))


def put_rows(
    src_SW: torch.Tensor,
    src_index_N: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    table_M: torch.Tensor,
    *,
    byte_offset: int = 0,
    me: int = -1,
    local_dst: torch.Tensor | None = None,
    skip_local: bool = False,
    meta_N: torch.Tensor | None = None,
) -> None:
    """Row ``dst_row[i]`` at ``table[dst_rank[i]] + byte_offset`` becomes ``src[src_index[i]]``.

    ``table_M[r]`` is the byte address of rank ``r``'s slab; the rows there have
    ``src``'s dtype and width. Slots with ``dst_rank < 0`` are skipped; slots for
    rank ``me`` go to ``local_dst`` instead when given, and are skipped with
    ``skip_local``. With ``meta_N``, also ``int64 slab[dst_row[i]] = meta[i]`` at the
    slab's start.
    """
    if local_dst is not None and skip_local:
        raise ValueError("put_rows: local_dst and skip_local exclude each other")
    n = dst_rank_N.numel()
    if n == 0:
        return
    width = src_SW.shape[1]
    block_r = 4
    _put_rows_kernel[(triton.cdiv(n, block_r),)](
        src_SW, src_index_N, dst_rank_N, dst_row_N, table_M, byte_offset,
        local_dst.data_ptr() if local_dst is not None else 0, me,
        meta_N if meta_N is not None else dst_row_N, n, width,
        HAS_LOCAL=local_dst is not None, SKIP_LOCAL=skip_local, HAS_META=meta_N is not None,
        BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8,
    )


def finish_receive(
    out_CW: torch.Tensor,
    inbox_CW: torch.Tensor,
    row_src_C: torch.Tensor,
    me: int,
    origin_out_C: torch.Tensor | None = None,
    origin_in_C: torch.Tensor | None = None,
) -> None:
    """Copy rows that came from other ranks from the inbox into ``out``; zero padding rows.

    Rows this rank sent to itself were written into ``out`` directly by the put.
    With ``origin_out_C``, ``origin_in_C`` is copied into it in the same launch.
    """
    n = out_CW.shape[0]
    if n == 0:
        return
    width = out_CW.shape[1]
    block_r = 4
    has_origin = origin_out_C is not None
    _finish_receive_kernel[(triton.cdiv(n, block_r),)](
        out_CW, inbox_CW, row_src_C,
        origin_out_C if has_origin else row_src_C, origin_in_C if has_origin else row_src_C,
        me, n, width, HAS_ORIGIN=has_origin, BLOCK_R=block_r, BLOCK_W=_block_w(width), num_warps=8,
    )


def topk_gather_sum(
    inbox_ND: torch.Tensor,
    local_CD: torch.Tensor,
    dst_rank_N: torch.Tensor,
    dst_row_N: torch.Tensor,
    me: int,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``y[t] = sum_j w[t*k+j] * x(t*k+j)`` in ``w``'s dtype, slot order, no fused multiply-add.

    Slot ``i`` reads ``local[dst_row[i]]`` (``dst_rank == me``), ``inbox[i]`` (another
    rank) or zeros with weight zero (dropped). FMA contraction is disabled so the sum
    equals the unfused PyTorch reference bit for bit.
    """
    n = dst_rank_N.numel()
    T = n // top_k
    width = local_CD.shape[1]
    y = torch.empty(T, width, dtype=out_dtype, device=local_CD.device)
    rows_out = (
        torch.empty(n, width, dtype=local_CD.dtype, device=local_CD.device) if store_rows else None
    )
    if T == 0:
        return y, rows_out
    block_w = _block_w(width)
    _topk_gather_sum_kernel[(T, triton.cdiv(width, block_w))](
        inbox_ND, local_CD, dst_rank_N, dst_row_N, w_N, y, rows_out if store_rows else y, me, width,
        K=top_k, STORE_ROWS=store_rows, BLOCK_W=block_w, num_warps=4, enable_fp_fusion=False,
    )
    return y, rows_out
