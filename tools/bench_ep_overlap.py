"""Can expert parallelism hide its token transport behind the expert GEMMs? (two GPUs)

    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_overlap.py --out $OUT/ep_overlap.json
    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_overlap.py --graphs --out $OUT/ep_overlap_graphs.json
    # the SM split: the communication stream bounded to 16, 32 or 48 SMs (EPConfig.comm_sms)
    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_overlap.py --comm-sms none,16,32,48 --out $OUT/ep_overlap_sms.json

One MoE layer at the bench-2gpu shape (8k tokens per rank, d_model 2048, 64 experts
over two ranks, top-8, expert hidden 1024, the rowwise NVSHMEM transport), eager mode
as training runs it:

- host vs device time of dispatch + combine. Both are measured with the GPU held busy
  by a sleep kernel ahead, so the host is ahead of the device as in a training step
  (where it stays 18-90 ms ahead: `min_host_lead_ms` of `bench_train_step.py`): the device times are what a step
  pays, the host time is the launch cost alone;
- the layer split into 1, 2 or 4 token chunks, run sequentially on one stream and
  pipelined by ``EPDispatcher.run_experts`` with ``EPConfig.overlap_chunks`` (chunk
  ``c + 1``'s dispatch and chunk ``c - 1``'s combine on a high-priority communication
  stream while chunk ``c``'s experts run; ``moe_ep_transport.pipeline``): the forward
  with no autograd, and (eager only) forward + backward, timed end to end. ``comm`` and
  ``comp`` are the transport and the expert GEMMs alone. Each chunked layer's transport
  is sized for one chunk (``max_tokens = T / chunks``), as the app builds it.

With ``--graphs`` every forward device time comes from a CUDA graph of the variant
(captured inside the transport's ``replayable()``, so replays alternate its slabs): no
launch gap is left in them, only the device's own costs (per-chunk plans and barriers,
SMs shared by the puts and the GEMMs). The host time stays that of eager calls; the
forward + backward variants are left out.

The table prints each variant against the unsplit sequential layer (today's schedule),
and for each chunked one the share of the GEMMs' SMs the transport took while they
overlapped, fitted to its times (``pretrain.planner.step_time.fit_comm_sm_share``): with
``--graphs``, the ``all`` rows' share is the value for the step-time profile's
``ep_comm_sm_share``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from _bench import device_and_host_ms, init_nccl
from moe_ep_transport import EPConfig, EPDispatcher, make_transport, nvshmem_memory
from moe_ep_transport.rowwise import slab_bytes_for
from moe_model.experts import GroupedExperts
from pretrain.planner.step_time import fit_comm_sm_share

E, K, D, F = 64, 8, 2048, 1024


def device_ms(fn: Callable[[], object], iters: int = 10) -> float:
    """Device time per call with the host ahead of the device, the slower rank's."""
    return device_and_host_ms(fn, iters, 3, host_ahead=True)[0]


def host_ms(fn: Callable[[], object], iters: int = 4) -> float:
    """Host time per call with the device busy: the launch cost alone."""
    return device_and_host_ms(fn, iters, 3, host_ahead=True)[1]


def replayed(fn: Callable[[], object], transport) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after a warm-up call on a side stream); its replay."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), transport.replayable():
        fn()
    return graph.replay


