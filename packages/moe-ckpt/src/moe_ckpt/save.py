"""Saving a checkpoint: plan and snapshot, then write and commit.

Two halves, so that ``Checkpointer`` can run the second in a background thread:

1. ``prepare_save`` (calling thread): validate the shards, gather every rank's
   shard metadata (one small all-gather), compute the same plan on every rank,
   and take host copies of the boxes this rank writes (or plain views for a
   blocking save).
2. ``write_and_commit``: rank 0 creates the partial directory (and the shared
   arrays of the ``file`` layout); each rank writes its boxes and checksums its
   pieces; rank 0 gathers the piece
   records, writes the manifest, renames the directory into place, then runs the
   caller's ``after_commit`` (``latest`` pointer, retention) before telling the
   others the outcome. A checkpoint is thus visible only after every rank's data
   is durably written (tensorstore fsyncs files by default).

Every collective carries an error slot: a rank that fails keeps taking part and
all ranks raise together. A failure before the commit rename commits nothing; one
after it (the ``committed`` hook, ``after_commit``) leaves the checkpoint committed
and raises ``PostCommitError`` on every rank, so no caller mistakes it for a lost
checkpoint.

``on_phase`` is called with the name of each phase reached on this rank:
``planned``, ``created``, ``wrote:<tensor>`` (per tensor), ``written``, and on
rank 0 ``manifest_written`` and ``committed``. It serves progress logging and
fault-injection tests (a test kills the process at a chosen phase).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moe_ckpt import storage
from moe_ckpt.boxes import Box
from moe_ckpt.comm import Collectives, collectives_for
from moe_ckpt.directory import commit, is_committed, partial_path
from moe_ckpt.dtypes import itemsize
from moe_ckpt.errors import CheckpointError, PostCommitError
from moe_ckpt.host import HostBuffers, crc32, host_views
from moe_ckpt.manifest import Manifest, PieceRecord, TensorRecord, json_snapshot, write_manifest
from moe_ckpt.plan import TensorPlan, Write, pieces, plan_tensor
from moe_ckpt.shards import Described, describe_all
from moe_ckpt.storage import StorageOptions, array_key
from moe_ckpt.tree import StateTree, flatten

PhaseHook = Callable[[str], None]


@dataclass
class PendingSave:
    """A planned save: this rank's boxes as host arrays (copies for an asynchronous
    save, views of CPU tensors for a blocking one), or the error that prevented it."""

    comm: Collectives
    final: Path
    step: int | None
    options: StorageOptions
    plans: dict[str, TensorPlan]
    layouts: dict[str, tuple[dict, ...]]
    my_writes: list[tuple[str, Box, np.ndarray]]
    metadata: dict[str, Any]
    rank_metadata: list[Any]
    on_phase: PhaseHook | None
    values: dict[str, Any]
    error: BaseException | None = None


def _notify(hook: PhaseHook | None, phase: str) -> None:
    if hook is not None:
        hook(phase)


def _raise_if_any(errors: list[str | None], local: BaseException | None, what: str) -> None:
    """Raise on every rank if any rank failed; the failing rank re-raises its own error."""
    failed = [e for e in errors if e]
    if local is not None:
        raise local
    if failed:
        raise CheckpointError(f"{what} failed on another rank: {failed[0]}")


def _gathered_plans(
    gathered: list[dict[str, tuple]], options: StorageOptions
) -> tuple[dict[str, TensorPlan], dict[str, tuple[dict, ...]]]:
    """One plan per tensor from every rank's (shape, dtype, layout record, boxes)."""
    first: dict[str, tuple[int, tuple, str]] = {}
    held: dict[str, list[Write]] = {}
    layouts: dict[str, list[dict]] = {}
    for rank, tensors in enumerate(gathered):
        for name, (shape, dtype, layout, boxes) in tensors.items():
            if name not in first:
                first[name] = (rank, shape, dtype)
                held[name], layouts[name] = [], []
            r0, shape0, dtype0 = first[name]
            if (shape, dtype) != (shape0, dtype0):
                raise ValueError(
                    f"tensor {name!r}: rank {r0} holds it as {dtype0} of global shape "
                    f"{shape0} but rank {rank} as {dtype} of global shape {shape}"
                )
            held[name] += [Write(rank, b) for b in boxes]
            layouts[name].append(layout)
    plans = {
        name: plan_tensor(
            name,
            shape,
            dtype,
            itemsize(dtype),
            held[name],
            options.target_chunk_bytes,
            options.min_chunk_bytes,
        )
        for name, (_, shape, dtype) in first.items()
    }
    return plans, {name: tuple(v) for name, v in layouts.items()}


