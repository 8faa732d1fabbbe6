"""Causal attention that stays inside each document of a packed sequence.

A training window of ``S`` tokens may hold the end of one document, several whole
ones and the start of another. ``DocumentMask(document_ids_BS)`` (a non-decreasing
document number per position, e.g. ``documents_from_eos``) lets position ``i``
attend to ``j <= i`` of the same document only: a block-diagonal causal mask,
which equals running every document through causal attention on its own.

The mask is built once per forward and shared by every layer. Kernels:

- ``flex``: PyTorch's FlexAttention (compiled, CUDA): the block mask skips every
  tile outside the documents, so the cost follows the documents' lengths.
- ``sdpa``: ``scaled_dot_product_attention`` with a dense boolean ``[B, 1, S, S]``
  mask (any device; what CPU runs): exact, but every tile is computed.

``kernel="auto"`` takes ``flex`` on CUDA and ``sdpa`` elsewhere or under
``use_reference_kernels`` (which overrides ``flex`` too);
``tools/bench_document_attention.py`` times both at the benchmark shapes.
FlexAttention is imported at first use, so importing this module never needs it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from moe_model._triton_support import fused_kernels_enabled, reference_kernels_enabled

DOCUMENT_KERNELS = ("auto", "flex", "sdpa")


def documents_from_eos(tokens_BS: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document number of each position: a new document starts after every ``eos_id``.

    ``[B, S]`` int32, 0 at the first position of each row (on the tokens' device, no
    host synchronisation)."""
    ends = tokens_BS[:, :-1] == eos_id
    starts = F.pad(ends, (1, 0)).to(torch.int32)
    return torch.cumsum(starts, dim=1, dtype=torch.int32)


def attended_pairs(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Query-key pairs the document mask keeps, summed over the batch:
    ``sum over documents of n * (n + 1) / 2`` (causal attention keeps ``S * (S + 1) / 2``
    per row). The FLOPs of the masked attention follow it. Its output size depends on the
    data, so on a GPU it waits for the device: call it on host tensors (the trainer does)."""
    B, S = document_ids_BS.shape
    offsets = torch.arange(B, device=document_ids_BS.device, dtype=torch.int64)[:, None] * (S + 1)
    _, counts = torch.unique_consecutive((document_ids_BS.to(torch.int64) + offsets).reshape(-1),
                                         return_counts=True)
    return (counts * (counts + 1) // 2).sum()


@functools.cache
def _compiled_flex_attention() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class DocumentMask:
    """The block-diagonal causal mask of one batch of windows (see the module doc)."""

    def __init__(self, document_ids_BS: torch.Tensor, kernel: str = "auto") -> None:
        if kernel not in DOCUMENT_KERNELS:
            raise ValueError(f"document attention kernel must be one of {DOCUMENT_KERNELS}, got {kernel!r}")
        if document_ids_BS.dim() != 2:
            raise ValueError(f"document ids must be [B, S], got {tuple(document_ids_BS.shape)}")
        self.document_ids = document_ids_BS
        if kernel == "auto" or reference_kernels_enabled():
            kernel = "flex" if fused_kernels_enabled(document_ids_BS.device) else "sdpa"
        self.kernel = kernel
        B, S = document_ids_BS.shape
        if kernel == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            ids = document_ids_BS

            def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
                return (q >= kv) & (ids[b, q] == ids[b, kv])

            self.block_mask = create_block_mask(same_document_causal, B, None, S, S,
                                                device=document_ids_BS.device)
        else:
            causal = torch.ones(S, S, dtype=torch.bool, device=document_ids_BS.device).tril()
            same = document_ids_BS[:, :, None] == document_ids_BS[:, None, :]
            self.dense_mask = (same & causal)[:, None]  # [B, 1, S, S]

    def attend(self, q_BHSDh: torch.Tensor, k_BKSDh: torch.Tensor, v_BKSDh: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, H, S, Dh]`` (grouped-query when K < H)."""
        gqa = k_BKSDh.shape[1] != q_BHSDh.shape[1]
        if self.kernel == "flex":
            return _compiled_flex_attention()(q_BHSDh, k_BKSDh, v_BKSDh, block_mask=self.block_mask,
                                              enable_gqa=gqa)
        return F.scaled_dot_product_attention(q_BHSDh, k_BKSDh, v_BKSDh, attn_mask=self.dense_mask,
                                              enable_gqa=gqa)
