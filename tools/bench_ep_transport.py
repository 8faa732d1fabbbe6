"""EP dispatch+combine throughput: rowwise NVSHMEM vs all-to-all vs bare NCCL, two GPUs.

    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_transport.py --out $OUT/ep_transport.json
    tools/from_source.sh torchrun --nproc-per-node 2 tools/bench_ep_transport.py --graphs \
        --routing balanced --out $OUT/ep_transport_graphs.json

For each per-layer size (tokens per rank, d_model 2048, top-8 of 64 experts) and
routing it times, in the same run and on the same routing:
- ``nccl``: two bare ``all_to_all_single`` of the kept rows (there and back), the
  split sizes known in advance (the floor of what an all-to-all transport pays);
- ``all_to_all``: this package's reference backend (count exchange, host splits);
- ``rowwise``: this package's NVSHMEM backend (no host sync), combine as
  ``EPConfig.combine="auto"`` picks (top-8 on two ranks: summed at the destinations,
  one FP32 partial per token and rank returns), and ``rowwise:src`` summing at the
  source (one row per slot returns), and ``rowwise:ce`` moving its token inbox sends and
  partial sums with the copy engines (``EPConfig.copy_engine``: every token to the other
  rank, and every partial row back, as one block each, no SM), A/B in the same run.
With ``--graphs`` it also replays ``nccl`` and the rowwise variants from CUDA graphs
(``:graph`` rows: device time alone, no launch overhead; ``x nccl`` of a graph row
compares with NCCL's graph row). It measures the one-way NVLink put ceiling with a
plain large put (every row of a large buffer stored into the peer, both ranks at
once, our put kernel), the same with the copy engines (one block per rank, both ranks at
once), and the transport's barrier alone (back to back, eager).

Routings: ``balanced`` is the app's forced balanced routing
(``pretrain.routing_override.forced_ids``: token ``t``'s ``j``-th expert
``(t + j*E/k) mod E``), each rank's tokens numbered on from the previous rank's
(token ``t`` of rank ``r`` is token ``r*T + t``): every expert gets ``T*k/E`` rows
from every rank (``T`` a multiple of ``E``) and a token's experts are spread over
the expert range, so it reaches ``min(k, ep)`` ranks, as with uniformly random
choices; ``random`` is the top-k of random router logits; ``zipf`` is skewed
towards low expert ids.

Payload = kept rows x bytes per row that one rank dispatches; GB/s counts the
payload twice (dispatch and combine) for every backend, NCCL included, so the
columns compare like for like; ``x nccl`` is NCCL's time over the backend's;
``% put`` is the payload-equivalent rate over the put ceiling (rows to the other
rank, twice, as an all-to-all moves them); ``moved`` (MiB) is what actually crosses
NVLink per dispatch + combine (the rowwise dispatch sends a token once per rank, not
once per slot; summing at the destination returns one FP32 partial per token and
rank, the weights riding in the dispatch's metadata; metadata not counted) and ``% link`` its rate over
the put ceiling. ``ms`` is device time
per iteration (events around a loop: when the host cannot issue work as fast as the
GPU runs it, this is host time);
``host ms`` is the CPU time to issue one iteration. Times are the slowest rank's
mean per iteration.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from _bench import device_and_host_ms, init_nccl
from moe_ep_transport import EPConfig, EPDispatcher, make_transport, nvshmem_memory
from moe_ep_transport.peer_memory import inbox_targets
from moe_ep_transport.rowwise import slab_bytes_for
from pretrain.routing_override import forced_ids


@dataclass
class Row:
    tokens: int
    routing: str
    backend: str
    payload_mib: float  # kept rows x row bytes, one rank, one direction
    remote_mib: float  # part of the payload that crosses to the other rank
    moved_mib: float  # bytes that cross NVLink per dispatch + combine (rowwise sends tokens once per rank)
    drop_rate: float
    load_imbalance: float
    ms: float  # dispatch + combine, device time, slowest rank
    host_ms: float  # CPU time to issue one dispatch + combine, slowest rank
    dispatch_ms: float
    gbps: float  # 2 x payload / time
    x_nccl: float  # nccl time / this time
    pct_put_ceiling: float  # 2 x remote / time over the one-way put ceiling (payload-equivalent rate)
    pct_link: float  # moved / time over the one-way put ceiling (how busy the link is)


def _routing(kind: str, T: int, E: int, k: int, rank: int, device: torch.device) -> torch.Tensor:
    """``[T, k]`` expert ids of this rank's tokens (module docstring: Routings)."""
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    if kind == "balanced":  # the tokens of rank r are tokens r*T .. r*T + T - 1 of one sequence
        return ((forced_ids("balanced", T, E, k, seed=0) + rank * T) % E).to(device)
    if kind == "random":
        return torch.topk(torch.randn(T, E, generator=gen, device=device), k, dim=1).indices
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, device=device, dtype=torch.float32)
        return torch.multinomial(p.expand(T, E), k, replacement=False, generator=gen)
    raise ValueError(f"unknown routing {kind!r}")