def prepare_save(
    final: Path,
    tensors: Mapping[str, StateTree],
    metadata: Mapping[str, Any] | None,
    *,
    comm: Collectives,
    step: int | None,
    rank_metadata: Any,
    options: StorageOptions,
    buffers: HostBuffers | None,
    on_phase: PhaseHook | None,
) -> PendingSave:
    """Validate, plan (one all-gather) and take this rank's host data."""
    final = Path(final).absolute()
    local_error: BaseException | None = None
    payload: dict[str, tuple] = {}
    described: dict[str, Described] = {}
    values: dict[str, Any] = {}
    try:
        tensors, values = flatten(tensors)
        values = json_snapshot(values, "values")
        metadata = json_snapshot(dict(metadata or {}), "metadata")
        rank_metadata = json_snapshot(rank_metadata, "rank_metadata")
        if comm.rank == 0 and final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        described = describe_all(tensors, comm.rank)
        for name, d in described.items():
            array_key(name, options.kvstore)
            payload[name] = (d.global_shape, d.dtype, d.held.to_json(), [r.box for r in d.regions])
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised here
        local_error = e
    settings = (str(final), options)
    gathered = comm.all_gather((_error_text(comm, local_error), payload, rank_metadata, settings))
    _raise_if_any([g[0] for g in gathered], local_error, "save planning")
    for rank, g in enumerate(gathered):
        if g[3] != gathered[0][3]:
            raise ValueError(
                f"save: rank {rank} saves to {g[3][0]} with {g[3][1]} but rank 0 to "
                f"{gathered[0][3][0]} with {gathered[0][3][1]}; all ranks must agree"
            )
    plans, layouts = _gathered_plans([g[1] for g in gathered], options)

    # From here on a failure is carried to ``write_and_commit``, whose collectives
    # make every rank fail together instead of leaving the others waiting.
    my_writes: list[tuple[str, Box, np.ndarray]] = []
    try:
        mine: list[tuple[str, Box, torch.Tensor]] = []
        for name, plan in plans.items():
            for w in plan.writes:
                if w.rank == comm.rank:
                    region = next(
                        r for r in described[name].regions if r.box.intersect(w.box) == w.box
                    )
                    mine.append((name, w.box, region.view[w.box.slices(region.box)]))
        if buffers is None:
            arrays = host_views([v for _, _, v in mine])
        else:
            arrays = buffers.snapshot([((n, b), v) for n, b, v in mine])
        my_writes = [(n, b, a) for (n, b, _), a in zip(mine, arrays, strict=True)]
        _notify(on_phase, "planned")
    except Exception as e:  # noqa: BLE001
        local_error = e
    return PendingSave(
        comm=comm,
        final=final,
        step=step,
        options=options,
        plans=plans,
        layouts=layouts,
        my_writes=my_writes,
        metadata=metadata,
        rank_metadata=[g[2] for g in gathered],
        on_phase=on_phase,
        values=values,
        error=local_error,
    )


def _create(p: PendingSave, names: list[str], partial: Path, ctx: Any, writer: int) -> list:
    """Create the arrays of ``names``; return their tensorstore handles."""
    futures = [
        storage.create_array(
            ctx,
            partial,
            p.options.kvstore,
            array_key(name),
            p.plans[name].shape,
            p.plans[name].dtype,
            p.plans[name].chunk_shape,
            writer,
        )
        for name in names
    ]
    return [f.result() for f in futures]


def _write_mine(
    p: PendingSave, partial: Path, ctx: Any, pool: ThreadPoolExecutor
) -> list[tuple[str, PieceRecord]]:
    """Write this rank's boxes, checksumming pieces alongside; return the piece records."""
    by_name: dict[str, list[tuple[Box, np.ndarray]]] = {}
    for name, box, data in p.my_writes:
        by_name.setdefault(name, []).append((box, data))
    names = list(by_name)
    rank, kvstore = p.comm.rank, p.options.kvstore
    if storage.per_writer(kvstore):
        arrays = _create(p, names, partial, ctx, rank)
    else:
        futures = [storage.open_array(ctx, partial, kvstore, array_key(n), rank) for n in names]
        arrays = [f.result() for f in futures]
    in_flight = []
    for (name, items), array in zip(by_name.items(), arrays, strict=True):
        # No copy into tensorstore: ``data`` stays untouched until this save returns
        # (live tensors of a blocking save, or host buffers reused only by the next
        # save) and nothing of this save's tensorstore context outlives it.
        writes = [
            array[box.slices()].write(data, can_reference_source_data_indefinitely=True)
            for box, data in items
        ]
        sums = [
            pool.submit(_piece_record, piece, data[piece.slices(box)], p.comm.rank)
            for box, data in items
            for piece in pieces(box, p.plans[name].chunk_shape)
        ]
        in_flight.append((name, writes, sums))
    records = []
    for name, writes, sums in in_flight:
        for w in writes:
            w.result()
        records += [(name, s.result()) for s in sums]
        _notify(p.on_phase, f"wrote:{name}")
    return records


