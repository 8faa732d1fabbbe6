"""Held-out evaluation: the loss of a fixed set of validation windows under the run's layout.

The windows are the first ``n = min(eval.tokens // seq_len, windows in the file)``
consecutive ``seq_len + 1``-token windows of ``data.val_path`` (window ``i`` starts at
token ``i * seq_len``, so the ``n * seq_len`` targets are each scored once): the same
every time and whatever the layout. They are cut into rounds of ``dp * micro_batch``
rows; DP rank ``r`` forwards rows ``[r * micro_batch, (r + 1) * micro_batch)`` of each
round (``eval_rows``). The last round is padded with copies of window 0 whose targets
are ``IGNORE_INDEX`` (they count zero), so every rank runs the same number of
microbatches of the training shape, which the expert transports and the pipeline
stages need.

``Evaluator.loss_sum`` runs the forwards without gradients, touches no gradient,
optimizer state or routing statistic (an MoE layer counts only forwards with autograd
on), and queues one SUM all-reduce of the token-loss sum over the world; the sum stays
on the device until the step's one host read (``pretrain.trainer``), which divides it
by ``n * seq_len``. The windows live on the device from the start: an evaluation copies
nothing from the host.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from moe_model import documents_from_eos, lm_loss_sum
from moe_model.loss import IGNORE_INDEX

from pretrain.data import DataError, TokenDirInfo, open_source, token_dir_info, training_data_info

if TYPE_CHECKING:
    from pretrain.build import ModelPart
    from pretrain.config import PretrainConfig
    from pretrain.mesh import ParallelMesh


class ValidationDataError(DataError):
    """``data.val_path`` cannot be scored against the training data (another tokenizer or
    vocabulary); the message names both ``tokens.json`` files."""


def eval_every(cfg: PretrainConfig) -> int:
    """Steps between evaluations: ``eval.every``, or 10% of the run when unset; 0 (never)
    without ``data.val_path``."""
    if not cfg.data.val_path:
        return 0
    if cfg.eval.every is None:
        return max(1, cfg.train.steps // 10)
    return cfg.eval.every


def check_val_data(cfg: PretrainConfig) -> TokenDirInfo:
    """``data.val_path``'s sidecar, checked to record the training data's tokenizer and
    vocabulary (token ids of another tokenizer would score text the model never saw).

    Tokenizers compare by SHA-256 when either sidecar records one, else by name (token
    files from other tools record none: both ``unknown``)."""
    val = token_dir_info(cfg.data.val_path, "data.val_path")
    train = training_data_info(cfg.data)
    if train is None:
        raise ValidationDataError(
            f"data.val_path={cfg.data.val_path!r} needs training data from a token directory "
            f"(data.path or data.sources) to compare tokenizers, not data.path={cfg.data.path!r}")
    hashed = val.tokenizer.sha256 is not None or train.tokenizer.sha256 is not None
    same = val.tokenizer.same_as(train.tokenizer) if hashed else val.tokenizer.name == train.tokenizer.name
    if not same or val.vocab_size != train.vocab_size:
        raise ValidationDataError(
            f"{val.sidecar} (tokenizer {val.tokenizer.name!r}, sha256 {val.tokenizer.sha256}, "
            f"vocab_size {val.vocab_size}) does not match the training data's {train.sidecar} "
            f"(tokenizer {train.tokenizer.name!r}, sha256 {train.tokenizer.sha256}, "
            f"vocab_size {train.vocab_size}): write data.val_path with the training data's tokenizer")
    return val


def eval_rows(n_windows: int, dp: int, dp_rank: int, micro_batch: int) -> list[np.ndarray]:
    """The window ids of DP rank ``dp_rank``'s evaluation microbatches, ``-1`` for padding
    rows: round ``k`` holds windows ``[k * dp * micro_batch, (k + 1) * dp * micro_batch)``,
    this rank's ``micro_batch`` of them at offset ``dp_rank * micro_batch``."""
    per_round = dp * micro_batch
    rows = []
    for k in range(math.ceil(n_windows / per_round)):
        start = k * per_round + dp_rank * micro_batch
        ids = np.arange(start, start + micro_batch)
        rows.append(np.where(ids < n_windows, ids, -1))
    return rows


class Evaluator:
    """This rank's share of the validation windows, on the device, and the forward that
    scores them (``loss_sum``)."""

    def __init__(self, cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device,
                 part: ModelPart, document_eos: int | None = None) -> None:
        """``document_eos``: the run's ``data.document_mask`` id (``None``: off); the
        windows are split into documents as the training windows are."""
        check_val_data(cfg)
        t = cfg.train
        source = open_source(cfg.data.val_path, t.seq_len, cfg.model.vocab_size, 0, cfg.data.verify)
        self.n_windows = min(cfg.eval.tokens // t.seq_len, source.n_sequences)
        self.n_tokens = self.n_windows * t.seq_len  # the targets scored: the loss's divisor
        self.part = part
        self.inputs: list[torch.Tensor] = []
        self.targets: list[torch.Tensor] = []
        self.documents: list[torch.Tensor | None] = []
        for ids in eval_rows(self.n_windows, mesh.layout.dp, mesh.dp_rank, t.micro_batch):
            padding = torch.from_numpy(ids < 0)
            tokens = torch.from_numpy(source.read(np.maximum(ids, 0)))
            targets = tokens[:, 1:].clone()
            targets[padding] = IGNORE_INDEX
            inputs = tokens[:, :-1].to(device)
            self.inputs.append(inputs)
            self.targets.append(targets.to(device))
            self.documents.append(None if document_eos is None
                                  else documents_from_eos(inputs, document_eos))

    def loss_sum(self) -> torch.Tensor:
        """The token-loss sum over all windows, summed over the world, on the device (FP32)."""
        pipeline = self.part.pipeline
        with torch.no_grad():
            if pipeline is not None:
                total = pipeline.forward_only(self.inputs, self.targets, lm_loss_sum)
            else:
                total = torch.zeros((), dtype=torch.float32, device=self.inputs[0].device)
                for x, y, documents in zip(self.inputs, self.targets, self.documents, strict=True):
                    total += lm_loss_sum(self.part.module(x, documents=documents), y)
        dist.all_reduce(total)  # each DP rank's last stage holds a share, other stages zero
        return total
