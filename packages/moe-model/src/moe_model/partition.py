"""Which slice of the model a rank owns, and cutting a model down to it.

Expert parallelism gives each rank a contiguous, equal range of every MoE
layer's experts; pipeline parallelism gives each stage a contiguous range of
blocks, the first stage the embedding and the last the final norm and head.
Parameter names do not change (``blocks.5.mlp.experts.w1`` stays block 5's
name on whichever stage holds it), and ``init_weights`` gives a slice the same
values the full model holds, so layouts can be compared tensor by tensor.

For models too large to build whole, build under ``torch.device("meta")``,
``partition_`` it, then ``to_empty(device=...)`` and ``init_weights``.
"""

from __future__ import annotations

from moe_model.model import MoETransformer


def expert_range(n_experts: int, ep_rank: int, ep_size: int) -> range:
    """Experts held by rank ``ep_rank`` of ``ep_size``: ``[r*E/ep, (r+1)*E/ep)``."""
    if ep_size <= 0 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} is not a rank of ep_size={ep_size}")
    if n_experts % ep_size:
        raise ValueError(f"n_experts={n_experts} is not divisible by ep_size={ep_size}")
    per_rank = n_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def layer_range(n_layers: int, stage: int, n_stages: int) -> range:
    """Blocks held by pipeline stage ``stage`` of ``n_stages``: contiguous, balanced;
    the first ``n_layers % n_stages`` stages hold one block more."""
    if n_stages <= 0 or not 0 <= stage < n_stages:
        raise ValueError(f"stage={stage} is not a stage of n_stages={n_stages}")
    if n_layers < n_stages:
        raise ValueError(f"n_layers={n_layers} is fewer than n_stages={n_stages}")
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def partition_(
    model: MoETransformer, layers: range | None = None, experts: range | None = None
) -> MoETransformer:
    """Cut a full model down, in place, to ``layers`` (blocks) and ``experts`` (per MoE layer).

    The embedding stays only if ``layers`` starts at block 0; the final norm and the
    head only if it ends at the last block. Returns ``model``.
    """
    cfg = model.config
    layers = range(cfg.n_layers) if layers is None else layers
    experts = range(cfg.n_experts) if experts is None else experts
    if layers.step != 1 or not (0 <= layers.start < layers.stop <= cfg.n_layers):
        raise ValueError(f"layers={layers} is not a non-empty contiguous range of {cfg.n_layers} blocks")
    if experts.step != 1 or not (0 <= experts.start < experts.stop <= cfg.n_experts):
        raise ValueError(f"experts={experts} is not a non-empty contiguous range of {cfg.n_experts} experts")
    for name in list(model.blocks.keys()):
        if int(name) not in layers:
            del model.blocks[name]
    if layers.start != 0:
        model.embed = None
    if layers.stop != cfg.n_layers:
        model.norm = None
        model.head = None
    for _, layer in model.moe_layers():
        held = layer.experts.expert_range
        if not (held.start <= experts.start and experts.stop <= held.stop):
            raise ValueError(f"experts={experts} is not inside the held experts {held}")
        layer.experts.narrow_(experts.start - held.start, len(experts))
    return model
