"""The EP routing plan alone: device time per plan of the rowwise transport, from CUDA graphs.

    tools/from_source.sh torchrun --nproc-per-node 1 tools/bench_ep_plan.py --out $OUT/ep_plan.json
    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_plan.py --out $OUT/ep_plan_2gpu.json

For each size (tokens per rank, experts; top-k 8 of random router logits, capacity
factor 1.25) it times ``RowwiseTransport.plan_routes``: the slot ranks, the count
exchange and its barrier, the cell tables and every row's destination, as a dispatch
runs them. A CUDA graph holds ``--calls`` plans and is replayed (device time, no
launch overhead, as in a graph-captured step); ``us`` is the slowest rank's mean per
plan. The baseline, measured in the same run, is the transport's flag barrier alone
replayed the same way (``barrier us``): every plan passes one, so ``us - barrier us``
is what the plan's own work and launches cost. On one GPU the exchange and the barrier
run with the rank's own memory as its only peer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.distributed as dist
from _bench import init_nccl, max_over_ranks
from moe_ep_transport import EPConfig, make_transport, nvshmem_memory
from moe_ep_transport.rowwise import slab_bytes_for


def _replay_us(fn: Callable[[], object], calls: int, replays: int, scope: Callable) -> float:
    """Device microseconds per call of ``fn``, ``calls`` of them captured (inside ``scope()``)
    in one CUDA graph, the graph replayed ``replays`` times; the slowest rank's."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), scope():
        for _ in range(calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), scope():
        for _ in range(calls):
            fn()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = 1e3 * start.elapsed_time(end) / (replays * calls)
    del graph
    return max_over_ranks([us], torch.device("cuda"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--experts", default="64,256")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--calls", type=int, default=20, help="plans per graph (even: the slabs alternate)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default="ep_plan.json")
    args = ap.parse_args()

    device = init_nccl()
    rank, M = dist.get_rank(), dist.get_world_size()
    k, D = args.top_k, 64  # rows are not moved: the smallest slab rows that fit the plan's tables
    tokens = sorted(int(t) for t in args.tokens.split(","))
    experts = sorted(int(e) for e in args.experts.split(","))
    largest = max(slab_bytes_for(EPConfig(E, k, tokens[-1], D, capacity_factor=args.capacity_factor), M, 4 * D)
                  for E in experts)
    nvshmem_memory.bootstrap(None, device, heap_bytes=3 * largest)

    rows = []
    for E in experts:
        for T in tokens:
            cfg = EPConfig(E, k, T, D, capacity_factor=args.capacity_factor)
            transport = make_transport("rowwise", cfg, device=device, dtype=torch.float32)
            gen = torch.Generator(device=device).manual_seed(1000 + rank)
            ids = torch.topk(torch.randn(T, E, generator=gen, device=device), k, dim=1).indices.reshape(-1)

            def plan(transport=transport, ids=ids, E=E) -> None:
                transport.plan_routes(ids, E, top_k=k, capacity=transport.capacity, salt=1)

            us = _replay_us(plan, args.calls, args.replays, transport.replayable)
            barrier_us = _replay_us(transport.memory.barrier, args.calls, args.replays, transport.replayable)
            rows.append({"tokens": T, "experts": E, "slots": T * k, "capacity": transport.capacity,
                         "us": us, "barrier_us": barrier_us})
            transport.close()

    nvshmem_memory.finalize()
    if rank == 0:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ranks": M,
                  "top_k": k, "capacity_factor": args.capacity_factor, "calls": args.calls,
                  "replays": args.replays, "rows": rows}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"{'tokens':>6} {'experts':>7} {'slots':>7} {'us':>7} {'barrier us':>10} {'plan - barrier':>14}")
        for r in rows:
            print(f"{r['tokens']:>6} {r['experts']:>7} {r['slots']:>7} {r['us']:>7.1f} {r['barrier_us']:>10.1f} "
                  f"{r['us'] - r['barrier_us']:>14.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
