"""Checkpoint directories on a POSIX filesystem: commit, ``latest``, retention.

Layout of a checkpoint root::

    step_0000001000/               committed: renamed into place, manifest inside
    .step_0000002000.partial-<id>/ being written, or left by a crash: never loaded
    .step_0000000500.deleting-<id>/ being deleted by retention
    step_0000000500.uncommitted-<id>/ a step directory found without its manifest, set aside
    latest                         name of the last committed checkpoint, for other readers
    writer.lock                    held by the one process that writes here (moe_ckpt.lock)

Why this way: ``rename(2)`` of a directory is atomic on one filesystem, so a
checkpoint appears under its final name complete or not at all; the step-named
partial is unique per attempt (``<id>``), so a stale writer from a crashed job
cannot mix its files into a new attempt. Retention renames a checkpoint out of
the way before deleting it, so a crash mid-delete never leaves a half-deleted
directory under a committed name.

The checkpoint to resume from is the newest committed step, found by listing:
the commit rename is the one atomic event, so a crash between it and the
``latest`` update loses nothing, and the resumed run saves its next step instead
of colliding with a committed step the pointer missed. ``latest`` (replaced
atomically: temp file + ``os.replace``, after each commit) is only a convenience
for readers that do not list the root (a shell, an evaluation job); it may lag
one checkpoint behind after such a crash, until the next commit. Rolling a run
back therefore means removing the newer step directories (which the rolled-back
run could not save again anyway), not pointing ``latest`` at an older one.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from moe_ckpt.manifest import MANIFEST_NAME, fsync_dir

LATEST_NAME = "latest"
LOCK_NAME = "writer.lock"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TRANSIENT_RE = re.compile(r"^\..+\.(partial|deleting|tmp)-[0-9a-f]+$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:010d}"


def partial_path(final: Path) -> Path:
    """A fresh temporary sibling of ``final``, hidden and never mistaken for a checkpoint."""
    return final.with_name(f".{final.name}.partial-{uuid.uuid4().hex}")


def is_partial_name(name: str) -> bool:
    return bool(_TRANSIENT_RE.match(name))


def is_committed(path: Path) -> bool:
    return not is_partial_name(path.name) and (path / MANIFEST_NAME).is_file()


def commit(partial: Path, final: Path) -> None:
    """Make a fully written partial directory visible under its final name."""
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    os.rename(partial, final)
    fsync_dir(final.parent)


def committed_steps(root: Path) -> dict[int, Path]:
    """Committed checkpoints under ``root`` by step."""
    out: dict[int, Path] = {}
    if not root.is_dir():
        return out
    for entry in root.iterdir():
        m = _STEP_RE.match(entry.name)
        if m and is_committed(entry):
            out[int(m.group(1))] = entry
    return out


def set_aside_uncommitted(root: Path) -> list[tuple[Path, Path]]:
    """Rename step directories without a manifest out of the way; (old, new) paths.

    A commit renames a directory into place with its manifest inside, so such a
    directory was never committed by this format: damaged, copied in half, or its
    manifest removed. It is kept (for whoever wants to look at it) under a name that
    is neither a step nor transient.
    """
    moved = []
    if not root.is_dir():
        return moved
    for entry in sorted(root.iterdir()):
        if _STEP_RE.match(entry.name) and entry.is_dir() and not is_committed(entry):
            aside = entry.with_name(f"{entry.name}.uncommitted-{uuid.uuid4().hex[:8]}")
            os.rename(entry, aside)
            moved.append((entry, aside))
    if moved:
        fsync_dir(root)
    return moved


def write_latest(root: Path, final: Path) -> None:
    """Point ``latest`` at ``final`` for readers that do not list the root."""
    tmp = root / f".{LATEST_NAME}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_NAME)
    fsync_dir(root)


def latest(root: Path) -> Path | None:
    """The checkpoint to resume from: the newest committed step (the pointer is not read)."""
    steps = committed_steps(root)
    return steps[max(steps)] if steps else None


def _remove(path: Path) -> None:
    """Rename out of the way first, then delete: never a half-deleted committed name."""
    doomed = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def retain(root: Path, keep_last: int, protect: Path | Iterable[Path]) -> list[Path]:
    """Delete committed checkpoints beyond the ``keep_last`` highest steps.

    ``protect`` (the checkpoint just committed, and any others the caller names) is
    never deleted, whatever its step. Returns the deleted paths.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    keep = {p.resolve() for p in ([protect] if isinstance(protect, Path) else protect)}
    steps = committed_steps(root)
    removed = []
    for step in sorted(steps)[:-keep_last]:
        path = steps[step]
        if path.resolve() not in keep:
            _remove(path)
            removed.append(path)
    return removed


def clean_transient(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete partial and half-deleted directories and temp files left by crashes.

    Only safe when no other save is writing under ``root``: the caller runs it on
    the committing rank of the one job that owns the root.
    """
    removed = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        if is_partial_name(entry.name) and entry != keep:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
