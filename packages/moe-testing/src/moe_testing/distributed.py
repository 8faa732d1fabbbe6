"""Run one test function in N processes, each a rank of a fresh process group.

Design notes:
- Children start from a *forkserver* that pre-imports torch once, so a 4-rank
  test does not pay four cold torch imports, and no child inherits a parent's
  CUDA context or OpenMP thread pool (the hazards of plain ``fork``).
- The test function is located by (source file, qualified name) and imported in
  the child from its file. Pytest's importlib mode gives test modules names that
  are not importable, so pickling the function itself would fail.
- Every failure path ends the test: an exception in a rank is re-raised in the
  parent with that rank's traceback; a rank that dies without reporting fails it;
  ranks still running when the deadline passes are killed and reported by rank.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CONTEXT: mp.context.BaseContext | None = None
_LOADED_MODULES: dict[str, Any] = {}


class DistributedTestError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def _context() -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        if sys.platform.startswith("linux"):
            ctx = mp.get_context("forkserver")
            # Modules every rank needs: import them once in the server, not per child.
            ctx.set_forkserver_preload(
                ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes"]
            )
        else:
            ctx = mp.get_context("spawn")
        _CONTEXT = ctx
    return _CONTEXT


# The store's error when its port was taken between ``free_port`` and rank 0's bind;
# a rank that hits it reports exactly this string and the run is retried on a new port.
_PORT_TAKEN = "EADDRINUSE"
_PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_function(path: str, qualname: str) -> Callable[..., Any]:
    module = _LOADED_MODULES.get(path)
    if module is None:
        name = "_moe_testing_child_" + str(abs(hash(path)))
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import test module from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _LOADED_MODULES[path] = module
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _serialize(value: Any) -> bytes:
    """Results cross the process boundary as ``torch.save`` bytes: tensors in them
    must not point at shared memory of a process that is about to exit."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _deserialize(payload: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    path: str,
    qualname: str,
    args: tuple,
    kwargs: dict,
    results: Any,
    threads_per_rank: int,
) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(threads_per_rank)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        if backend == "nccl":
            torch.cuda.set_device(rank)
        try:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
                device_id=torch.device("cuda", rank) if backend == "nccl" else None,
            )
        except Exception as e:
            if _PORT_TAKEN in str(e):  # the free port was taken before rank 0 bound it
                results.put((rank, "error", _PORT_TAKEN))
                return
            raise
        fn = _load_function(path, qualname)
        value = fn(*args, **kwargs)
        results.put((rank, "ok", _serialize(value)))
        # Then wait for every rank before tearing down the store: a rank leaving early
        # breaks peers that are still using it (e.g. creating subgroups).
        dist.barrier()
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _run_ranks(
    world_size: int, port: int, backend: str, timeout: float, path: str, qualname: str,
    args: tuple, kwargs: dict, threads_per_rank: int,
) -> tuple[dict[int, Any], dict[int, str]]:
    """Start the ranks on ``port`` and collect each one's result payload or error."""
    ctx = _context()
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, backend, timeout, path, qualname, args, kwargs,
                  results, threads_per_rank),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in order of arrival: the first is usually the cause
    deadline = time.monotonic() + timeout
    first_error_at: float | None = None
    try:
        while len(values) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            # After the first failure give the others a moment to report their own
            # errors, then stop: the survivors are usually blocked in a collective.
            if first_error_at is not None and now - first_error_at > 3.0:
                break
            try:
                rank, status, payload = results.get(timeout=0.1)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if (not p.is_alive() and p.exitcode not in (0, None)
                            and r not in values and r not in errors):
                        # Drain a report that may have arrived just before exit.
                        try:
                            while True:
                                rk, st, pl = results.get_nowait()
                                (values if st == "ok" else errors)[rk] = pl
                        except queue.Empty:
                            pass
                        if r not in values and r not in errors:
                            errors[r] = f"rank {r} died with exit code {p.exitcode}"
                        first_error_at = first_error_at or time.monotonic()
                continue
            if status == "ok":
                values[rank] = payload
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()

    return values, errors


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be a module-level function (or a class attribute) of an importable
    file; arguments must pickle; return values may hold tensors (they travel as
    ``torch.save`` bytes). The default process group is
    initialised before ``fn`` runs (``gloo`` on CPU, ``nccl`` when ``backend`` says
    so; ``torch.distributed.get_rank()`` gives the rank). Raises
    :class:`DistributedTestError` naming the failing rank with its traceback, or
    naming the ranks that had not finished after ``timeout`` seconds.
    """
    if backend is None:
        backend = "gloo"
    if backend == "nccl":
        import torch

        if torch.cuda.device_count() < world_size:
            raise DistributedTestError(
                f"world_size={world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}"
            )
    path = os.path.abspath(fn.__code__.co_filename)
    for _ in range(_PORT_ATTEMPTS):  # a fresh port if another process took ours first
        values, errors = _run_ranks(world_size, free_port(), backend, timeout, path,
                                    fn.__qualname__, args, kwargs, threads_per_rank)
        if _PORT_TAKEN not in errors.values():
            break

    if errors:
        rank = next(iter(errors))
        others = sorted(set(errors) - {rank})
        more = f" (ranks {others} failed too)" if others else ""
        raise DistributedTestError(
            f"{fn.__qualname__}: rank {rank} of {world_size} failed{more}:\n{errors[rank]}"
        )
    missing = [r for r in range(world_size) if r not in values]
    if missing:
        raise DistributedTestError(
            f"{fn.__qualname__}: ranks {missing} of {world_size} did not finish within "
            f"{timeout:.0f} s and were killed"
        )
    return [_deserialize(values[r]) for r in range(world_size)]
