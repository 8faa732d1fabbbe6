"""Can expert parallelism hide its token transport behind the expert GEMMs? (two GPUs)

    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_overlap.py --out $OUT/ep_overlap.json

One MoE layer's forward at the bench-2gpu shape (8k tokens per rank, d_model 2048,
64 experts over two ranks, top-8, expert hidden 1024, the rowwise NVSHMEM transport),
no autograd, eager mode as training runs it:

- host vs device time of dispatch + combine. Both are measured with the GPU held busy
  by a sleep kernel ahead, so the host is ahead of the device as in a training step
  (where it stays 18-90 ms ahead: `min_host_lead_ms` of `bench_train_step.py`): the device times are what a step
  pays, the host time is the launch cost alone;
- the layer split into 1, 2 or 4 token chunks, run sequentially on one stream and
  pipelined (chunk ``c + 1``'s dispatch and chunk ``c - 1``'s combine on a second,
  high-priority stream while chunk ``c``'s experts run): the schedule a
  dispatch/compute overlap would use, timed end to end. ``comm`` and ``comp`` are the
  transport and the expert GEMMs alone.

The table prints each variant against the unsplit sequential layer (today's schedule).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _bench import device_and_host_ms, init_nccl
from moe_ep_transport import EPConfig, EPDispatcher, make_transport, nvshmem_memory
from moe_ep_transport.rowwise import slab_bytes_for
from moe_model.experts import GroupedExperts

E, K, D, F = 64, 8, 2048, 1024


def device_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Device time per call with the host ahead of the device, the slower rank's."""
    return device_and_host_ms(fn, iters, 3, host_ahead=True)[0]


def host_ms(fn: Callable[[], object], iters: int = 4) -> float:
    """Host time per call with the device busy: the launch cost alone."""
    return device_and_host_ms(fn, iters, 3, host_ahead=True)[1]


def measure(n: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: GroupedExperts,
            side: torch.cuda.Stream, device: torch.device) -> dict[str, float]:
    """The variants of one layer forward split into ``n`` token chunks."""
    T = x.shape[0]
    cfg = EPConfig(E, K, T // n, D)
    transport = make_transport("rowwise", cfg, device=device)
    ep = EPDispatcher(cfg, transport)
    chunks = list(zip(x.split(T // n), ids.split(T // n), w.split(T // n), strict=True))
    with torch.no_grad():
        rows0, offs0, _ = ep.dispatch(*chunks[0])

    @torch.no_grad()
    def comm() -> None:
        for xc, ic, wc in chunks:
            rows, _, handle = ep.dispatch(xc, ic, wc)
            ep.combine(rows, wc, handle)

    @torch.no_grad()
    def comp() -> None:
        for _ in chunks:
            experts(rows0, offs0)

    @torch.no_grad()
    def sequential() -> None:
        for xc, ic, wc in chunks:
            rows, offs, handle = ep.dispatch(xc, ic, wc)
            ep.combine(experts(rows, offs), wc, handle)

    @torch.no_grad()
    def pipelined() -> None:
        main_stream = torch.cuda.current_stream()
        ready = main_stream.record_event()
        sent, arrived = [], []
        with torch.cuda.stream(side):
            side.wait_event(ready)
            for chunk in chunks:
                sent.append(ep.dispatch(*chunk))
                arrived.append(side.record_event())
        for (rows, offs, handle), event, (_, _, wc) in zip(sent, arrived, chunks, strict=True):
            main_stream.wait_event(event)
            out = experts(rows, offs)
            done = main_stream.record_event()
            with torch.cuda.stream(side):
                side.wait_event(done)
                ep.combine(out, wc, handle)
        main_stream.wait_stream(side)

    row = {"chunks": n, "comm_ms": device_ms(comm), "comm_host_ms": host_ms(comm),
           "comp_ms": device_ms(comp), "sequential_ms": device_ms(sequential),
           "pipelined_ms": device_ms(pipelined)}
    transport.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--chunks", default="1,2,4")
    args = parser.parse_args()
    device = init_nccl()
    rank, world = dist.get_rank(), dist.get_world_size()
    T = args.tokens
    nvshmem_memory.bootstrap(None, device, heap_bytes=2 * slab_bytes_for(EPConfig(E, K, T, D), world, 2 * D))
    x = torch.randn(T, D, device=device).to(torch.bfloat16)
    ids = torch.topk(torch.randn(T, E, generator=torch.Generator(device=device).manual_seed(1000 + rank),
                                device=device), K, dim=1).indices  # random routing
    w = torch.softmax(torch.randn(T, K, device=device), dim=1)
    experts = GroupedExperts(E // world, D, F, "grouped_mm").to(device)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    experts = experts.to(torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)
    results = []
    for n in (int(c) for c in args.chunks.split(",")):
        results.append(measure(n, x, ids, w, experts, side, device))
        if rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if rank == 0:
        base = results[0]["sequential_ms"]
        Path(args.out).write_text(json.dumps({"tokens_per_rank": T, "ranks": world, "results": results},
                                             indent=1))
        print(f"\nms per MoE layer forward, {T} tokens per rank, {world} ranks (slower rank)")
        print("| chunks | transport (device) | transport (host) | experts | sequential | pipelined "
              "| pipelined vs unsplit |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r['chunks']} | {r['comm_ms']:.3f} | {r['comm_host_ms']:.3f} | {r['comp_ms']:.3f} | "
                  f"{r['sequential_ms']:.3f} | {r['pipelined_ms']:.3f} | {base / r['pipelined_ms']:.2f}x |")
    nvshmem_memory.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
