"""The structural interfaces moe_pp consumes (declared here, by the consumer).

moe_pp never imports the model or the data-parallel package: anything with the
right shape works.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class PipelineModel(Protocol):
    """A model that reads ``embed -> blocks -> norm -> head``.

    It is an ``nn.Module`` whose ``forward`` takes what ``embed`` takes (or the
    hidden state when ``embed`` is ``None``) and returns what ``head`` returns (or
    the hidden state when ``norm`` and ``head`` are ``None``), running the blocks
    that remain in ``blocks`` in their dict order. Any of ``embed``, ``norm`` and
    ``head`` may be ``None`` and blocks may be deleted: that is how a stage is made.
    An optional ``config`` is read for ``tie_embeddings`` (refused: see ``split``) and
    ``recompute`` (refused under a split backward: see ``runtime``).
    """

    embed: nn.Module | None
    blocks: nn.ModuleDict
    norm: nn.Module | None
    head: nn.Module | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class GradSync(Protocol):
    """A data-parallel gradient synchroniser (e.g. moe_ddp's ``MultiGroupDDP``).

    The pipeline runs every backward of a step inside ``no_sync()`` and calls
    ``finish_grad_sync()`` once after the schedule.
    """

    def no_sync(self) -> AbstractContextManager[None]: ...

    def finish_grad_sync(self) -> None: ...
