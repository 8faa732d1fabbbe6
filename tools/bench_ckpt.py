"""Checkpoint benchmark: moe-ckpt vs torch.distributed.checkpoint (DCP) on one state.

The state is ``--size-gb`` of 128 MiB tensors (FP32 [4096, 8192] and BF16
[8192, 8192] alternating), each sharded along dim 0 over the ranks, on the GPU
when there is one. Measured in the same run, on the same disk:

- single stream: every rank writes its bytes to one file with one thread (fsync)
  and reads them back cold; a reference point, not the disk's ceiling (a save that
  writes several files at once can exceed it);
- blocking save and cold load (page cache dropped for the checkpoint's files with
  ``posix_fadvise``) for moe-ckpt with the ``ocdbt`` and ``file`` layouts and for
  DCP (``FileSystemWriter`` defaults, the state as DTensors sharded the same way);
  loads are checked bit for bit;
- asynchronous save inside a training loop (matmuls plus an all-reduce per step):
  the time ``save()`` blocks the loop (host snapshot), the loop's total slowdown
  while the write runs in the background (blocked time included) and the write
  time left when the loop ends, for moe-ckpt's ``Checkpointer`` and DCP's
  ``async_save``; a first round (host buffers allocated) and a second one.

Launch (prints a table last, writes JSON):

    python3 tools/bench_ckpt.py --size-gb 2 --out /tmp/bench_ckpt.json
    torchrun --nproc-per-node 2 tools/bench_ckpt.py --size-gb 8 --dir /tmp/ckbench --out $OUT/bench_ckpt.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path

import moe_ckpt as mc
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

TENSOR_BYTES = 128 << 20
SHAPES = [((4096, 8192), torch.float32), ((8192, 8192), torch.bfloat16)]


def world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_state(size_gb: float, device: torch.device) -> dict[str, mc.BoxShard]:
    """This rank's dim-0 box of each global tensor (rows split evenly)."""
    n, rank = world()
    count = max(1, round(size_gb * 1e9 / TENSOR_BYTES))
    state = {}
    for i in range(count):
        shape, dtype = SHAPES[i % 2]
        rows = shape[0] // n
        g = torch.Generator(device=device).manual_seed(i * 1000 + rank)
        local = torch.empty((rows, shape[1]), dtype=dtype, device=device)
        local.uniform_(-1, 1, generator=g)
        state[f"layers.{i}.weight"] = mc.BoxShard(local, shape, (rank * rows, 0))
    return state


def state_bytes(state: dict[str, mc.BoxShard]) -> int:
    """Global bytes (all ranks)."""
    return sum(math.prod(s.global_shape) * s.local.element_size() for s in state.values())


def evict(path: Path) -> None:
    """Drop the page cache of every file under ``path`` so the next read hits the disk."""
    for dirpath, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_usage(path: Path) -> tuple[int, int]:
    files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    return len(files), sum(os.path.getsize(f) for f in files)


def timed(fn, device: torch.device) -> float:
    barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    barrier()
    return time.perf_counter() - t0


def fresh(path: Path) -> Path:
    _, rank = world()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    barrier()
    return path


def single_stream(state: dict[str, mc.BoxShard], root: Path, device: torch.device) -> dict[str, float]:
    """Raw sequential write (fsync) and cold read of this rank's bytes, one file and one
    thread per rank, all ranks at once. Not a ceiling: parallel writes can go faster."""
    _, rank = world()
    host = [s.local.cpu().reshape(-1).view(torch.uint8).numpy() for s in state.values()]
    path = fresh(root / "raw")
    if rank == 0:
        path.mkdir(parents=True)
    barrier()
    f_path = path / f"rank{rank}.bin"

    def write() -> None:
        with open(f_path, "wb") as f:
            for a in host:
                f.write(a.data)
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        with open(f_path, "rb", buffering=0) as f:
            for a in host:
                f.readinto(a.data)

    total = state_bytes(state)
    w = timed(write, device)
    evict(f_path)
    r = timed(read, device)
    return {"single_stream_write_GBps": total / w / 1e9, "single_stream_read_GBps": total / r / 1e9}


def as_dtensors(state: dict[str, mc.BoxShard], device: torch.device) -> dict[str, torch.Tensor]:
    """The same shards as DCP understands them (plain tensors in a single process)."""
    if not dist.is_initialized():
        return {k: s.local for k, s in state.items()}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return {
        k: DTensor.from_local(
            s.local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size(s.global_shape),
            stride=torch.empty(s.global_shape, device="meta").stride(),
        )
        for k, s in state.items()
    }


def bench_blocking(state, root: Path, device, repeats: int, gloo) -> dict[str, dict]:
    total = state_bytes(state)
    results = {}
    for label, kvstore in (
        ("moe-ckpt ocdbt", "ocdbt"),
        ("moe-ckpt file", "file"),
        ("torch DCP", None),
    ):
        saves, loads, files, nbytes = [], [], 0, 0
        for rep in range(repeats):
            path = fresh(root / f"{label.replace(' ', '_')}_{rep}")
            targets = {
                k: mc.BoxShard(torch.zeros_like(s.local), s.global_shape, s.global_offset)
                for k, s in state.items()
            }
            if kvstore is not None:
                opts = mc.StorageOptions(kvstore=kvstore)
                save = partial(mc.save, path, state, step=rep, options=opts, group=gloo)
                load = partial(mc.load, path, targets)
            else:
                kw = {"process_group": gloo} if dist.is_initialized() else {"no_dist": True}
                save = partial(dcp.save, as_dtensors(state, device), checkpoint_id=path, **kw)
                load = partial(dcp.load, as_dtensors(targets, device), checkpoint_id=path, **kw)
            saves.append(timed(save, device))
            evict_on_rank0(path)
            loads.append(timed(load, device))
            for k, s in state.items():
                assert torch.equal(targets[k].local, s.local), f"{label}: {k} differs after load"
            files, nbytes = disk_usage(path)
            barrier()
            if world()[1] == 0:
                shutil.rmtree(path, ignore_errors=True)
        results[label] = {
            "save_s": saves,
            "load_s": loads,
            "files": files,
            "bytes_on_disk": nbytes,
            "save_GBps": total / min(saves) / 1e9,
            "load_GBps": total / min(loads) / 1e9,
        }
    return results


