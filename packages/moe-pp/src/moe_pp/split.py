"""Which blocks each pipeline stage runs.

There are ``S = pp * virtual`` stages in model order. Stage ``s`` lives on PP rank
``s % pp`` as that rank's local chunk ``s // pp`` (interleaved assignment: a
microbatch visits ranks 0, 1, .., pp-1, 0, 1, .. and each rank's chunks are spread
over the depth, which is what shortens the bubble of interleaved schedules).
Stage 0 also runs the embedding; the last stage runs the final norm, the head and
the loss.

A split is given explicitly (blocks per stage, as counts or as block names) or
computed by a balanced policy that minimises the most expensive stage, counting
the embedding on the first stage and norm + head on the last. Every stage gets at
least one block, every block is in exactly one stage, and stages keep the model's
block order (a pipeline computes the same function only if the activation flows
through the blocks in order); anything else is refused with a ``SplitError``
that names the problem.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn

from moe_pp.costs import forward_flops_per_token, param_count
from moe_pp.protocols import PipelineModel

SplitPolicy = Literal["params", "flops"]
POLICIES: tuple[SplitPolicy, ...] = typing.get_args(SplitPolicy)


class SplitError(ValueError):
    """A pipeline split that cannot be built; the message says why."""


@dataclass(frozen=True)
class StageSplit:
    pp: int  # pipeline ranks
    virtual: int  # stages (model chunks) per rank
    stage_blocks: tuple[tuple[str, ...], ...]  # block names of each stage, in model order

    def __post_init__(self) -> None:
        if self.pp < 1 or self.virtual < 1:
            raise SplitError(f"pp ({self.pp}) and virtual ({self.virtual}) must be >= 1")
        if len(self.stage_blocks) != self.n_stages:
            raise SplitError(
                f"{len(self.stage_blocks)} stages given, pp={self.pp} x virtual={self.virtual} "
                f"needs {self.n_stages}"
            )
        for s, names in enumerate(self.stage_blocks):
            if not names:
                raise SplitError(f"stage {s} has zero blocks")

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among its rank's stages."""
        return stage // self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The stages PP rank ``rank`` runs, in model order."""
        if not 0 <= rank < self.pp:
            raise SplitError(f"rank {rank} is outside the pipeline's {self.pp} ranks")
        return list(range(rank, self.n_stages, self.pp))


BlockSpec = str | Sequence[int] | Sequence[Sequence[str]]


def split_model(
    model: PipelineModel,
    pp: int,
    virtual: int = 1,
    blocks: BlockSpec = "params",
    seq_len: int | None = None,
) -> StageSplit:
    """Split ``model.blocks`` over ``pp * virtual`` stages.

    ``blocks`` is a policy name (``"params"``: balance parameter counts, i.e.
    memory; ``"flops"``: balance the structural forward-FLOPs estimate, which needs
    ``seq_len``), a list of block counts per stage, or a list of block-name lists
    per stage.
    """
    check_model(model)
    names = list(model.blocks.keys())
    n_stages = pp * virtual
    if pp < 1 or virtual < 1:
        raise SplitError(f"pp ({pp}) and virtual ({virtual}) must be >= 1")
    if isinstance(blocks, str):
        stage_blocks = _balanced(model, names, n_stages, blocks, seq_len)
    else:
        stage_blocks = _explicit(names, n_stages, blocks)
    return StageSplit(pp, virtual, stage_blocks)


def check_model(model: object) -> None:
    """Refuse objects that do not have the structure a pipeline split needs."""
    missing = [a for a in ("embed", "blocks", "norm", "head") if not hasattr(model, a)]
    if missing or not isinstance(model, nn.Module):
        raise SplitError(
            f"{type(model).__name__} is not a pipeline model: it needs to be an nn.Module with "
            f"embed, blocks, norm and head (missing: {', '.join(missing) or 'nn.Module base'})"
        )
    if not isinstance(model.blocks, nn.ModuleDict):
        raise SplitError(f"model.blocks must be an nn.ModuleDict, got {type(model.blocks).__name__}")
    if len(model.blocks) == 0:
        raise SplitError("model.blocks is empty: there is nothing to split")
    own = [n for n, _ in model.named_parameters(recurse=False)]
    if own:
        raise SplitError(
            f"the model holds parameters outside embed/blocks/norm/head ({', '.join(own)}); "
            "no stage could own them"
        )
    _check_untied(model)


def _check_untied(model: nn.Module) -> None:
    """Refuse tied embeddings: the first stage would hold the one parameter as
    ``embed.weight`` and the last as ``head.weight``, and nothing adds the two gradients."""
    embed = {id(p) for p in model.embed.parameters()} if model.embed is not None else set()
    head = model.head.named_parameters() if model.head is not None else ()
    shared = [f"head.{n}" for n, p in head if id(p) in embed]
    tied = bool(getattr(getattr(model, "config", None), "tie_embeddings", False))
    if shared or tied:
        why = (f"{', '.join(shared)} is the embedding's parameter" if shared
               else "config.tie_embeddings is set")
        raise SplitError(
            f"tied embeddings cannot be pipelined ({why}): the embedding runs on the first "
            "stage and the head on the last, each would get only its part of the one "
            "parameter's gradient; untie them (tie_embeddings=False)"
        )


