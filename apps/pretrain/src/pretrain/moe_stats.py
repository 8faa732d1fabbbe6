"""One optimizer step's loss, stop flag and MoE routing statistics, reduced in one collective.

What the app needs from a MoE layer (declared here, by the consumer):
``take_step_stats()`` returning device tensors accumulated since the last call (``{}``
if none) and ``end_step()`` ending the optimizer step for its balancing counts; the
values are

- ``tokens_per_expert`` ``[E]`` int: routed (token, slot) pairs per expert;
- ``dropped_per_expert`` ``[E]`` int: slots no expert processed (capacity);
- ``n_tokens`` scalar int: tokens routed;
- ``lb_loss_sum`` / ``z_loss_sum`` scalars: the unweighted load-balancing loss and
  router z-loss in token-sum form.

Every rank packs its values into one flat FP64 tensor laid out over the *whole
model's* MoE layers (``slot`` = MoE layer index in model order): a pipeline stage
fills the slots of the layers it holds and leaves the others zero, and only ranks
holding the last stage put in the loss. A SUM all-reduce over the world then gives
every rank the loss of the global batch, every layer's statistics summed over the
data-parallel ranks (which routed different tokens) and whether any rank received
a stop signal: one collective per step, however many layers, stages and flags.
FP64 keeps token counts exact.

Shape legend: L MoE layers of the model, E experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

_HEAD = 2  # loss, stop flag
_SCALARS = ("n_tokens", "lb_loss_sum", "z_loss_sum")


class StepStatsSource(Protocol):
    def take_step_stats(self) -> Mapping[str, torch.Tensor]: ...

    def end_step(self) -> None: ...


@dataclass
class MoEStepStats:
    """Routing statistics of one step, summed over ranks (host tensors, FP64)."""

    tokens_per_expert_LE: torch.Tensor
    dropped_LE: torch.Tensor
    n_tokens_L: torch.Tensor
    lb_loss_sum_L: torch.Tensor
    z_loss_sum_L: torch.Tensor

    def record(self, with_load: bool) -> dict[str, Any]:
        """Metric fields: per-token losses averaged over layers, load balance, drops."""
        counts = self.tokens_per_expert_LE
        n_tokens = self.n_tokens_L.clamp_min(1)
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)
        out: dict[str, Any] = {
            "lb_loss": (self.lb_loss_sum_L / n_tokens).mean().item(),
            "z_loss": (self.z_loss_sum_L / n_tokens).mean().item(),
            "expert_load_imbalance": imbalance.max().item(),
            "dropped_token_rate": (self.dropped_LE.sum() / counts.sum().clamp_min(1)).item(),
        }
        if with_load:
            out["expert_load"] = counts.long().tolist()
        return out


@dataclass
class StepValues:
    """The reduced step as the host reads it."""

    loss: float
    stop: bool
    moe: MoEStepStats | None


class StepPacker:
    """Packs a rank's step values into model-wide slots; unpacks the reduced tensor.

    ``layers`` maps a slot (MoE layer index in the model) to the layer this rank
    holds there.
    """

    def __init__(self, layers: Mapping[int, StepStatsSource], n_slots: int, n_experts: int,
                 device: torch.device) -> None:
        bad = [s for s in layers if not 0 <= s < n_slots]
        if bad:
            raise ValueError(f"MoE layer slots {bad} are outside the model's {n_slots} MoE layers")
        self.layers, self.n_slots, self.n_experts = dict(layers), n_slots, n_experts
        self.width = 2 * n_experts + len(_SCALARS)
        self.device = device

    def stats(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[L * (2E + 3)]`` FP64: every held layer's statistics since the last take, taken
        (into ``out``, zeros of that size, when given).

        The step goes on (a group of microbatches replayed from a CUDA graph adds this into
        a running sum that ``pack`` receives as ``stats``).
        """
        if out is None:
            out = torch.zeros(self.n_slots * self.width, dtype=torch.float64, device=self.device)
        slots = out.view(self.n_slots, self.width)
        E = self.n_experts
        for slot, layer in self.layers.items():
            stats = layer.take_step_stats()
            if not stats:
                raise RuntimeError(f"MoE layer {slot} recorded no routing statistics this step")
            row = slots[slot]
            row[:E] = stats["tokens_per_expert"]
            row[E:2 * E] = stats["dropped_per_expert"]
            row[2 * E:] = torch.stack([stats[k].to(torch.float64) for k in _SCALARS])
        return out

    def pack(self, loss: torch.Tensor | None, stop: bool,
             stats: torch.Tensor | None = None) -> torch.Tensor:
        """``[2 + L * (2E + 3)]`` FP64: loss (``None``: this rank holds no loss), stop, stats.

        ``stats``: the step's statistics as ``stats()`` lays them out, already taken; by
        default they are taken now, in place. Ends the step for every held layer.
        """
        flat = torch.zeros(_HEAD + self.n_slots * self.width, dtype=torch.float64,
                           device=self.device)
        if stats is None:
            self.stats(out=flat[_HEAD:])
        else:
            flat[_HEAD:] = stats
        if loss is not None:
            flat[0] = loss
        flat[1:2].fill_(float(stop))  # a kernel argument: item assignment would copy from the host
        for layer in self.layers.values():
            layer.end_step()
        return flat

    def counts(self, flat: torch.Tensor) -> torch.Tensor:
        """``[L, E]`` routed slots per expert of a (reduced) packed tensor: a device view."""
        return flat[_HEAD:].view(self.n_slots, self.width)[:, :self.n_experts]

    def unpack(self, flat: torch.Tensor) -> StepValues:
        """The reduced values from a host copy of the packed tensor."""
        moe = None
        if self.n_slots:
            slots = flat[_HEAD:].view(self.n_slots, self.width)
            E = self.n_experts
            moe = MoEStepStats(slots[:, :E], slots[:, E:2 * E], slots[:, 2 * E], slots[:, 2 * E + 1],
                               slots[:, 2 * E + 2])
        return StepValues(loss=flat[0].item(), stop=bool(flat[1].item() > 0), moe=moe)
