"""Checkpointer: step directories under one root, ``latest``, retention, async saves.

One writer per root: rank 0 holds ``root/writer.lock`` (``moe_ckpt.lock``) from
construction to ``close``, and a second ``Checkpointer`` on the root raises
``DirectoryLockedError`` naming the holder (readers that only load use ``load`` or
``read_tensors``, which take no lock). A step directory without its manifest (a
checkpoint damaged or copied half) is renamed ``step_N.uncommitted-<id>`` at
construction and listed in ``set_aside``: it is never loaded, and a save of that
step does not collide with it.

What the training loop sees: ``save(step, tensors, metadata)`` returns once this
rank's data is in host memory; the write and the commit run in one background
thread; the next ``save``, ``load``, ``wait`` or ``close`` waits for them and
raises a background failure as ``CheckpointError`` (``PostCommitError`` when the
checkpoint was committed and only the ``latest`` pointer update or retention after
it failed).

Collectives and threads (why this cannot deadlock with training):

- The constructor creates a gloo process group used only by this checkpointer
  (every rank must construct it at the same point: ``new_group`` is collective).
  Training collectives run on other groups (NCCL or gloo) and are never ordered
  against this one.
- Saves are strictly sequential: a save first waits for the previous one. So at
  any time at most one thread per rank uses the group, and every rank issues its
  collectives in the same order: the calling thread's one all-gather in
  ``save``/``load`` happens only while no background save runs, the background
  thread's broadcast/gather/broadcast only while the calling thread does not
  touch the group.
- A rank that fails still takes part in each collective (an error slot), so all
  ranks fail together; a rank that dies makes the others' background thread fail
  after the group timeout, and the error surfaces on their next call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe_ckpt import directory
from moe_ckpt.comm import Collectives, GroupCollectives, SingleProcess
from moe_ckpt.errors import CheckpointError, IncompleteCheckpointError, PostCommitError
from moe_ckpt.host import HostBuffers
from moe_ckpt.load import load
from moe_ckpt.lock import DirectoryLock
from moe_ckpt.manifest import Manifest
from moe_ckpt.save import PhaseHook, prepare_save, write_and_commit
from moe_ckpt.storage import StorageOptions
from moe_ckpt.tree import StateTree


@dataclass(frozen=True)
class CheckpointerConfig:
    keep_last: int | None = 3  # committed checkpoints kept; None keeps all
    async_save: bool = True  # snapshot to host, then write in a background thread
    storage: StorageOptions = field(default_factory=StorageOptions)
    timeout_s: float = 1800.0  # timeout of the checkpointer's own gloo group

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(
                f"CheckpointerConfig.keep_last must be >= 1 or None, got {self.keep_last}"
            )


class Checkpointer:
    """Saves and loads step checkpoints under ``root``; see the module notes."""

    def __init__(
        self,
        root: str | os.PathLike,
        config: CheckpointerConfig = CheckpointerConfig(),
        *,
        on_phase: PhaseHook | None = None,
    ) -> None:
        self.root = Path(root).absolute()
        self.config = config
        self._on_phase = on_phase
        self._group: dist.ProcessGroup | None = None
        self._comm: Collectives = SingleProcess()
        if dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=config.timeout_s)
            )
            self._comm = GroupCollectives(self._group)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-ckpt-writer")
        self._pending: tuple[int, Future] | None = None
        self._buffers = HostBuffers()
        self._lock = DirectoryLock(self.root / directory.LOCK_NAME)
        self.stale_lock: str | None = None  # rank 0: a lock left by a writer that was killed
        self.set_aside: list[tuple[Path, Path]] = []  # rank 0: step dirs without a manifest
        self._open_root()

    def _open_root(self) -> None:
        """Rank 0 creates the root, takes its writer lock and sets aside uncommitted step
        directories (a save would collide with one, a load skip it); all ranks raise if it
        could not (collective)."""
        error: BaseException | None = None
        if self._comm.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.stale_lock = self._lock.acquire()
                self.set_aside = directory.set_aside_uncommitted(self.root)
            except (OSError, CheckpointError) as e:
                error = e
        failure = self._comm.broadcast(None if error is None else str(error))
        if failure is not None:
            self.close()
            if error is not None:
                raise error
            raise CheckpointError(f"opening {self.root} failed on rank 0: {failure}")

    def save(
        self,
        step: int,
        tensors: Mapping[str, StateTree],
        metadata: Mapping[str, Any] | None = None,
        *,
        rank_metadata: Any = None,
        blocking: bool | None = None,
        keep: Iterable[int] = (),
    ) -> None:
        """Checkpoint ``tensors`` as step ``step`` (collective over all ranks).

        Returns after the host snapshot when asynchronous (``blocking`` defaults to
        ``not config.async_save``); the tensors may then change freely. ``keep``: steps
        that this save's retention leaves in place beyond ``keep_last`` (the last
        checkpoint known to be good, say).
        """
        self.wait()
        blocking = (not self.config.async_save) if blocking is None else blocking
        pending = prepare_save(
            self.root / directory.step_dir_name(step),
            tensors,
            metadata,
            comm=self._comm,
            step=step,
            rank_metadata=rank_metadata,
            options=self.config.storage,
            buffers=None if blocking else self._buffers,
            on_phase=self._on_phase,
        )
        after_commit = functools.partial(self._after_commit, keep=tuple(keep))
        if blocking:
            write_and_commit(pending, after_commit)
        else:
            self._pending = (
                step,
                self._executor.submit(write_and_commit, pending, after_commit),
            )

    def _after_commit(self, final: Path, keep: tuple[int, ...] = ()) -> None:
        """On rank 0, after the commit rename and before any rank's save returns.

        A failure here leaves ``final`` committed (``PostCommitError``); the next
        successful save redoes the pointer, retention and cleanup.
        """
        directory.write_latest(self.root, final)
        self._notify("latest_updated")
        if self.config.keep_last is not None:
            protect = [final, *(self.root / directory.step_dir_name(k) for k in keep)]
            directory.retain(self.root, self.config.keep_last, protect=protect)
        directory.clean_transient(self.root)
        self._notify("retained")

    def _notify(self, phase: str) -> None:
        if self._on_phase is not None:
            self._on_phase(phase)

    def wait(self) -> None:
        """Wait for the pending asynchronous save; raise its error if it failed.

        ``PostCommitError`` means the checkpoint is committed and only the pointer
        update or retention after it failed; anything else, as ``CheckpointError``,
        means nothing was committed.
        """
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except PostCommitError:
            raise  # the checkpoint is committed; the message names it
        except Exception as e:
            raise CheckpointError(
                f"asynchronous save of step {step} under {self.root} failed: {e}"
            ) from e

    def steps(self) -> list[int]:
        """Committed steps under the root, ascending."""
        return sorted(directory.committed_steps(self.root))

    def latest_step(self) -> int | None:
        """The newest committed step (what ``load`` resumes from), or None."""
        path = directory.latest(self.root)
        return None if path is None else int(path.name.split("_")[1])

    def load(
        self, targets: Mapping[str, StateTree], step: int | None = None
    ) -> Manifest:
        """Load ``step`` (default: the newest committed checkpoint) into ``targets``.

        Rank 0 resolves the directory and tells the others, so all ranks read the
        same checkpoint even while the filesystem view differs between hosts.
        """
        self.wait()
        name = None
        if self._comm.rank == 0:
            path = (
                directory.latest(self.root)
                if step is None
                else self.root / directory.step_dir_name(step)
            )
            name = path.name if path is not None else None
        name = self._comm.broadcast(name)
        if name is None:
            raise IncompleteCheckpointError(f"no committed checkpoint under {self.root}")
        return load(self.root / name, targets)

    def close(self) -> None:
        """Wait for the pending save (raising its error), then release the thread and group."""
        try:
            self.wait()
        finally:
            self._lock.release()
            self._executor.shutdown(wait=True)
            if self._group is not None and dist.is_initialized():
                dist.destroy_process_group(self._group)
                self._group = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
