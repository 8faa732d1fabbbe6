"""The run directory: chosen once for every rank, created only after the run was checked, and
written by one run at a time.

``choose_run_dir`` settles the path (``run_dir``, or a new timestamped folder chosen by rank 0)
without creating anything, so a config, layout or data error leaves no empty folder behind.
``held_run_dir`` then creates it and takes ``run_dir/run.lock``: an exclusive
``fcntl.flock`` held by rank 0 (the rank that commits checkpoints) until the run ends. A
second run on the same directory would rewrite ``metrics.jsonl`` under the first and
collide with its checkpoints; it is refused in one line naming the holder's PID and host,
which the lock file records. The operating system releases the lock when its process dies
however it dies, so a lock file that still names a process when the lock is taken was left
by a run that did not end cleanly (killed, or its machine lost): that is reported and the
lock taken over. ``flock`` is exclusive between the hosts of a shared file system only where
that file system supports it (NFSv4 and Lustre with ``flock`` mounts do; check yours).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO

import torch.distributed as dist

from pretrain.config import ConfigError, PretrainConfig
from pretrain.errors import PretrainError
from pretrain.runtime import decided_on_rank_0

LOCK_FILE = "run.lock"


class RunDirBusy(PretrainError):
    """Another run holds the run directory."""


def choose_run_dir(cfg: PretrainConfig) -> Path:
    """``run_dir``, or a new timestamped folder chosen by rank 0 and broadcast (not created)."""
    choice = [cfg.run_dir or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    path = Path(cfg.run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir={cfg.run_dir!r} is a file, not a directory")
    return path


def _holder(text: str) -> str:
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']} (since {who['since']})"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


def _is_running(text: str) -> bool | None:
    """Whether the process the lock file names still runs; ``None`` on another host."""
    try:
        who = json.loads(text)
        if who["host"] != socket.gethostname():
            return None
        os.kill(int(who["pid"]), 0)
    except (ValueError, KeyError, TypeError):
        return None
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def _lock(path: Path) -> IO[str]:
    """Create ``path`` (the run directory) and take its lock; the open lock file."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        lock = open(path / LOCK_FILE, "a+")  # noqa: SIM115 (held for the run, closed by _unlock)
    except OSError as e:
        raise PretrainError(f"run_dir={str(path)!r} cannot be written: {e.strerror} "
                            f"({e.filename})") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = _holder(lock.read())
        lock.close()
        raise RunDirBusy(f"run_dir={str(path)!r} is in use by another run: {holder}; "
                         "wait for it to end or choose another run_dir") from None
    lock.seek(0)
    left = lock.read().strip()
    if left:
        alive = _is_running(left)
        state = "no longer running" if alive is False else \
            "still running but not holding it" if alive else "on another host"
        print(f"warning: run_dir {path}: taking over the lock of a run that did not end cleanly: "
              f"{_holder(left)}, {state}", file=sys.stderr, flush=True)
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    lock.flush()
    return lock


def _unlock(lock: IO[str]) -> None:
    """Empty the lock file (a clean end) while holding it, then release it."""
    lock.truncate(0)
    lock.flush()
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()


@contextmanager
def held_run_dir(path: Path) -> Iterator[Path]:
    """Create ``path`` and hold its lock (rank 0) for the block (collective: every rank
    raises if rank 0 could not take it)."""
    lock = decided_on_rank_0(lambda: _lock(path))
    try:
        yield path
    finally:
        if lock is not None:
            _unlock(lock)
