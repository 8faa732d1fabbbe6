"""One writer per directory: an exclusive ``fcntl.flock`` on a lock file inside it.

The file names its holder (PID, host, start time) so that a refused writer can say who
holds it. The operating system releases the lock when the holding process ends,
however it ends (SIGKILL, a lost machine's lease); a clean release also empties the
file, so a file that still names a process when the lock is taken was left by a writer
that did not end cleanly: ``DirectoryLock.acquire`` returns that description for the
caller to report, and takes the lock over. ``flock`` excludes writers on other hosts
only where the shared file system supports it (NFSv4, Lustre mounted with ``flock``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from moe_ckpt.errors import CheckpointError


class DirectoryLockedError(CheckpointError):
    """Another process holds the lock; ``holder`` (and the message) name it."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(f"{directory} is in use by {holder}")
        self.holder = holder


def _describe(text: str) -> str:
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on host {who['host']} (since {who['since']})"
    except (ValueError, KeyError, TypeError):
        return "an unknown process"


def _still_running(text: str) -> str:
    """Whether the process named by a lock file left behind still runs, in words."""
    try:
        who = json.loads(text)
        if who["host"] != socket.gethostname():
            return "on another host"
        os.kill(int(who["pid"]), 0)
    except (ValueError, KeyError, TypeError, OverflowError):
        return "unknown"
    except ProcessLookupError:
        return "no longer running"
    except PermissionError:
        pass  # it runs, as another user
    return "running, without the lock"


class DirectoryLock:
    """``path``: the lock file (created if absent; its directory must exist)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None

    def acquire(self) -> str | None:
        """Take the lock, or raise ``DirectoryLockedError`` naming the holder (``OSError`` if
        the file cannot be opened). Returns the description of a holder that did not end
        cleanly (its lock is now this one's), or ``None``."""
        lock = open(self.path, "a+")  # noqa: SIM115 (held until release)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = _describe(lock.read())
            lock.close()
            raise DirectoryLockedError(self.path.parent, holder) from None
        lock.seek(0)
        left = lock.read().strip()
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                               "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
        lock.flush()
        self._file = lock
        return f"{_describe(left)}, {_still_running(left)}" if left else None

    def release(self) -> None:
        """Empty the file (a clean end) while holding it, then unlock; no-op if not held."""
        lock, self._file = self._file, None
        if lock is None:
            return
        try:
            lock.truncate(0)
            lock.flush()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()
