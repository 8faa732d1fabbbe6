"""Process-group lifetime and device choice for one training process.

Every run, one process or many, trains inside a ``torch.distributed`` process
group, so the trainer has a single code path (groups of size 1 cost nothing).
The rank and world come from the launcher's environment (``torchrun`` sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
without them this is a one-process world on an in-memory store. A group that
already exists (a test harness made it) is joined and left alone.

When one rank of several dies (a crash, the out-of-memory killer, a lost host), its peers'
next collective fails with the communication backend's own error, a source location and a
socket address; a collective that waits out ``train.collective_timeout_s`` fails likewise.
``distributed`` turns both into a ``PeerFailure``: one line that says which it was (for a
lost peer, that the failed rank's own output says why). A rank that cannot join the group
at the start (its peers or the rendezvous address never answered within the timeout) fails
with a ``JoinFailure``, one line too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from pretrain.config_tree import ConfigError
from pretrain.errors import PretrainError

T = TypeVar("T")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE")  # set by torchrun (and by any launcher speaking env://)


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """``auto`` picks CUDA when present; a CUDA rank uses the GPU of its local rank."""
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


class PeerFailure(PretrainError):
    """A collective failed because another rank of the run died or stopped answering."""


class JoinFailure(PretrainError):
    """The launcher's ranks did not all join the process group within the timeout."""


# What gloo and NCCL say, lowercased, when a peer is gone or a collective waited too long.
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "remote process exited", "communicator was aborted")
# Gloo words a timeout either way: the operation that waited, or (for an asynchronous
# collective whose pair timed out first) "Application timeout caused pair closure".
_TIMED_OUT = ("timed out waiting", "application timeout caused pair closure",
              "watchdog caught collective operation timeout")
_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def peer_failure(error: BaseException, rank: int, world: int, timeout_s: float) -> PeerFailure | None:
    """The one-line account of ``error`` if it is a collective losing a peer or timing out
    on a world of several ranks; ``None`` for anything else (a bug keeps its traceback)."""
    if world < 2 or not isinstance(error, RuntimeError):
        return None
    lowered = str(error).lower()
    if any(s in lowered for s in _TIMED_OUT):
        what, after = (f"a collective waited longer than train.collective_timeout_s={timeout_s:g} s "
                       "for another rank, which failed, hung or is far behind"), ""
    elif any(s in lowered for s in _PEER_GONE):
        what, after = ("another rank failed or was stopped during a collective",
                       "; that rank's output says why")
    else:
        return None
    cause = _first_line(error).split(". This is typically")[0]
    return PeerFailure(f"rank {rank} of {world}: {what} ({cause}){after}")


def _first_line(error: BaseException) -> str:
    """The backend's message without its C++ source location or the lines after the first."""
    return _SOURCE_LOCATION.sub("", str(error).strip().splitlines()[0])


def _join_failure(error: BaseException, timeout_s: float) -> JoinFailure:
    """One line for a rendezvous or connection that failed while the group formed."""
    rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return JoinFailure(f"rank {rank} of {world}: the ranks did not all join the process group at "
                       f"{address} within train.collective_timeout_s={timeout_s:g} s "
                       f"({_first_line(error)}); "
                       "start every rank, with the same MASTER_ADDR and MASTER_PORT")


@contextmanager
def distributed(device_preference: str, timeout_s: float = 600.0) -> Iterator[Runtime]:
    """Join or create the default process group for the run; destroy what was created.

    ``timeout_s`` (``train.collective_timeout_s``): how long a collective waits for a peer
    before it fails (a dead or hung rank), in a process group this creates."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if any(v in os.environ for v in _LAUNCHER_VARS):  # env:// names any missing variable
            try:
                dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
            except RuntimeError as e:  # torch.distributed.DistError (store, network) is one
                raise _join_failure(e, timeout_s) from e
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s), **kwargs)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        yield Runtime(rank, world, local_rank, device)
    except RuntimeError as e:
        failure = peer_failure(e, rank, world, timeout_s)
        if failure is None:
            raise
        raise failure from e
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def decided_on_rank_0(action: Callable[[], T]) -> T | None:
    """``action()`` on rank 0 (its result there, ``None`` elsewhere); a ``PretrainError`` it
    raises is raised on every rank, with the same message and exit status (collective)."""
    result, failure = None, None
    if dist.get_rank() == 0:
        try:
            result = action()
        except PretrainError as e:
            failure = e
    box = [None if failure is None else (str(failure), failure.exit_status)]
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    if box[0] is not None:
        error = PretrainError(box[0][0])
        error.exit_status = box[0][1]
        raise error
    return result
