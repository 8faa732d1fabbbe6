"""Parameter metadata for parallel wrappers and checkpointing.

Every parameter is one of two kinds:
- ``"expert"``: a routed expert's stacked weight (``...mlp.experts.w1|w2|w3``),
  expert dimension ``EXPERT_DIM`` (0); expert parallelism shards it along that
  dimension and its replica group is EP-DP. A module holding experts
  ``[s, s+n)`` holds rows ``[s, s+n)`` of the logical tensor.
- ``"dense"``: everything else (attention, norms, router, shared experts, dense
  MLPs, embedding, head); replicated over the data-parallel group.

Names (FQNs) are the same in every partition. ``logical_shapes(cfg)`` gives the
full (global) shape of every parameter and persistent buffer, which a checkpoint
needs to place a rank's slice at its global offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from moe_model.config import MoEConfig
from moe_model.experts import GroupedExperts

EXPERT_DIM = 0
_EXPERT_SUFFIXES = (".experts.w1", ".experts.w2", ".experts.w3")

ParamKind = Literal["expert", "dense"]


def param_kind(name: str) -> ParamKind:
    """``"expert"`` for routed-expert weights (expert dim 0), else ``"dense"``."""
    return "expert" if name.endswith(_EXPERT_SUFFIXES) else "dense"


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, range]]:
    """``(name, param, global expert range held)`` for every routed-expert weight."""
    for mod_name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname, p in module.named_parameters(recurse=False):
                yield f"{mod_name}.{pname}", p, module.expert_range


def dense_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, param)`` for every parameter that is not a routed-expert weight."""
    for name, p in model.named_parameters():
        if param_kind(name) == "dense":
            yield name, p


def logical_shapes(cfg: MoEConfig) -> dict[str, torch.Size]:
    """Full shapes of the state (parameters and persistent buffers) of the whole model."""
    from moe_model.model import MoETransformer

    with torch.device("meta"):
        model = MoETransformer(cfg)
    return {name: t.shape for name, t in model.state_dict().items()}
