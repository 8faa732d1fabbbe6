"""Local row operations shared by the transports, with one PyTorch and one Triton path.

The PyTorch path runs on CPU (and is the reference); the Triton path runs on CUDA
tensors. Both compute the same IEEE operations in the same order (FP32 products
then sums, slot by slot, no fused multiply-add), so they agree bit for bit.

Shape legend: N slots (T tokens x k), R source rows, C receive rows, W words, D width.
"""

from __future__ import annotations

import torch


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """View ``rows[R, D]`` as ``[R, W]`` 32-bit words (bytes when the row size is not a multiple of 4).

    Transports move words, whatever the payload dtype: fewer, wider memory
    operations, and one collective dtype that every backend (gloo included) supports.
    """
    rows = rows.contiguous()
    nbytes = rows.shape[1] * rows.element_size()
    word = torch.int32 if nbytes % 4 == 0 else torch.uint8
    return rows.view(torch.uint8).view(word) if rows.dtype != word else rows


def from_words(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_words` for rows of ``dtype``."""
    return words.view(torch.uint8).view(dtype) if words.dtype != dtype else words


def finish_receive(out_CW: torch.Tensor, inbox_CW: torch.Tensor, row_src_C: torch.Tensor, me: int) -> None:
    """Move rows from other ranks out of the symmetric inbox into ``out``; zero the padding."""
    if _on_triton(out_CW):
        from moe_ep_transport import kernels

        kernels.finish_receive(out_CW, inbox_CW, row_src_C, me)
    else:
        finish_receive_reference(out_CW, inbox_CW, row_src_C, me)


def finish_receive_reference(
    out_CW: torch.Tensor, inbox_CW: torch.Tensor, row_src_C: torch.Tensor, me: int
) -> None:
    """PyTorch version of :func:`finish_receive` (boolean indexing: synchronises on CUDA)."""
    remote = (row_src_C != me) & (row_src_C >= 0)
    out_CW[remote] = inbox_CW[remote]
    out_CW[row_src_C < 0] = 0


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
    """Weighted top-k sum per token, reading each slot's row from one of two sources.

    Accumulates in ``w_N``'s dtype (FP32 in training; FP64 when the inputs are).

    Slot ``i = t*k + j`` reads ``primary[row[i]]`` if ``sel[i] == 0``,
    ``secondary[row[i]]`` if ``sel[i] == 1`` and zeros if ``sel[i] < 0`` (a dropped
    slot). ``y[t] = ((0 + x_0 w_0) + x_1 w_1) + ...``, cast to ``out_dtype``.
    With ``store_rows`` the gathered rows ``[N, D]`` are returned too (for the
    gradient of the weights).
    """
    if _on_triton(primary_RD):
        from moe_ep_transport import kernels

        return kernels.topk_gather_sum(
            primary_RD, secondary_RD, sel_N, row_N, w_N, top_k, out_dtype, store_rows
        )
    return topk_gather_sum_reference(
        primary_RD, secondary_RD, sel_N, row_N, w_N, top_k, out_dtype, store_rows
    )


def topk_gather_sum_reference(
    primary_RD: torch.Tensor,
    secondary_RD: torch.Tensor,
    sel_N: torch.Tensor,
    row_N: torch.Tensor,
    w_N: torch.Tensor,
    top_k: int,
    out_dtype: torch.dtype,
    store_rows: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PyTorch version of :func:`topk_gather_sum` (boolean indexing: synchronises on CUDA)."""
    n, width = sel_N.numel(), primary_RD.shape[1]
    x_ND = primary_RD.new_zeros(n, width)
    for s, source in enumerate((primary_RD, secondary_RD)):
        take = sel_N == s
        x_ND[take] = source[row_N[take]]
    T = n // top_k
    x_TKD = x_ND.view(T, top_k, width)
    w_TK = w_N.view(T, top_k)
    acc = torch.zeros(T, width, dtype=w_N.dtype, device=primary_RD.device)
    for j in range(top_k):
        acc = acc + x_TKD[:, j].to(w_N.dtype) * w_TK[:, j, None]
    return acc.to(out_dtype), (x_ND if store_rows else None)