def evict_on_rank0(path: Path) -> None:
    barrier()
    if world()[1] == 0:
        evict(path)
    barrier()


class TrainLoop:
    """A stand-in training step: matmuls sized to ~``step_ms`` plus an all-reduce."""

    def __init__(self, device: torch.device, step_ms: float) -> None:
        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        n = 8192 if device.type == "cuda" else 768
        self.a = torch.randn(n, n, device=device, dtype=dtype)
        self.grad = torch.ones(16 << 20, device=device)
        self.reps = 1
        t = self.median(5)
        self.reps = max(1, round(step_ms / 1e3 / t))

    def step(self) -> None:
        x = self.a
        for _ in range(self.reps):
            x = x @ self.a
            x = x / x.abs().amax().clamp(min=1)
        if dist.is_initialized():
            dist.all_reduce(self.grad)
        sync(self.device)

    def median(self, n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def bench_async(state, root: Path, device, loop: TrainLoop, steps: int, gloo) -> dict[str, dict]:
    """Two rounds per method (the first allocates host buffers): a loop of ``steps``
    steps with one asynchronous save after step 2, then a wait for the write."""
    base = loop.median(steps)
    out = {}
    for label in ("moe-ckpt Checkpointer", "torch DCP async_save"):
        path = fresh(root / label.replace(" ", "_"))
        ckpt = (
            mc.Checkpointer(path, mc.CheckpointerConfig(keep_last=1))
            if label.startswith("moe")
            else None
        )
        src = as_dtensors(state, device) if ckpt is None else None
        kw = {"process_group": gloo} if dist.is_initialized() else {}
        rounds = []
        for rnd in range(2):
            barrier()
            t_start = time.perf_counter()
            for i in range(steps):
                if i == 2:
                    t0 = time.perf_counter()
                    if ckpt is not None:
                        ckpt.save(rnd, state)
                    else:
                        pending = dcp.async_save(src, checkpoint_id=path / f"round{rnd}", **kw)
                    blocked = time.perf_counter() - t0
                loop.step()
            t_loop = time.perf_counter()
            if ckpt is not None:
                ckpt.wait()
            else:
                getattr(pending, "upload_completion", pending).result()
            barrier()
            rounds.append(
                {
                    "blocked_s": blocked,
                    "loop_overhead_s": (t_loop - t_start) - steps * base,
                    "write_left_after_loop_s": time.perf_counter() - t_loop,
                }
            )
        if ckpt is not None:
            ckpt.close()
        out[label] = {"baseline_step_s": base, "steps": steps, "rounds": rounds}
        barrier()
        if world()[1] == 0:
            shutil.rmtree(path, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=2.0, help="global state size")
    p.add_argument(
        "--dir", default="/tmp/moe_ckpt_bench", help="scratch directory on the disk to test"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=24, help="training-loop steps in the async test")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute per training-loop step")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, 1 process

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if "WORLD_SIZE" in os.environ:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timedelta(minutes=30)
        )
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    gloo = dist.new_group(backend="gloo") if dist.is_initialized() else None
    n, rank = world()
    root = Path(args.dir)

    state = make_state(args.size_gb, device)
    total = state_bytes(state)
    sync(device)
    result = {
        "config": vars(args)
        | {
            "world_size": n,
            "device": str(device),
            "state_bytes": total,
            "torch": torch.__version__,
            "tensors": len(state),
        },
        **single_stream(state, root, device),
        "blocking": bench_blocking(state, root, device, args.repeats, gloo),
    }
    loop = TrainLoop(device, args.step_ms)
    result["async"] = bench_async(state, root, device, loop, args.steps, gloo)
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))
        print_table(result)
    if dist.is_initialized():
        dist.destroy_process_group()


def print_table(r: dict) -> None:
    c = r["config"]
    print(
        f"\nstate {c['state_bytes'] / 1e9:.2f} GB over {c['world_size']} rank(s) on {c['device']}, "
        f"torch {c['torch']}; one stream per rank (not a ceiling): write "
        f"{r['single_stream_write_GBps']:.2f} GB/s, read {r['single_stream_read_GBps']:.2f} GB/s"
    )
    print(f"{'method':24s} {'save GB/s':>10s} {'load GB/s':>10s} {'files':>7s}")
    for label, v in r["blocking"].items():
        print(f"{label:24s} {v['save_GBps']:10.2f} {v['load_GBps']:10.2f} {v['files']:7d}")
    print(
        f"\n{'async save (1st / 2nd)':24s} {'loop blocked s':>16s} {'loop slowdown s':>16s} {'write after loop s':>19s}"
    )
    for label, v in r["async"].items():
        a, b = v["rounds"]
        print(
            f"{label:24s} {a['blocked_s']:7.3f} / {b['blocked_s']:6.3f} {a['loop_overhead_s']:7.2f} / {b['loop_overhead_s']:6.2f} "
            f"{a['write_left_after_loop_s']:8.2f} / {b['write_left_after_loop_s']:6.2f}"
        )


if __name__ == "__main__":
    main()
