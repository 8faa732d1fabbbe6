"""One microbatch through one pipeline stage: bytes held, and the forward/backward peaks.

The walk follows execution order. Forward: the token ids (first stage) or the
received activation (later stages) and the residual stream are alive; block ``l``
peaks at its own high-water mark on top of what blocks ``< l`` hold; the head
peaks at the cross-entropy. Backward goes in reverse: the loss, then each block
at its high-water mark while blocks ``< l`` still hold theirs. Peaks are relative
to whatever else the rank holds (other microbatches in flight, persistent state).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_model import MoEConfig

from pretrain.planner.activations import (
    Execution,
    block_inventory,
    head_memory,
    tokens_memory,
)


@dataclass(frozen=True)
class StageMemory:
    held: int  # bytes kept from this microbatch's forward until its backward
    fwd_peak: int  # high-water mark of its forward (bytes of this microbatch)
    bwd_peak: int  # high-water mark of its backward
    blocks_held: int  # part of ``held`` in the blocks (the rest: edges)

    @property
    def peak(self) -> int:
        return max(self.fwd_peak, self.bwd_peak)


def stage_memory(cfg: MoEConfig, layers: Sequence[int], first: bool, last: bool,
                 ex: Execution) -> StageMemory:
    """Walk blocks ``layers`` (with the embedding if ``first``, the head if ``last``)."""
    b, T, D = ex.compute_bytes, ex.tokens, cfg.d_model
    residual = b * T * D
    # What the stage keeps besides its blocks: token ids, or the received activation
    # (the pipeline holds it for the backward); the output it sent (held likewise).
    base = tokens_memory(ex) if first else residual
    head = head_memory(cfg, ex) if last else None
    recompute = cfg.recompute
    inventories = [block_inventory(cfg, layer, ex) for layer in layers]

    held = base
    fwd_peak = base + residual
    for inv in inventories:
        fwd_peak = max(fwd_peak, held + inv.forward_peak(recompute))
        held += inv.held(recompute)
    blocks_held = held - base
    if head is not None:
        fwd_peak = max(fwd_peak, held + head.fwd_peak)
        edge_held = head.held
    else:
        edge_held = residual  # the output sent to the next stage
    total_held = held + edge_held

    # A non-last stage keeps its output until its backward is done, next to the
    # gradient it received for it (the last block's output gradient).
    held += 0 if head is not None else edge_held
    bwd_peak = held + (head.bwd_peak if head is not None else residual)
    for inv in reversed(inventories):
        held -= inv.held(recompute)
        bwd_peak = max(bwd_peak, held + inv.backward_peak(recompute))
    return StageMemory(total_held, fwd_peak, bwd_peak, blocks_held)
