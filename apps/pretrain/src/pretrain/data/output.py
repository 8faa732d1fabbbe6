"""The output directory of one ``prepare-data`` run: claimed, recorded, committed or removed.

While a run writes, ``prepare-data.unfinished`` in the directory records the process
(pid, host) and every file the run has created, each added before the file exists.
The run ends in one of two ways:

- committed: the sidecar is in place, then the marker is removed;
- failed or stopped (an error, SIGTERM, Ctrl-C): every recorded file, the marker and
  the directories the run created are removed; nothing else is touched.

A run killed outright (SIGKILL, a power cut) leaves the marker behind: the directory
is then refused as data, and the next ``prepare-data`` into it recognises the marker,
removes the files it lists and starts again, unless the recorded process is still
alive on this host (two runs into one directory: the second is refused).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from pretrain.data.files import (
    DOCUMENTS_FILE,
    SIDECAR,
    TOKENIZER_FILE,
    UNFINISHED_MARKER,
    DataError,
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class OutputDir:
    """``--out`` for one run (module docstring). Use ``create`` for each file, ``commit``
    at the end, ``discard`` on any failure."""

    def __init__(self, path: Path) -> None:
        if path.exists() and not path.is_dir():
            raise DataError(f"--out {str(path)!r} is not a directory")
        self.path = path
        self.marker = path / UNFINISHED_MARKER
        self.replaced: str | None = None  # what an earlier unfinished run left, if replaced
        if self.marker.exists():
            self.replaced = self._replace_unfinished()
        if path.is_dir() and ((path / SIDECAR).exists() or (path / DOCUMENTS_FILE).exists()
                              or any(path.glob("*.bin"))):
            raise DataError(f"{path} already holds token files; choose an empty --out directory")
        self._created_dirs = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        self.files: list[str] = []
        self._record = {"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": self.files}
        self._write_marker()

    def _replace_unfinished(self) -> str:
        try:
            record = json.loads(self.marker.read_text())
            files, pid, host = record["files"], int(record["pid"]), str(record["host"])
            if not all(isinstance(f, str) and Path(f).name == f and f not in ("", ".", "..")
                       for f in files):
                raise ValueError("a file name with a path")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{self.marker}: not the record of a prepare-data run ({e}); remove "
                            "the directory's unfinished output by hand") from None
        if host == socket.gethostname() and pid != os.getpid() and _alive(pid):
            raise DataError(f"{self.path} is being written by prepare-data process {pid} (started "
                            f"{record.get('started', '?')}); wait for it, or stop it and run again")
        for name in files:
            (self.path / name).unlink(missing_ok=True)
        self.marker.unlink()
        return f"process {pid} on {host}, started {record.get('started', '?')}"

    def _write_marker(self) -> None:
        tmp = self.path / (UNFINISHED_MARKER + ".tmp")
        tmp.write_text(json.dumps(self._record) + "\n")
        tmp.replace(self.marker)

    def create(self, name: str) -> Path:
        """Record ``name`` as this run's (before it exists); its path."""
        if name not in self.files:
            self.files.append(name)
            self._write_marker()
        return self.path / name

    def keep_tokenizer(self, tokenizer: Path) -> tuple[Path, bytes]:
        """The tokenizer copy's path and the tokenizer's bytes; refuses another tokenizer's
        copy, writes none over an identical one (a user's file stays theirs)."""
        data = tokenizer.read_bytes()
        copy = self.path / TOKENIZER_FILE
        if copy.exists():
            if copy.read_bytes() != data:
                raise DataError(f"{copy} exists and is not {tokenizer}; choose an empty --out directory")
            return copy, data
        self.create(TOKENIZER_FILE).write_bytes(data)
        return copy, data

    def commit(self, sidecar: dict[str, Any]) -> None:
        """Write ``tokens.json`` (atomically), then drop the marker: the directory is data."""
        from pretrain.data.files import write_sidecar

        self.create(SIDECAR + ".tmp")
        self.create(SIDECAR)
        write_sidecar(self.path, sidecar)
        self.marker.unlink()

    def discard(self) -> None:
        """Remove everything this run created (best effort: a cleanup error is reported, not
        raised over the error that caused it)."""
        try:
            for name in self.files:
                (self.path / name).unlink(missing_ok=True)
            for name in (UNFINISHED_MARKER + ".tmp", UNFINISHED_MARKER):
                (self.path / name).unlink(missing_ok=True)
            for directory in self._created_dirs:  # innermost first; only what this run created
                if directory.exists() and not any(directory.iterdir()):
                    directory.rmdir()
        except OSError as e:
            print(f"warning: could not remove all of the unfinished output in {self.path}: {e}",
                  file=sys.stderr, flush=True)
