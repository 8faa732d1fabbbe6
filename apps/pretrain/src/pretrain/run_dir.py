"""The run directory: chosen once for every rank, created only after the run was checked, and
written by one run at a time.

``choose_run_dir`` settles the path (``run_dir``, or a new timestamped folder chosen by rank 0)
without creating anything, so a config, layout or data error leaves no empty folder behind.
``held_run_dir`` then creates it and takes ``run_dir/run.lock`` (``moe_ckpt.lock``: an
exclusive ``fcntl.flock``) on rank 0, the rank that commits checkpoints, until the run
ends. A second run on the same directory would rewrite ``metrics.jsonl`` under the first
and collide with its checkpoints; it is refused in one line naming the holder's PID and
host. A lock left by a run that did not end cleanly (killed, its machine lost) is
reported and taken over.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import torch.distributed as dist
from moe_ckpt.lock import DirectoryLock, DirectoryLockedError

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


def _lock(path: Path) -> DirectoryLock:
    """Create ``path`` (the run directory) and take its lock."""
    lock = DirectoryLock(path / LOCK_FILE)
    try:
        path.mkdir(parents=True, exist_ok=True)
        left = lock.acquire()
    except DirectoryLockedError as e:
        raise RunDirBusy(f"run_dir={str(path)!r} is in use by another run: "
                         f"{e.holder}; wait for it to end or "
                         "choose another run_dir") from None
    except OSError as e:
        raise PretrainError(f"run_dir={str(path)!r} cannot be written: {e.strerror} "
                            f"({e.filename})") from None
    if left is not None:
        print(f"warning: run_dir {path}: taking over the lock of a run that did not end "
              f"cleanly: {left}", file=sys.stderr, flush=True)
    return lock


@contextmanager
def held_run_dir(path: Path) -> Iterator[Path]:
    """Create ``path`` and hold its lock (rank 0) for the block (collective: every rank
    raises if rank 0 could not take it)."""
    lock = decided_on_rank_0(lambda: _lock(path))
    try:
        yield path
    finally:
        if lock is not None:
            lock.release()