def _explicit(
    names: list[str], n_stages: int, spec: Sequence[int] | Sequence[Sequence[str]]
) -> tuple[tuple[str, ...], ...]:
    if len(spec) != n_stages:
        raise SplitError(f"the split lists {len(spec)} stages, the pipeline has {n_stages}")
    if all(isinstance(c, int) and not isinstance(c, bool) for c in spec):
        counts = [int(c) for c in spec]  # type: ignore[arg-type]
        for s, c in enumerate(counts):
            if c <= 0:
                raise SplitError(f"stage {s} has {c} blocks; every stage needs at least one")
        if sum(counts) != len(names):
            raise SplitError(
                f"the split's block counts {counts} add up to {sum(counts)}, "
                f"the model has {len(names)} blocks"
            )
        bounds = [sum(counts[:s]) for s in range(n_stages + 1)]
        return tuple(tuple(names[bounds[s] : bounds[s + 1]]) for s in range(n_stages))
    if any(isinstance(c, str) or not isinstance(c, Sequence) for c in spec):
        raise SplitError("an explicit split is a list of block counts or a list of block-name lists")
    stage_blocks = tuple(tuple(str(n) for n in stage) for stage in spec)  # type: ignore[union-attr]
    _check_cover(names, stage_blocks)
    return stage_blocks


def _check_cover(names: list[str], stage_blocks: tuple[tuple[str, ...], ...]) -> None:
    """Every block exactly once, no stage empty, stages in model order."""
    position = {n: i for i, n in enumerate(names)}
    for s, stage in enumerate(stage_blocks):
        if not stage:
            raise SplitError(f"stage {s} has zero blocks")
        unknown = [n for n in stage if n not in position]
        if unknown:
            raise SplitError(f"stage {s} names blocks the model does not have: {unknown}")
    flat = [n for stage in stage_blocks for n in stage]
    duplicates = sorted({n for n in flat if flat.count(n) > 1}, key=position.__getitem__)
    if duplicates:
        raise SplitError(f"blocks {duplicates} are assigned to more than one stage")
    missing = [n for n in names if n not in set(flat)]
    if missing:
        raise SplitError(f"blocks {missing} are not assigned to any stage")
    if [position[n] for n in flat] != list(range(len(names))):
        raise SplitError(
            "stages must hold contiguous runs of blocks in model order "
            f"(model order {names}, split {[list(s) for s in stage_blocks]})"
        )


def _balanced(
    model: PipelineModel, names: list[str], n_stages: int, policy: str, seq_len: int | None
) -> tuple[tuple[str, ...], ...]:
    if policy not in POLICIES:
        raise SplitError(f"unknown split policy {policy!r}; expected one of {POLICIES}")
    if n_stages > len(names):
        raise SplitError(
            f"cannot split {len(names)} blocks into {n_stages} stages: "
            "a stage would have zero blocks"
        )
    if policy == "params":
        cost = param_count
    else:
        if seq_len is None:
            raise SplitError("the 'flops' split policy needs seq_len (attention cost depends on it)")

        def cost(module: nn.Module | None) -> float:
            return forward_flops_per_token(module, seq_len)

    block_costs = [cost(model.blocks[n]) for n in names]
    first_extra = cost(model.embed)
    last_extra = cost(model.norm) + cost(model.head)
    counts = balanced_counts(block_costs, n_stages, first_extra, last_extra)
    bounds = [sum(counts[:s]) for s in range(n_stages + 1)]
    return tuple(tuple(names[bounds[s] : bounds[s + 1]]) for s in range(n_stages))


def balanced_counts(
    block_costs: Sequence[float], n_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Blocks per stage (contiguous, each >= 1) minimising the largest stage cost.

    Two exact dynamic programmes over cut points, O(stages * blocks^2): the first
    finds the smallest possible maximum stage cost; the second, among splits that
    reach it, takes the one with the smallest sum of squared stage costs (so a
    stage that cannot be filled further does not leave the others uneven). The
    first stage also pays ``first_extra``, the last ``last_extra``; ties go to the
    earliest cut, so every rank computes the same split.
    """
    n = len(block_costs)
    if not 1 <= n_stages <= n:
        raise SplitError(f"cannot split {n} blocks into {n_stages} stages")
    prefix = [0.0]
    for c in block_costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == n_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    def solve(objective, combine) -> tuple[float, list[int]]:
        """Best value of stages 0..S-1 over blocks [0, n) and its stage sizes."""
        inf = float("inf")
        # best[k][i]: best value of stages 0..k-1 holding blocks [0, i); cut: stage k-1's start
        best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, n_stages + 1):
            for i in range(k, n - (n_stages - k) + 1):
                for j in range(k - 1, i):
                    term = objective(stage_cost(k - 1, j, i))
                    value = combine(best[k - 1][j], term)
                    if value < best[k][i]:
                        best[k][i], cut[k][i] = value, j
        counts, end = [], n
        for k in range(n_stages, 0, -1):
            counts.append(end - cut[k][end])
            end = cut[k][end]
        return best[n_stages][n], counts[::-1]

    peak, _ = solve(lambda c: c, max)
    limit = peak + 1e-9 * max(1.0, abs(peak))
    _, counts = solve(lambda c: c * c if c <= limit else float("inf"), lambda a, b: a + b)
    return counts
