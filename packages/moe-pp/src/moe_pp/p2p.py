"""Point-to-point transfers between stages, in one order every rank agrees on.

Why an order: NCCL runs the sends and receives between two ranks on one stream
(or, with an eagerly initialised group, all of a rank's point-to-point
operations), first in, first out. If rank A posts "send x, receive y" while rank
B posts "send y, receive x", each send waits for a receive queued behind the
other's send: a deadlock that gloo, with its tags, never shows on CPU.

The fix is to issue every rank's operations in one global order: the order of
the messages' send times in the schedule's simulated timeline (ties broken by
sender rank, kind, stage and microbatch). A rank issues its operations lazily in
that order: a receive is posted (not waited for) when an operation after it is
needed, a send as soon as its tensor exists. Because the simulation is a valid
execution of the same per-rank programs, every operation a rank waits for has
all the operations before it, on both sides, already issued, so it completes.
The message's position in the order is also its tag, for backends that match
on tags.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_pp.schedules import Timeline

ACTIVATION = "activation"  # stage s -> s + 1, after F
GRADIENT = "gradient"  # stage s -> s - 1, after B


@dataclass(frozen=True)
class Message:
    kind: str  # ACTIVATION or GRADIENT
    src_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int
    tag: int  # position in the global order

    @property
    def key(self) -> tuple[str, int, int]:
        return self.kind, self.src_stage, self.microbatch


def message_order(timeline: Timeline) -> list[Message]:
    """Every inter-stage message of the schedule, in the order all ranks issue them."""
    schedule = timeline.schedule
    last = schedule.n_stages - 1
    sends = []
    for rank_actions in timeline.ranks:
        for t in rank_actions:
            a = t.action
            if a.kind == "F" and a.stage < last:
                kind, dst = ACTIVATION, a.stage + 1
            elif a.kind == "B" and a.stage > 0:
                kind, dst = GRADIENT, a.stage - 1
            else:
                continue
            sends.append((t.end, t.rank, kind, a.stage, a.microbatch, schedule.rank_of(dst)))
    sends.sort()
    return [
        Message(kind, stage, mb, src, dst, tag)
        for tag, (_, src, kind, stage, mb, dst) in enumerate(sends)
    ]


class OrderedP2P:
    """One rank's side of the schedule's messages for one step.

    Every message carries a tensor of ``shape`` and ``dtype`` (activations and
    their gradients have the same).
    """

    def __init__(
        self,
        messages: list[Message],
        rank: int,
        group: dist.ProcessGroup | None,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._ops = [m for m in messages if rank in (m.src_rank, m.dst_rank)]
        self._position = {m.key: i for i, m in enumerate(self._ops)}
        self._rank = rank
        self._group = group
        self._shape, self._dtype, self._device = tuple(shape), dtype, device
        self._next = 0
        self._outbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._inbox: dict[tuple[str, int, int], tuple[torch.Tensor, dist.Work]] = {}
        self._sending: list[tuple[torch.Tensor, dist.Work]] = []

    def _peer(self, pp_rank: int) -> int:
        return dist.get_global_rank(self._group, pp_rank) if self._group is not None else pp_rank

    def _issue_through(self, key: tuple[str, int, int]) -> None:
        position = self._position.get(key)
        if position is None:
            raise RuntimeError(f"message {key} is not in this rank's schedule")
        while self._next <= position:
            m = self._ops[self._next]
            if m.src_rank == self._rank:
                tensor = self._outbox.pop(m.key, None)
                if tensor is None:
                    raise RuntimeError(
                        f"message {m.key} must be sent before {key}, but its tensor does not "
                        "exist yet: the runtime and the schedule's timeline disagree"
                    )
                work = dist.isend(tensor, dst=self._peer(m.dst_rank), group=self._group, tag=m.tag)
                # Keep a sent tensor only until its send completes (a non-blocking query),
                # not for the whole step.
                self._sending = [(t, w) for t, w in self._sending if not w.is_completed()]
                self._sending.append((tensor, work))
            else:
                buffer = torch.empty(self._shape, dtype=self._dtype, device=self._device)
                work = dist.irecv(buffer, src=self._peer(m.src_rank), group=self._group, tag=m.tag)
                self._inbox[m.key] = (buffer, work)
            self._next += 1

    def send(self, key: tuple[str, int, int], tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self._shape or tensor.dtype != self._dtype:
            kind, stage, mb = key
            raise ValueError(
                f"stage {stage} microbatch {mb}: the {kind} to send has shape "
                f"{tuple(tensor.shape)} and dtype {tensor.dtype}; the pipeline was built for "
                f"activation_shape={self._shape}, activation_dtype={self._dtype}"
            )
        self._outbox[key] = tensor.detach().contiguous()
        self._issue_through(key)

    def recv(self, key: tuple[str, int, int]) -> torch.Tensor:
        self._issue_through(key)
        buffer, work = self._inbox.pop(key)
        work.wait()
        return buffer

    def finish(self) -> None:
        """Wait for this step's sends; every message must have been handled."""
        if self._next != len(self._ops) or self._outbox or self._inbox:
            raise RuntimeError(
                f"pipeline step ended with {len(self._ops) - self._next} messages not issued, "
                f"{len(self._outbox)} unsent and {len(self._inbox)} unreceived"
            )
        for _, work in self._sending:
            work.wait()
        self._sending.clear()
