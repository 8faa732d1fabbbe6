"""Held-out evaluation: the loss of a fixed set of validation windows under the run's layout.

The windows are the first ``n = min(eval.tokens // seq_len, windows in the file)``
consecutive ``seq_len + 1``-token windows of ``data.val_path``: the same every time and
whatever the layout. They are cut into rounds of ``dp * micro_batch`` rows; DP rank
``r`` forwards rows ``[r * micro_batch, (r + 1) * micro_batch)`` of each round. The last
round is padded with copies of window 0 whose targets are ``IGNORE_INDEX`` (count zero),
so every rank runs the same number of microbatches of the training shape, which expert
transports and pipeline stages need.

``loss_sum`` runs without gradients, touches no optimizer state and no routing
statistics (MoE layers count only training forwards with autograd on), and queues one
SUM all-reduce of the token-loss sum over the world; the value stays on the device until
the step's one host read (``pretrain.trainer``), which divides it by ``n * seq_len``.

After each evaluation, ``callbacks`` run with the step and the model part (e.g. writing
sample completions).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from moe_model import lm_loss_sum
from moe_model.loss import IGNORE_INDEX

from pretrain.data import DataError, StreamSequences, open_source, token_dir_info, training_data_info

if TYPE_CHECKING:
    from pretrain.build import ModelPart
    from pretrain.config import PretrainConfig
    from pretrain.mesh import ParallelMesh

EvalCallback = Callable[[int, "ModelPart"], None]


def eval_every(cfg: PretrainConfig) -> int:
    """Steps between evaluations: ``eval.every``, or 10% of the run when unset; 0 without
    ``data.val_path``."""
    if not cfg.data.val_path:
        return 0
    if cfg.eval.every is None:
        return max(1, cfg.train.steps // 10)
    return cfg.eval.every


def check_val_data(cfg: PretrainConfig) -> None:
    """``data.val_path`` was written by the training data's tokenizer with its vocabulary."""
    val = token_dir_info(cfg.data.val_path, "data.val_path")
    train = training_data_info(cfg.data)
    if train is None:
        raise DataError(f"data.val_path={cfg.data.val_path!r} needs token-directory training data "
                        f"(data.path or data.sources), not data.path={cfg.data.path!r}")
    unhashed = val.tokenizer.sha256 is None and train.tokenizer.sha256 is None
    same = val.tokenizer.name == train.tokenizer.name if unhashed else val.tokenizer.same_as(train.tokenizer)
    if not same or val.vocab_size != train.vocab_size:
        raise DataError(
            f"{val.sidecar} (tokenizer {val.tokenizer.name!r}, sha256 {val.tokenizer.sha256}, "
            f"vocab_size {val.vocab_size}) does not match the training data's {train.sidecar} "
            f"(tokenizer {train.tokenizer.name!r}, sha256 {train.tokenizer.sha256}, "
            f"vocab_size {train.vocab_size})")


class Evaluator:
    """This rank's share of the validation windows and the forward that scores them."""

    def __init__(self, cfg: PretrainConfig, mesh: ParallelMesh, device: torch.device,
                 part: ModelPart) -> None:
        check_val_data(cfg)
        t = cfg.train
        source = open_source(cfg.data.val_path, t.seq_len, cfg.model.vocab_size, 0, cfg.data.verify)
        assert isinstance(source, StreamSequences), "data.val_path is a token directory or file"
        self.n_windows = max(1, min(cfg.eval.tokens // t.seq_len, source.n_sequences))
        self.n_tokens = self.n_windows * t.seq_len
        self.mesh, self.device, self.part = mesh, device, part
        self.callbacks: list[EvalCallback] = []
        dp, mb = mesh.layout.dp, t.micro_batch
        per_round = dp * mb
        rounds = math.ceil(self.n_windows / per_round)
        self.batches: list[torch.Tensor] = []
        for k in range(rounds):
            ids = np.arange(k * per_round + mesh.dp_rank * mb, k * per_round + (mesh.dp_rank + 1) * mb)
            valid = ids < self.n_windows
            tokens = torch.from_numpy(source.read(np.where(valid, ids, 0)))
            tokens[torch.from_numpy(~valid), 1:] = IGNORE_INDEX  # padding: targets count zero
            self.batches.append(tokens)

    def loss_sum(self, step: int) -> torch.Tensor:
        """The token-loss sum over all windows, summed over the world (on the device)."""
        batches = [b.to(self.device, non_blocking=True) for b in self.batches]
        inputs = [b[:, :-1].clamp_min(0) for b in batches]
        targets = [b[:, 1:] for b in batches]
        pipeline = self.part.pipeline
        with torch.no_grad():
            if pipeline is not None:
                total = pipeline.forward_only(inputs, targets, lm_loss_sum)
                if total is None:
                    total = torch.zeros((), dtype=torch.float32, device=self.device)
            else:
                total = torch.zeros((), dtype=torch.float32, device=self.device)
                for x, y in zip(inputs, targets, strict=True):
                    total += lm_loss_sum(self.part.module(x), y)
        dist.all_reduce(total)  # the last stages hold the shares, other ranks zero
        for callback in self.callbacks:
            callback(step, self.part)
        return total