def measure(n: int, comm_sms: int | None, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
            experts: GroupedExperts, device: torch.device, graphs: bool = False) -> dict[str, float]:
    """The variants of one layer split into ``n`` token chunks, the pipeline's communication
    stream bounded to ``comm_sms`` SMs (device times from CUDA graphs with ``graphs``)."""
    T = x.shape[0]
    cfg = EPConfig(E, K, math.ceil(T / n), D, overlap_chunks=n, comm_sms=comm_sms)
    transport = make_transport("rowwise", cfg, device=device)
    ep = EPDispatcher(cfg, transport)
    chunks = list(zip(x.tensor_split(n), ids.tensor_split(n), w.tensor_split(n), strict=True))
    with torch.no_grad():
        rows0, offs0, _ = ep.dispatch(*chunks[0])
    x_grad = x.detach().requires_grad_(True)
    g = torch.randn_like(x)

    @torch.no_grad()
    def comm() -> None:
        for xc, ic, wc in chunks:
            rows, _, handle = ep.dispatch(xc, ic, wc)
            ep.combine(rows, wc, handle)

    @torch.no_grad()
    def comp() -> None:
        for _ in chunks:
            experts(rows0, offs0)

    def sequential_layer(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        ys = []
        for xc, (_, ic, wc) in zip(xs, chunks, strict=True):
            rows, offs, handle = ep.dispatch(xc, ic, wc)
            ys.append(ep.combine(experts(rows, offs), wc, handle))
        return ys

    @torch.no_grad()
    def sequential() -> None:
        sequential_layer([c[0] for c in chunks])

    @torch.no_grad()
    def pipelined() -> None:
        ep.run_experts(x, ids, w, experts)

    def sequential_train() -> None:
        torch.cat(sequential_layer(list(x_grad.tensor_split(n)))).backward(g)

    def pipelined_train() -> None:
        ep.run_experts(x_grad, ids, w, experts)[0].backward(g)

    def timed(fn: Callable[[], object]) -> float:
        return device_ms(replayed(fn, transport) if graphs else fn)

    row = {"chunks": n, "comm_sms": comm_sms, "graphs": graphs, "comm_ms": timed(comm),
           "comm_host_ms": host_ms(comm), "comp_ms": timed(comp), "sequential_ms": timed(sequential),
           "pipelined_ms": timed(pipelined)}
    if n > 1:
        row["comm_sm_share"] = fit_comm_sm_share(row["comm_ms"] / 1e3, row["comp_ms"] / 1e3,
                                                 row["pipelined_ms"] / 1e3, n)
    if not graphs:
        row.update(sequential_train_ms=device_ms(sequential_train), pipelined_train_ms=device_ms(pipelined_train))
    transport.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    parser.add_argument("--chunks", default="1,2,4")
    parser.add_argument("--comm-sms", default="none",
                        help="SM bounds of the communication stream to sweep ('none': every SM), "
                             "comma-separated; the unsplit layer runs once")
    parser.add_argument("--graphs", action="store_true", help="forward device times from CUDA graph replays")
    args = parser.parse_args()
    sms_list = [None if v == "none" else int(v) for v in args.comm_sms.split(",")]
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
    results = []
    for n in (int(c) for c in args.chunks.split(",")):
        for sms in sms_list if n > 1 else [None]:
            results.append(measure(n, sms, x, ids, w, experts, device, args.graphs))
            if rank == 0:
                print(json.dumps(results[-1]), flush=True)
    if rank == 0:
        base = results[0]
        Path(args.out).write_text(json.dumps({"tokens_per_rank": T, "ranks": world, "results": results},
                                             indent=1))
        how = "from CUDA graphs" if args.graphs else "eager, host ahead"
        print(f"\nms per MoE layer, {T} tokens per rank, {world} ranks (slower rank, {how})")
        print("| chunks | comm SMs | transport (device) | transport (host) | experts | sequential | pipelined "
              "| pipelined vs unsplit | fitted SM share | fwd+bwd sequential | fwd+bwd pipelined "
              "| fwd+bwd vs unsplit |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            share = f"{r['comm_sm_share']:.2f}" if "comm_sm_share" in r else "-"
            train = ("| - | - | - |" if args.graphs else
                     f"| {r['sequential_train_ms']:.3f} | {r['pipelined_train_ms']:.3f} | "
                     f"{base['sequential_train_ms'] / r['pipelined_train_ms']:.2f}x |")
            print(f"| {r['chunks']} | {r['comm_sms'] or 'all'} | {r['comm_ms']:.3f} | {r['comm_host_ms']:.3f} | "
                  f"{r['comp_ms']:.3f} | {r['sequential_ms']:.3f} | {r['pipelined_ms']:.3f} | "
                  f"{base['sequential_ms'] / r['pipelined_ms']:.2f}x | {share} {train}")
    nvshmem_memory.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
