"""Expert-parallel configuration and the static sizes derived from it.

Everything a no-sync transport must size up front comes from here: the rank
capacity (rows one rank can receive per call) and the slot bound of a source.
Experts are partitioned contiguously over the EP group: rank ``r`` holds global
experts ``[r * E/M, (r + 1) * E/M)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

OverflowPolicy = Literal["drop", "error"]
CombineSite = Literal["auto", "source", "destination"]
DispatchLayout = Literal["token_inbox", "per_slot"]


@dataclass(frozen=True)
class EPConfig:
    n_experts: int  # E: routed experts of the whole model layer (global ids 0..E-1)
    top_k: int  # k: experts per token
    max_tokens: int  # T_max: tokens per rank per call; a static bound (no host sync to size buffers)
    d_model: int  # D: hidden width; sizes the rowwise transport's symmetric buffers
    capacity_factor: float | None = 1.25  # rank capacity = ceil(cf * T_max * k); None = dropless
    overflow: OverflowPolicy = "drop"  # what happens past capacity: fair drop, or raise
    # Where a token's top-k contributions are summed: at the source after every row came back,
    # or partly at each destination (one FP32 partial per token and rank travels back);
    # "auto" picks the site that moves fewer bytes under uniform routing (sums_at_destination).
    combine: CombineSite = "auto"
    # Token chunks a layer's dispatch -> experts -> combine is split into by
    # EPDispatcher.run_experts, pipelined so that chunks' transfers run under other chunks'
    # expert GEMMs (moe_ep_transport.pipeline); 1: one dispatch and one combine, in order.
    # max_tokens bounds each chunk (a call), so a layer takes up to overlap_chunks * max_tokens.
    overlap_chunks: int = 1
    # SMs the pipeline's communication stream may use (a CUDA green context); None: every SM,
    # the stream at the highest priority. Only with overlap_chunks > 1.
    comm_sms: int | None = None
    # The rowwise transport's bulk moves by the GPU's copy engines (cudaMemcpyAsync into the
    # peers' slabs, no SM) instead of the put kernel's stores: the token inbox sends (every
    # source row to every other rank, needed there or not) and the partial sums summed at the
    # destination (RowwiseTransport). The slot metadata and this rank's own rows stay in the
    # kernel. On CPU the emulated peer memory moves the same blocks.
    copy_engine: bool = False

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "max_tokens", "d_model"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EPConfig.{name} must be positive, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ValueError(f"EPConfig.top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"EPConfig.capacity_factor must be positive or None, got {self.capacity_factor}")
        if self.overflow not in ("drop", "error"):
            raise ValueError(f"EPConfig.overflow must be 'drop' or 'error', got {self.overflow!r}")
        if self.overlap_chunks < 1:
            raise ValueError(f"EPConfig.overlap_chunks must be positive, got {self.overlap_chunks}")
        if self.comm_sms is not None and (self.comm_sms < 1 or self.overlap_chunks == 1):
            raise ValueError(
                f"EPConfig.comm_sms={self.comm_sms} bounds the pipeline's communication stream: "
                "a positive count, with overlap_chunks > 1"
            )
        if not isinstance(self.copy_engine, bool):
            raise ValueError(f"EPConfig.copy_engine must be a bool, got {self.copy_engine!r}")
        if self.combine not in ("auto", "source", "destination"):
            raise ValueError(
                f"EPConfig.combine must be 'auto', 'source' or 'destination', got {self.combine!r}"
            )

    @property
    def max_slots(self) -> int:
        """Routed (token, slot) rows one rank sends at most: T_max * k."""
        return self.max_tokens * self.top_k

    def local_experts(self, ep_size: int) -> int:
        if self.n_experts % ep_size:
            raise ValueError(
                f"EPConfig.n_experts={self.n_experts} is not divisible by the EP group size {ep_size}"
            )
        return self.n_experts // ep_size

    def rank_capacity(self, ep_size: int) -> int:
        """Rows one rank can receive per call (C).

        Balanced routing sends each rank T*k rows on average, so the factor is a
        head-room over the mean. Dropless sizes for the worst case: every rank's
        T*k rows landing on one rank.
        """
        worst = ep_size * self.max_slots
        if self.capacity_factor is None:
            return worst
        return min(worst, max(1, math.ceil(self.capacity_factor * self.max_slots)))

    def dispatch_layout(self, ep_size: int) -> DispatchLayout:
        """Where the rowwise dispatch lands the rows of other ranks, chosen by the EP group size.

        ``"token_inbox"``: a source stores each token once into every other rank holding
        any of its experts (row ``source * T_max + token`` of that rank's inbox) and the
        destination expands the tokens into their receive rows; it moves ``1/u`` of the
        bytes of one row per slot (``u`` experts of a token per rank: top-8 on two ranks
        about 4). The inbox is ``M * T_max`` rows whatever the routing: it grows with the
        group. ``"per_slot"``: one row per routed slot, stored at its receive row; the
        ``C`` rows of :meth:`rank_capacity`, which every layout needs anyway (the
        expanded receive rows).

        The token inbox is chosen while it fits in those ``C`` rows (``M * T_max <= C``:
        ``M <= cf * k`` with a capacity factor, every ``M`` dropless), so the layout never
        enlarges the symmetric buffers; a larger group sends one row per slot, and its
        buffers stay ``C`` rows per slab however many ranks join (an inbox would add
        ``M * T_max`` rows per slab, on every rank). Top-8 at factor 1.25 keeps the token
        inbox up to 10 ranks; there ``u`` is already 1.5 or less, so little is given up.
        """
        fits = ep_size * self.max_tokens <= self.rank_capacity(ep_size)
        return "token_inbox" if ep_size > 1 and fits else "per_slot"

    def sums_at_destination(self, ep_size: int, row_bytes: int, partial_bytes: int) -> bool:
        """Whether combine (and dispatch's backward) sum top-k contributions at the destinations.

        Summing at the source returns one row (``row_bytes``) per routed slot; summing
        at the destination returns one partial (``partial_bytes``, FP32) per token and
        rank holding any of its experts, but needs the weights there first (one more
        small send) and two more launches. Under uniform routing a token has
        ``u = k / (M * (1 - (1 - 1/M)^k))`` experts on each rank it reaches (top-8 on
        two ranks: 4; on eight: 1.5), so ``"auto"`` sums at the destination when its
        partials are less than 3/4 of the bytes of the rows they replace, and only with
        FP32 partials (``partial_bytes == 4 * d_model``: what the GPU kernels accumulate in;
        ``"destination"`` with wider partials runs on CPU and raises on the GPU transport).
        """
        if self.combine != "auto":
            return self.combine == "destination"
        if ep_size < 2 or partial_bytes != 4 * self.d_model:
            return False
        k, M = self.top_k, ep_size
        rows_per_rank = k / (M * (1.0 - (1.0 - 1.0 / M) ** k))
        return partial_bytes < 0.75 * rows_per_rank * row_bytes

    def copy_engine_moves(self, ep_size: int, row_bytes: int) -> bool:
        """Whether :attr:`copy_engine` moves anything on a group of ``ep_size`` ranks with rows
        of ``row_bytes``: the token inbox sends (:meth:`dispatch_layout`) or the FP32 partial
        sums of a combine summing at the destination (:meth:`sums_at_destination`), the two
        sends that are one contiguous block per destination rank."""
        return self.dispatch_layout(ep_size) == "token_inbox" or self.sums_at_destination(
            ep_size, row_bytes, 4 * self.d_model)