# GPU cycles of the sleep kernel ahead of a timed loop (``host_ahead``): longer than its launches.
HEAD_START_CYCLES = int(1e9)


def _time(fn: Callable[[], object], iters: int, warmup: int, host_ahead: bool = False
          ) -> tuple[float, float]:
    """(device ms, host ms) per call, the slowest rank's (``_bench.device_and_host_ms``);
    ``host_ahead``: as in a training step, whose host runs tens of ms ahead."""
    return device_and_host_ms(fn, iters, warmup, host_ahead, HEAD_START_CYCLES)


def _graph_time(fn: Callable[[], object], iters: int) -> tuple[float, float]:
    """(device ms, host ms) per call of ``fn`` replayed from a CUDA graph.

    The graph holds two calls: a rowwise dispatch+combine is three slab phases (four
    summing at the destination), so two of them leave the slab parity where the capture found it, and consecutive
    replays alternate slabs as eager calls do.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
        fn()
    ms, host_ms = _time(graph.replay, max(1, iters // 2), 2)
    return ms / 2, host_ms / 2


def _put_ceiling(transport, row_words: int, put_bytes: int, iters: int) -> float:
    """GB/s one way: every rank stores a large buffer into the other rank's slab."""
    memory = transport.memory
    n = min(put_bytes, memory.slab_bytes) // (row_words * 4)
    src = torch.randint(0, 1 << 30, (n, row_words), dtype=torch.int32, device="cuda")
    rows = torch.arange(n, device="cuda")
    peer = torch.full((n,), (memory.rank + 1) % memory.world_size, device="cuda")

    def put():
        memory.put_rows(0, 0, src, peer, rows)
        memory.barrier()

    ms, _ = _time(put, iters, 3)
    return n * row_words * 4 / (ms * 1e-3) / 1e9


def _copy_engine_ceiling(transport, put_bytes: int, iters: int) -> float:
    """GB/s one way: every rank's copy engines move one large block into the other rank's slab."""
    from moe_ep_transport._copy_engine import copy_to

    memory = transport.memory
    n = min(put_bytes, memory.slab_bytes) // 16 * 16
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    address = memory.peer_table(0)[(memory.rank + 1) % memory.world_size].item()

    def put():
        copy_to(address, src)
        memory.barrier()

    ms, _ = _time(put, iters, 3)
    return n / (ms * 1e-3) / 1e9


def _barrier_time(transport, iters: int) -> tuple[float, float]:
    """(device ms, host ms) of one transport barrier, back to back."""
    return _time(transport.memory.barrier, 10 * iters, 10)


