"""Stage modules: views of the built model that run part of it.

A stage is the model's own root module, shallow-copied, with ``blocks`` replaced
by a ``ModuleDict`` of the stage's blocks and ``embed`` / ``norm`` / ``head`` set
to ``None`` where the stage does not own them. The blocks and other submodules
are *shared* with the model, not copied, so:

- parameter names (FQNs) are exactly those of the unsplit model;
- no weights are duplicated, and a model on the meta device can be split first
  and materialised per rank afterwards (``to_empty`` on the rank's module, then
  the layout-independent initialiser);
- the model's own ``forward`` runs each stage, so a stage computes exactly what
  that slice of the model computes.

A rank with several stages (virtual stages) gets one module per stage for the
schedule to run, plus one module holding all of them (``RankStages.module``) for
the data-parallel wrapper, the optimizer and checkpoints.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from moe_pp.protocols import PipelineModel
from moe_pp.split import SplitError, StageSplit, check_model


@dataclass
class Stage:
    index: int  # stage number in model order (0 .. n_stages-1)
    module: nn.Module  # runs this stage's part of the model
    is_first: bool  # takes the model's input (tokens); holds ``embed``
    is_last: bool  # produces the model's output (logits); holds ``norm`` and ``head``


@dataclass
class RankStages:
    rank: int  # PP rank
    stages: list[Stage]  # this rank's stages in model order
    module: nn.Module  # all of this rank's parameters under their model names


def partial_model(
    model: PipelineModel, block_names: Iterable[str], first: bool, last: bool
) -> nn.Module:
    """The model's root with only ``block_names`` and, if ``first``/``last``, embed / norm+head.

    Shares everything with ``model`` but its submodule dict, so replacing a child
    in one view does not touch another, while materialising or re-initialising a
    shared child (or a root-level buffer) is seen by all of them.
    """
    check_model(model)
    keep = list(block_names)
    unknown = [n for n in keep if n not in model.blocks]
    if unknown:
        raise SplitError(f"the model has no blocks named {unknown}")
    view = copy.copy(model)
    view.__dict__["_modules"] = copy.copy(model.__dict__["_modules"])
    view.blocks = nn.ModuleDict({name: model.blocks[name] for name in keep})
    if not first:
        view.embed = None
    if not last:
        view.norm = None
        view.head = None
    return view


def build_rank_stages(model: PipelineModel, split: StageSplit, rank: int) -> RankStages:
    """This PP rank's stage modules (and their union) for ``split``.

    Works on a model on any device, including ``meta``. Refuses a split that does
    not match the model's blocks.
    """
    check_model(model)
    names = list(model.blocks.keys())
    flat = [n for stage in split.stage_blocks for n in stage]
    if flat != names:
        raise SplitError(
            f"the split covers blocks {flat} but the model has {names} (in this order)"
        )
    last_stage = split.n_stages - 1
    stages = [
        Stage(
            index=s,
            module=partial_model(model, split.stage_blocks[s], s == 0, s == last_stage),
            is_first=s == 0,
            is_last=s == last_stage,
        )
        for s in split.stages_of(rank)
    ]
    own_blocks = [n for s in split.stages_of(rank) for n in split.stage_blocks[s]]
    union = partial_model(
        model, own_blocks, any(s.is_first for s in stages), any(s.is_last for s in stages)
    )
    return RankStages(rank, stages, union)
