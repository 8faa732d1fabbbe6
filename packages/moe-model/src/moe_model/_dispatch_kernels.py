"""The local dropless dispatch's routing metadata in two Triton kernels, for CUDA tensors.

The eager form sorts the routed slots by expert with a stable ``argsort`` (a radix
sort of 64-bit keys: ~22 kernels at 65k slots), then counts, inverts the permutation,
divides and prefix-sums: ~30 small kernels per MoE layer and microbatch, each costing
more launch gap than work. Expert ids are small integers, so a counting sort gives the
same permutation directly:

1. ``_block_counts``: each program counts its block of slots per expert (one row of a
   ``[blocks, E]`` table).
2. ``_place``: each program sums the table's rows above its own (the rows of this
   expert that earlier blocks hold) and all rows (every expert's total, whose
   exclusive prefix sum is the expert's first row), ranks its slots among the block's
   slots of the same expert (a prefix sum over a one-hot tile), and writes each slot's
   row and each row's slot and token. Program 0 also writes the counts and offsets.

The result is the stable argsort's: rows expert-major, slots in index order within an
expert, bit-identical to the eager path (tested). No atomics, so it is deterministic;
nothing is read back to the host. Expert ids must lie in ``[0, E)`` (the router's
always do): otherwise a device-side assertion fails, without a host sync. Importing this module requires
Triton (``moe_model.dispatch`` imports it only for CUDA tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# one-hot tile of a block: BLOCK x E_BLOCK int32 values, about 16k per program
_TILE_ELEMENTS = 16384


@triton.jit
def _one_hot(e_ptr, block, S, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    """This block's slot offsets, whether each is a slot, and the ``[BLOCK, E_BLOCK]`` one-hot
    of its experts (a past-the-end slot or an id outside ``[0, E_BLOCK)`` matches no column)."""
    offs = block * BLOCK + tl.arange(0, BLOCK)
    live = offs < S
    e = tl.load(e_ptr + offs, mask=live, other=-1)
    hot = (e[:, None] == tl.arange(0, E_BLOCK)[None, :]).to(tl.int32)
    return offs, live, hot


@triton.jit
def _block_counts(e_ptr, table_ptr, S, E, BLOCK: tl.constexpr, E_BLOCK: tl.constexpr):
    block = tl.program_id(0)
    _, _, hot = _one_hot(e_ptr, block, S, BLOCK, E_BLOCK)
    cols = tl.arange(0, E_BLOCK)
    tl.store(table_ptr + block * E + cols, tl.sum(hot, axis=0), mask=cols < E)


@triton.jit
def _place(
    e_ptr, table_ptr, row_of_slot_ptr, slot_of_row_ptr, token_of_row_ptr, counts_ptr, offsets_ptr,
    all_placed_ptr, S, E, n_blocks, k,
    BLOCK: tl.constexpr, E_BLOCK: tl.constexpr, TABLE_ROWS: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.arange(0, E_BLOCK)
    total = tl.zeros((E_BLOCK,), dtype=tl.int32)
    before = tl.zeros((E_BLOCK,), dtype=tl.int32)
    for r0 in range(0, n_blocks, TABLE_ROWS):
        rows = r0 + tl.arange(0, TABLE_ROWS)
        counts = tl.load(table_ptr + rows[:, None] * E + cols[None, :],
                         mask=(rows[:, None] < n_blocks) & (cols[None, :] < E), other=0)
        total += tl.sum(counts, axis=0)
        before += tl.sum(tl.where(rows[:, None] < block, counts, 0), axis=0)
    first_row = tl.cumsum(total, axis=0) - total  # the expert's first row
    offs, live, hot = _one_hot(e_ptr, block, S, BLOCK, E_BLOCK)
    rank = tl.cumsum(hot, axis=0) - 1  # among this block's slots of the same expert
    row = tl.sum(tl.where(hot != 0, rank + (first_row + before)[None, :], 0), axis=1)
    placed = live & (tl.sum(hot, axis=1) != 0)
    tl.store(row_of_slot_ptr + offs, row.to(tl.int64), mask=live)
    tl.store(slot_of_row_ptr + row, offs.to(tl.int64), mask=placed)
    tl.store(token_of_row_ptr + row, (offs // k).to(tl.int64), mask=placed)
    if block == 0:
        tl.store(counts_ptr + cols, total.to(tl.int64), mask=cols < E)
        tl.store(offsets_ptr + cols, first_row + total, mask=cols < E)
        tl.store(all_placed_ptr, (tl.sum(total, axis=0) == S).to(tl.int32))


def dropless_layout(
    expert_ids_Tk: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slot_of_row, row_of_slot, token_of_row, counts, offsets)`` of the expert-major
    layout of the ``[T, k]`` expert ids: ``slot_of_row`` is ``argsort(ids.flatten(),
    stable=True)``, ``row_of_slot`` its inverse, ``token_of_row = slot_of_row // k`` (all
    int64 ``[T*k]``), ``counts`` int64 ``[E]`` and ``offsets`` their int32 cumulative sum."""
    T, k = expert_ids_Tk.shape
    S, E, dev = T * k, n_experts, expert_ids_Tk.device
    e_S = expert_ids_Tk.reshape(-1)
    slot_of_row, row_of_slot, token_of_row = (torch.empty(S, dtype=torch.int64, device=dev)
                                              for _ in range(3))
    counts = torch.empty(E, dtype=torch.int64, device=dev)
    offsets = torch.empty(E, dtype=torch.int32, device=dev)
    e_block = triton.next_power_of_2(E)
    block = max(16, min(1024, _TILE_ELEMENTS // e_block))
    n_blocks = max(1, triton.cdiv(S, block))  # program 0 writes the counts even for no slots
    table = torch.empty(n_blocks, E, dtype=torch.int32, device=dev)
    all_placed = torch.empty(1, dtype=torch.int32, device=dev)
    _block_counts[(n_blocks,)](e_S, table, S, E, BLOCK=block, E_BLOCK=e_block)
    _place[(n_blocks,)](
        e_S, table, row_of_slot, slot_of_row, token_of_row, counts, offsets, all_placed,
        S, E, n_blocks, k,
        BLOCK=block, E_BLOCK=e_block, TABLE_ROWS=max(1, _TILE_ELEMENTS // e_block // 4),
    )
    # an id outside [0, E) would leave its slot without a row: fail on the device (as the
    # eager path's scatter does) rather than combine another row into that token
    torch._assert_async(all_placed, "dispatch: an expert id lies outside [0, n_experts)")
    return slot_of_row, row_of_slot, token_of_row, counts, offsets