def _moved_bytes(dispatcher: EPDispatcher, remote: int, pairs: int, row_bytes: int, rows_out: int,
                 tokens: int) -> int:
    """Bytes one rank sends to the other rank in a dispatch + combine of this backend."""
    cfg, transport = dispatcher.cfg, dispatcher.transport
    dedup = getattr(transport, "sends_tokens_once", False)
    blocks = getattr(transport, "copy_engine", False)  # whole blocks: every token, every partial row
    there = (tokens if blocks and dedup else pairs if dedup else remote) * row_bytes
    if not dispatcher.sums_at_destination(torch.bfloat16, torch.float32):
        return there + rows_out * row_bytes
    if blocks:
        return there + cfg.max_tokens * cfg.d_model * 4
    if dedup:  # one partial per (token, other rank) holding any of its rows; weights in the metadata
        return there + pairs * cfg.d_model * 4
    # The all-to-all reference sends the weights, then a full block of max_tokens partials per rank.
    return there + remote * 4 + cfg.max_tokens * cfg.d_model * 4


def _bench_case(cfgs: dict, transports: dict, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                kind: str, iters: int, ceiling: float, graphs: bool) -> list[Row]:
    """Bare NCCL, then each backend, on one routing."""
    rank, row_bytes = dist.get_rank(), x.shape[1] * x.element_size()
    cfg = cfgs["all_to_all"]
    probe = EPDispatcher(cfg, transports["all_to_all"])
    with torch.no_grad():
        _, _, handle = probe.dispatch(x, ids)
    stats = probe.telemetry.pop()
    route = handle.route
    kept = sum(route.send_splits)
    remote = kept - route.send_splits[rank]
    # Rows a token-inbox dispatch stores into other ranks (one per token and other rank).
    plan = handle.plan
    stored_N, _ = inbox_targets(plan.dst_rank_N, plan.dst_row_N, plan.top_k, rank, cfg.max_tokens)
    pairs = int(((stored_N >= 0) & (stored_N != rank)).sum())
    payload = torch.randn(kept, x.shape[1], device=x.device).to(x.dtype)
    back = torch.empty(sum(route.recv_splits), x.shape[1], device=x.device, dtype=x.dtype)

    def nccl() -> None:
        dist.all_to_all_single(back, payload, route.recv_splits, route.send_splits)
        dist.all_to_all_single(payload, back, route.send_splits, route.recv_splits)

    nan = float("nan")
    times = {"nccl": (*_time(nccl, iters, 3), nan)}
    moved = {"nccl": 2 * remote * row_bytes}
    for name, transport in transports.items():
        dispatcher = EPDispatcher(cfgs[name], transport)
        moved[name] = _moved_bytes(dispatcher, remote, pairs, row_bytes, remote, x.shape[0])

        def both(d: EPDispatcher = dispatcher) -> None:
            with torch.no_grad():  # the weights go to dispatch too, as the MoE layer does it
                out, _, h = d.dispatch(x, ids, w)
                d.combine(out, w, h)

        def dispatch_only(d: EPDispatcher = dispatcher) -> None:
            with torch.no_grad():
                d.dispatch(x, ids)

        times[name] = (*_time(both, iters, 3), _time(dispatch_only, iters, 3)[0])
        if graphs and name.startswith("rowwise"):
            if "nccl:graph" not in times:
                times["nccl:graph"] = (*_graph_time(nccl, iters), nan)
                moved["nccl:graph"] = moved["nccl"]
            times[f"{name}:graph"] = (*_graph_time(both, iters), nan)
            moved[f"{name}:graph"] = moved[name]
    rows = []
    for name, (ms, host_ms, dms) in times.items():
        baseline = times["nccl:graph" if name.endswith(":graph") else "nccl"][0]
        rows.append(Row(
            tokens=x.shape[0], routing=kind, backend=name,
            payload_mib=kept * row_bytes / 2**20, remote_mib=remote * row_bytes / 2**20,
            moved_mib=moved[name] / 2**20,
            drop_rate=float(stats["drop_rate"]), load_imbalance=float(stats["load_imbalance"]),
            ms=ms, host_ms=host_ms, dispatch_ms=dms, gbps=2 * kept * row_bytes / (ms * 1e-3) / 1e9,
            x_nccl=baseline / ms,
            pct_put_ceiling=100 * 2 * remote * row_bytes / (ms * 1e-3) / 1e9 / ceiling,
            pct_link=100 * moved[name] / (ms * 1e-3) / 1e9 / ceiling,
        ))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384,32768")
    ap.add_argument("--routing", default="balanced,random,zipf")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--put-mib", type=int, default=1024, help="size of the plain put (capped by a slab)")
    ap.add_argument("--graphs", action="store_true",
                    help="also replay nccl and rowwise from CUDA graphs (device time without launch cost)")
    ap.add_argument("--out", default="ep_transport.json")
    args = ap.parse_args()

    device = init_nccl()
    rank, M = dist.get_rank(), dist.get_world_size()
    E, k, D, dtype = args.experts, args.top_k, args.d_model, torch.bfloat16
    tokens = sorted(int(t) for t in args.tokens.split(","))
    row_bytes = D * dtype.itemsize

    def config(T: int, combine: str = "auto", copy_engine: bool = False) -> EPConfig:
        return EPConfig(E, k, T, D, capacity_factor=args.capacity_factor, combine=combine, copy_engine=copy_engine)

    # The symmetric heap holds the largest size's slabs for the three rowwise variants (sizes
    # are benchmarked one at a time).
    largest = slab_bytes_for(config(tokens[-1]), M, row_bytes)
    nvshmem_memory.bootstrap(None, device, heap_bytes=6 * largest)
    probe = make_transport("rowwise", config(tokens[-1]), device=device)
    ceiling = _put_ceiling(probe, row_bytes // 4, args.put_mib << 20, args.iters)
    ce_ceiling = _copy_engine_ceiling(probe, args.put_mib << 20, args.iters)
    barrier_ms, barrier_host_ms = _barrier_time(probe, args.iters)
    probe.close()

    rows: list[Row] = []
    for T in tokens:
        cfgs = {"all_to_all": config(T), "rowwise": config(T), "rowwise:src": config(T, "source"),
                "rowwise:ce": config(T, copy_engine=True)}
        transports = {name: make_transport("all_to_all" if name == "all_to_all" else "rowwise", cfg,
                                           device=device)
                      for name, cfg in cfgs.items()}
        x = torch.randn(T, D, device=device).to(dtype)
        for kind in args.routing.split(","):
            ids = _routing(kind, T, E, k, rank, device)
            w = torch.softmax(torch.randn(T, k, device=device), dim=1)
            rows += _bench_case(cfgs, transports, x, ids, w, kind, args.iters, ceiling, args.graphs)
        for name, transport in transports.items():
            if name != "all_to_all":
                transport.close()

    nvshmem_memory.finalize()
    if rank == 0:
        result = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "ranks": M,
            "d_model": D, "experts": E, "top_k": k, "capacity_factor": args.capacity_factor,
            "bytes_per_row": row_bytes,
            "put_ceiling_gbps_one_way": ceiling,
            "copy_engine_ceiling_gbps_one_way": ce_ceiling,
            "barrier_ms": barrier_ms, "barrier_host_ms": barrier_host_ms,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"one-way NVLink put ceiling (both ranks putting at once): {ceiling:.0f} GB/s; "
              f"copy engines {ce_ceiling:.0f} GB/s")
        print(f"barrier alone (eager, back to back): {1e3 * barrier_ms:.1f} us device, {1e3 * barrier_host_ms:.1f} us host")
        print(f"{'tokens':>6} {'routing':>8} {'backend':>18} {'MiB':>7} {'drop%':>6} {'imbal':>5} "
              f"{'ms':>7} {'host ms':>7} {'disp ms':>7} {'GB/s':>6} {'x nccl':>6} {'% put':>6} "
              f"{'moved':>7} {'% link':>6}")
        for r in rows:
            print(f"{r.tokens:>6} {r.routing:>8} {r.backend:>18} {r.payload_mib:>7.1f} "
                  f"{100 * r.drop_rate:>6.2f} {r.load_imbalance:>5.2f} {r.ms:>7.3f} {r.host_ms:>7.3f} "
                  f"{r.dispatch_ms:>7.3f} {r.gbps:>6.0f} {r.x_nccl:>6.2f} {r.pct_put_ceiling:>6.1f} "
                  f"{r.moved_mib:>7.1f} {r.pct_link:>6.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
