"""One microbatch through one pipeline stage: bytes held, and the forward/backward peaks.

The walk follows execution order. Forward: the token ids (first stage) or the
received activation (later stages) and the residual stream are alive; block ``l``
peaks at its own high-water mark on top of what blocks ``< l`` hold; the head
peaks at the cross-entropy. Backward goes in reverse: the loss, then each block
at its high-water mark while blocks ``< l`` still hold theirs, then the embedding
(a first stage). Peaks are relative to whatever else the rank holds (other
microbatches in flight, persistent state).

A tied head (``tie_embeddings``, so one stage holds the embedding and the head) has
no gradient sink: its BF16 [V, D] weight gradient waits in autograd's input buffer
of the shared weight from the head's backward to the embedding's, through every
block's backward.

Zero bubble's split backward (``moe_pp.backward``) has its own figures: the input
pass keeps the whole graph (nothing saved is freed) and accumulates the dy operands
it captures (``activations.Inventory``), the loss's saved tensors go at its end, and
the weight pass adds one weight gradient at a time to what it left. A first stage has
no input gradient to compute (token ids): its input pass does nothing and its
weight pass is the whole backward in one autograd call that keeps the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_model import MoEConfig

from pretrain.planner.activations import (
    Execution,
    block_inventory,
    embedding_backward,
    head_memory,
    tokens_memory,
)


@dataclass(frozen=True)
class StageMemory:
    held: int  # bytes kept from this microbatch's forward until its backward
    fwd_peak: int  # high-water mark of its forward (bytes of this microbatch)
    bwd_peak: int  # high-water mark of its backward
    blocks_held: int  # part of ``held`` in the blocks (the rest: edges)
    # the split backward (zero bubble), bytes of this microbatch likewise: the input pass's
    # high-water mark, what it keeps until the weight pass, the weight pass's high-water mark
    split_input_peak: int
    split_held: int
    split_weight_peak: int

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
    tied_head = cfg.tie_embeddings and first and last
    if tied_head:  # the head's gradient, until the embedding's backward adds its own
        held += b * cfg.vocab_size * D
    for inv in reversed(inventories):
        held -= inv.held(recompute)
        bwd_peak = max(bwd_peak, held + inv.backward_peak(recompute))
    if first:
        bwd_peak = max(bwd_peak, held + embedding_backward(cfg, ex, tied_head))

    if recompute != "none" or (first and last):
        # not split (the app refuses zero bubble with recompute; a split stage is never
        # both first and last): the ordinary backward's figures
        split = (bwd_peak, total_held, bwd_peak)
    elif first:
        # the received gradient is held from the input pass to the weight pass, whose
        # one autograd call keeps everything saved until it ends
        kept = total_held + residual
        moments = [total_held - inv.held("none") + inv.retained_backward_peak()
                   for inv in inventories]
        moments.append(total_held + embedding_backward(cfg, ex, False))
        split = (kept, kept, residual + max(moments))
    else:
        captured = 0
        if head is not None:
            input_peak = total_held - head.held + head.input_pass_peak
            captured += head.deferred
        else:
            input_peak = total_held + residual
        # what the input pass frees before the blocks' backward (the loss's saved tensors)
        freed = head.freed_by_input_pass if head is not None else 0
        for inv in reversed(inventories):
            input_peak = max(input_peak, total_held - freed - inv.held("none")
                             + inv.input_pass_peak() + captured)
            captured += inv.deferred()
        kept = total_held - freed + captured
        temporaries = [inv.weight_pass_temporaries() for inv in inventories]
        temporaries.append(head.weight_pass_temporaries if head is not None else 0)
        split = (input_peak, kept, kept + max(temporaries))
    return StageMemory(total_held, fwd_peak, bwd_peak, blocks_held, *split)
