"""The token embedding's weight gradient added to an FP32 accumulator in one Triton kernel,
touching only the rows of the tokens seen, for CUDA tensors.

Autograd's embedding backward writes a dense ``[vocab, d_model]`` gradient (zero-filled,
then the token rows summed in), which a data-parallel wrapper's hook then reads and adds
to its FP32 main grad: at bench-1gpu's 100k x 2048 vocabulary that is ~2.5 GB of memory
traffic (and ~33 kernels) per microbatch, for 8k token rows. Here the token ids are
sorted (stable), and one program per run of equal ids and column block sums the run's
gradient rows in FP32, in token order, and adds the sum to the accumulator's row once:
each element gets one read-modify-write from one program, so there are no atomics and
the result is deterministic, and rounded once (no BF16 gradient in between). Importing
this module requires Triton (``moe_model.embedding`` imports it only for CUDA tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_model.sink import accumulator_layout

_BLOCK_D = 1024


@triton.jit
def embedding_grad_kernel(
    sorted_ids_ptr, order_ptr, run_end_ptr, dy_ptr, target_ptr,
    D, stride_dy, piece, stride_piece,
    FLAT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(i, b)``: if sorted position ``i`` starts a run of equal ids, add the run's
    gradient rows (columns of block ``b``) to the accumulator's row of that id. The
    accumulator holds the weight's elements flat (``FLAT``) or as rows of ``piece``
    elements ``stride_piece`` apart (an owner-major gradient bucket)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = cols < D
    token = tl.load(sorted_ids_ptr + i)
    previous = tl.load(sorted_ids_ptr + tl.maximum(i - 1, 0))
    if (i == 0) | (previous != token):
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(i, tl.load(run_end_ptr + i)):
            row = tl.load(order_ptr + j)
            acc += tl.load(dy_ptr + row * stride_dy + cols, mask=live, other=0.0).to(tl.float32)
        flat = token.to(tl.int64) * D + cols
        addr = flat if FLAT else (flat // piece) * stride_piece + flat % piece
        tl.store(target_ptr + addr, tl.load(target_ptr + addr, mask=live) + acc, mask=live)


def embedding_grad_accumulate_(target: torch.Tensor, tokens: torch.Tensor, dy: torch.Tensor,
                               vocab: int) -> None:
    """``target += dW`` for the ``[vocab, D]`` embedding whose output gradient is ``dy [..., D]``
    at token ids ``tokens [...]`` (in ``[0, vocab)``). ``target`` is FP32 and holds the
    weight's elements in storage order: 1-D, or ``[rows, cols]`` with contiguous rows read row
    by row (``moe_model.sink.accumulator_layout``)."""
    D = dy.shape[-1]
    piece, stride = accumulator_layout(target, vocab * D, "embedding gradient")
    if dy.shape[:-1] != tokens.shape:
        raise ValueError(f"embedding gradient: dy {tuple(dy.shape)} does not match tokens {tuple(tokens.shape)}")
    ids = tokens.reshape(-1)
    if not ids.numel():
        return
    dy_ND = dy.reshape(ids.numel(), D)
    if dy_ND.stride(-1) != 1:
        dy_ND = dy_ND.contiguous()
    sorted_ids, order = torch.sort(ids, stable=True)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)
    embedding_grad_kernel[(ids.numel(), triton.cdiv(D, _BLOCK_D))](
        sorted_ids, order, run_end, dy_ND, target, D, dy_ND.stride(0), piece, stride,
        FLAT=target.dim() == 1, BLOCK_D=_BLOCK_D,
    )
