"""Each rank's share of every global batch.

The global batch of optimizer step ``s`` (counting from 1) is the run-wide samples
``[(s-1)*G, s*G)`` of the global order, as ``G`` rows. DP rank ``r`` owns rows
``[r*G/dp, (r+1)*G/dp)`` and reads them as consecutive microbatches of
``micro_batch`` rows. Concatenating every rank's microbatches in (rank,
microbatch) order gives the global batch in order, whatever the layout, so
every layout trains on the same tokens and computes the same loss. Pipeline
stages of one DP rank read the same rows (the first stage needs the inputs, the
last the targets).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pretrain.data.mixture import sample_order
from pretrain.data.sources import SequenceSource

if TYPE_CHECKING:
    import torch


class BatchReader:
    def __init__(self, source: SequenceSource, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        if global_batch % (dp_size * micro_batch):
            raise ValueError(
                f"global batch {global_batch} is not divisible by "
                f"dp {dp_size} x micro batch {micro_batch}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        self.source, self.order = source, sample_order(source, seed)
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rows_per_rank = global_batch // dp_size
        self.n_microbatches = self.rows_per_rank // micro_batch
        self.first_row = dp_rank * self.rows_per_rank

    def sequence_ids(self, step: int, first_row: int, n_rows: int) -> np.ndarray:
        """Sequence ids of rows ``[first_row, first_row + n_rows)`` of step ``step``'s batch."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        start = (step - 1) * self.global_batch + first_row
        return self.order.sequence_ids(np.arange(start, start + n_rows, dtype=np.int64))

    def microbatch(self, step: int, index: int) -> torch.Tensor:
        """``[micro_batch, seq_len + 1]`` int64 tokens of this rank's microbatch ``index``."""
        import torch  # here, not at the top: prepare-data imports this package, torch unused

        if not 0 <= index < self.n_microbatches:
            raise IndexError(f"microbatch {index} of {self.n_microbatches}")
        first = self.first_row + index * self.micro_batch
        return torch.from_numpy(self.source.read(self.sequence_ids(step, first, self.micro_batch)))

