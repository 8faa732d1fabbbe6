"""Activation recompute for a block: ``block`` (everything) or ``selective``.

``selective`` keeps the outputs of the GEMMs and of attention (the expensive
operators) and recomputes everything else in backward: norms, RoPE, the SwiGLU
activation, routing, and the dispatch gathers (the largest MoE activations, since
every token is copied ``top_k`` times). It runs through PyTorch's selective
activation checkpointing, which works at the operator level; that is why the
Triton grouped GEMM is registered as a custom operator.

A recomputed forward must not repeat side effects: ``is_recomputing()`` is true
while one runs, and the MoE layer then skips its statistics and its
data-parallel count reduction (see ``moe_model.moe``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import moe_model._grouped_mm_launch  # noqa: F401 - registers torch.ops.moe_model.triton_grouped_mm

_state = threading.local()  # backward (and so recompute) may run on an autograd thread


def is_recomputing() -> bool:
    """True inside the forward that activation recompute replays during backward."""
    return getattr(_state, "active", False)


@contextmanager
def _recomputing() -> Iterator[None]:
    previous = is_recomputing()
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


@functools.cache
def _saved_ops() -> frozenset[Any]:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    # the 16-bit GEMMs with FP32 output (the router's logits on a GPU)
    ops |= {getattr(aten, n).dtype for n in ("mm", "addmm", "bmm") if "dtype" in getattr(aten, n).overloads()}
    ops.add(torch.ops.moe_model.triton_grouped_mm.default)
    ops.add(torch.ops.moe_model.triton_grouped_mm_split2.default)
    return frozenset(ops)


def _policy(saved: frozenset[Any]) -> Callable[..., CheckpointPolicy]:
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@contextmanager
def _replay(sac_context: Any) -> Iterator[None]:
    with sac_context, _recomputing():
        yield


def recompute_block(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                    selective: bool) -> torch.Tensor:
    """``fn(x)``, keeping only what the policy saves and recomputing the rest in backward."""

    def contexts() -> tuple[Any, Any]:
        if selective:
            fwd, rec = create_selective_checkpoint_contexts(_policy(_saved_ops()))
        else:
            fwd, rec = nullcontext(), nullcontext()
        return fwd, _replay(rec)

    return checkpoint(fn, x, use_reentrant=False, context_fn=contexts)