def _piece_record(box: Box, data: np.ndarray, rank: int) -> PieceRecord:
    return PieceRecord(box, crc32(data), rank)


def write_and_commit(p: PendingSave, after_commit: Callable[[Path], None] | None = None) -> None:
    """Write this rank's data and, once every rank succeeded, commit (see module notes).

    Every rank takes part in the three collectives whatever fails where, so that
    all ranks return or raise together.
    """
    comm = p.comm
    ctx = storage.new_context()
    local_error = p.error
    partial: Path | None = None
    if comm.rank == 0 and local_error is None:
        try:
            partial = partial_path(p.final)
            partial.mkdir(parents=True)
            if not storage.per_writer(p.options.kvstore):
                _create(p, list(p.plans), partial, ctx, writer=0)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            local_error = e
    created = _error_text(comm, local_error) if comm.rank == 0 else None
    created, partial_name = comm.broadcast((created, str(partial)))
    if created:
        _discard(comm, partial)
        _raise_if_any([created], local_error, "creating the checkpoint")
    partial = Path(partial_name)

    records: list = []
    if local_error is None:
        try:
            _notify(p.on_phase, "created")
            with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
                records = _write_mine(p, partial, ctx, pool)
            _notify(p.on_phase, "written")
        except Exception as e:  # noqa: BLE001
            local_error = e
    gathered = comm.gather((_error_text(comm, local_error), records))

    status: str | None = None
    committed = False
    if comm.rank == 0:
        assert gathered is not None
        status = next((g[0] for g in gathered if g[0]), None)
        if status is None:
            try:
                write_manifest(partial, _manifest(p, [r for g in gathered for r in g[1]]))
                _notify(p.on_phase, "manifest_written")
                commit(partial, p.final)
                committed = True
                _notify(p.on_phase, "committed")
                if after_commit is not None:
                    after_commit(p.final)
            except Exception as e:  # noqa: BLE001
                local_error = e
                status = _error_text(comm, e)
                # The rename is the commit: if what failed came after it inside `commit`
                # (the directory's fsync), the checkpoint is in place and must be said so.
                committed = committed or (not partial.exists() and is_committed(p.final))
    status, committed = comm.broadcast((status, committed))
    if status and committed:
        raise PostCommitError(
            f"checkpoint {p.final} is committed (complete and loadable), but what follows "
            f"the commit failed on {status}"
        ) from local_error
    if status:
        _discard(comm, partial)
        _raise_if_any([status], local_error, f"saving {p.final}")


def _error_text(comm: Collectives, error: BaseException | None) -> str | None:
    return None if error is None else f"rank {comm.rank}: {error!r}"


def _discard(comm: Collectives, partial: Path | None) -> None:
    if comm.rank == 0 and partial is not None and partial.exists():
        shutil.rmtree(partial, ignore_errors=True)


def _manifest(p: PendingSave, records: list[tuple[str, PieceRecord]]) -> Manifest:
    by_tensor: dict[str, list[PieceRecord]] = {name: [] for name in p.plans}
    for name, rec in records:
        by_tensor[name].append(rec)
    tensors = {
        name: TensorRecord(
            name=name,
            key=array_key(name),
            shape=plan.shape,
            dtype=plan.dtype,
            chunk_shape=plan.chunk_shape,
            pieces=tuple(sorted(by_tensor[name], key=lambda r: r.box.offset)),
            layout=p.layouts[name],
        )
        for name, plan in p.plans.items()
    }
    return Manifest(
        step=p.step,
        kvstore=p.options.kvstore,
        world_size=p.comm.world_size,
        tensors=tensors,
        metadata=p.metadata,
        rank_metadata=p.rank_metadata,
        values=p.values,
    )


def save(
    checkpoint_dir: str | os.PathLike,
    tensors: Mapping[str, StateTree],
    metadata: Mapping[str, Any] | None = None,
    *,
    step: int | None = None,
    rank_metadata: Any = None,
    options: StorageOptions | None = None,
    group: Any = None,
    on_phase: PhaseHook | None = None,
) -> None:
    """Save sharded tensors as one checkpoint at ``checkpoint_dir`` (collective, blocking).

    Every rank of ``group`` (default: the default process group, or a single
    process without torch.distributed) calls it with the shards it holds.
    ``metadata`` (JSON-serialisable) is taken from rank 0; ``rank_metadata``
    (JSON-serialisable) is kept per rank. The directory appears only when the
    checkpoint is complete; it must not exist yet.
    """
    comm = collectives_for(group)
    pending = prepare_save(
        Path(checkpoint_dir),
        tensors,
        metadata,
        comm=comm,
        step=step,
        rank_metadata=rank_metadata,
        options=options or StorageOptions(),
        buffers=None,
        on_phase=on_phase,
    )
    write_and_commit(pending)
