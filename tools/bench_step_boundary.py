"""Step-boundary benchmark: gradient sync, sharded update and weight rebuild (~1B parameters).

    tools/from_source.sh python3 -m torch.distributed.run --nproc-per-node 2 \\
        tools/bench_step_boundary.py --out $OUT/step_boundary.json
    # CPU smoke run (gloo, tiny tensors):
    uv run torchrun --nproc-per-node 2 tools/bench_step_boundary.py --device cpu --d-model 64 \\
        --vocab 512 --layers 2 --iters 2 --warmup 1

The parameter set has the tensor sizes of a real MoE transformer (embedding and
head [V, D], attention q/k/v/o, norms, a router, stacked experts [E, F, D]), BF16
compute weights, replicated over all ranks (one DP group). Measured per rank,
median of ``--iters`` after ``--warmup``, then the maximum over ranks:

- gradient sync: ``MultiGroupDDP.finish_grad_sync()`` with every FP32 bucket
  pending, in ``all_reduce`` and in ``reduce_scatter`` mode;
- the optimizer: ``DistributedOptimizer.step()`` (norm, clip, fused AdamW on the
  shards, rebuild), the rebuild alone, and a step with Muon for the matrices;
- the whole boundary (sync + AdamW step) in both modes;
- NCCL's all-reduce and reduce-scatter of one flat FP32 tensor of the gradient
  bytes and all-gather of one flat BF16 tensor of the rebuilt bytes, measured in
  the same run: the ceiling our bucketed collectives are compared with
  (columns "flat GB/s" and "of flat").

Bus bandwidth = bytes a rank sends with the ring algorithm / time (nccl-tests'
"busbw"): 2(G-1)/G x size for all-reduce, (G-1)/G x size for reduce-scatter and
all-gather. The AdamW update is also reported as memory traffic (28 bytes per
owned element: read weight, grad, two moments; write weight, two moments)
against the H200's ~4.2 TB/s copy ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP
from moe_optim import DistributedOptimizer, MuonConfig, OptimConfig, ParamRule
from torch import nn

H200_COPY_BYTES_PER_S = 4.2e12
ADAMW_BYTES_PER_ELEMENT = 28


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--expert-hidden", type=int, default=1024)
    p.add_argument("--kv-dim", type=int, default=512, help="KV heads x head dim")
    p.add_argument("--vocab", type=int, default=100352)
    p.add_argument("--bucket-mb", type=float, default=64.0, help="DDP bucket cap (MiB of FP32)")
    p.add_argument("--gather-mb", type=float, default=256.0, help="rebuild all-gather buffer cap (MiB)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=None, help="JSON file (written by rank 0)")
    return p.parse_args()


class ParamsOnly(nn.Module):
    """The parameters of an MoE transformer, named as moe_model names them (no forward)."""

    def __init__(self, a: argparse.Namespace, device: torch.device) -> None:
        super().__init__()
        d, f, e = a.d_model, a.expert_hidden, a.experts

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02)

        self.embed = param(a.vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(a.layers):
            block = nn.ParameterDict({
                "attn_norm": param(d), "wq": param(d, d), "wk": param(a.kv_dim, d),
                "wv": param(a.kv_dim, d), "wo": param(d, d), "mlp_norm": param(d),
                "router": param(e, d), "w1": param(e, f, d), "w3": param(e, f, d), "w2": param(e, d, f),
            })
            self.blocks.append(block)
        self.norm = param(d)
        self.head = param(a.vocab, d)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if a.device == "cuda" \
            else torch.device("cpu")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
        """Median seconds per call on this rank, then the maximum over ranks."""
        times = []
        for _ in range(self.a.warmup + self.a.iters):
            if setup is not None:
                setup()
            self.sync()
            dist.barrier()
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        worst = torch.tensor([statistics.median(times[self.a.warmup:])], device=self.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return float(worst)

    def build(self, mode: str) -> tuple[ParamsOnly, MultiGroupDDP, DistributedOptimizer]:
        torch.manual_seed(0)
        model = ParamsOnly(self.a, self.device)
        ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                            DDPConfig(mode=mode, bucket_cap_mb=self.a.bucket_mb))
        opt = DistributedOptimizer(ddp, self.optim_config(), norm_group=dist.group.WORLD)
        return model, ddp, opt

    def optim_config(self) -> OptimConfig:
        return OptimConfig(gather_bucket_mb=self.a.gather_mb, muon=MuonConfig(ns_dtype="bfloat16"))


def measure_mode(b: Bench, mode: str) -> dict:
    """Sync, step, rebuild and the whole boundary for one DDP mode (state freed on return)."""
    world_key = tuple(range(b.world))
    model, ddp, opt = b.build(mode)
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "grad_bytes": sum(buf.numel() * buf.element_size() for _, buf in ddp.grad_buffers()),
        "sync_s": b.measure(ddp.finish_grad_sync, setup=ddp.zero_grad),
        "sync_sent": ddp.last_sync_bytes[world_key],
        "step_s": b.measure(opt.step),
        "rebuild_s": b.measure(opt.rebuild_weights),
        "boundary_s": b.measure(lambda: (ddp.finish_grad_sync(), opt.step()), setup=ddp.zero_grad),
        "rebuild_sent": opt.bytes_per_step[world_key],
        "owned": sum(s.local.numel() for k, s in opt.sharded_state().items() if k.startswith("main/")),
    }
    if mode == "reduce_scatter":
        muon = DistributedOptimizer(
            ddp, b.optim_config(), norm_group=dist.group.WORLD,
            rules=[ParamRule(lambda n, p: p.ndim >= 2 and n not in ("embed", "head")
                             and not n.endswith("router"), algorithm="muon")],
        )
        out["muon_step_s"] = b.measure(muon.step)
        out["muon_sent"] = muon.bytes_per_step[world_key]
    return out


def measure_flat(b: Bench, grad_numel: int, gathered_numel: int) -> tuple[float, float, float]:
    """The collectives on one flat tensor of the same bytes: all-reduce, reduce-scatter, all-gather."""
    flat = torch.zeros(grad_numel // b.world * b.world, dtype=torch.float32, device=b.device)
    out = torch.empty(flat.numel() // b.world, dtype=torch.float32, device=b.device)
    all_reduce = b.measure(lambda: dist.all_reduce(flat))
    reduce_scatter = b.measure(lambda: dist.reduce_scatter_tensor(out, flat))
    weights = torch.zeros(gathered_numel, dtype=torch.bfloat16, device=b.device)
    all_gather = b.measure(
        lambda: dist.all_gather_into_tensor(weights, weights[: gathered_numel // b.world]))
    return all_reduce, reduce_scatter, all_gather


def ring_factor(collective: str, world: int) -> float:
    return (2.0 if collective == "all_reduce" else 1.0) * (world - 1) / world


def main() -> None:
    a = parse_args()
    backend = "nccl" if a.device == "cuda" else "gloo"
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, device_id=torch.device("cuda", torch.cuda.current_device())
                            if a.device == "cuda" else None)
    b = Bench(a)
    rows: list[dict] = []

    def row(name: str, seconds: float, sent: int | None = None, baseline: str | None = None,
            **extra: float) -> None:
        entry = {"phase": name, "ms": seconds * 1e3, "sent_bytes_per_rank": sent,
                 "bus_gb_s": sent / seconds / 1e9 if sent else None, "baseline": baseline, **extra}
        rows.append(entry)

    results = {mode: measure_mode(b, mode) for mode in ("all_reduce", "reduce_scatter")}
    n_params, grad_bytes = results["all_reduce"]["params"], results["all_reduce"]["grad_bytes"]
    gathered_numel = results["all_reduce"]["owned"] * b.world
    nccl_ar, nccl_rs, nccl_ag = measure_flat(b, grad_bytes // 4, gathered_numel)
    ag_bytes = gathered_numel * 2

    nccl = {"all_reduce": (nccl_ar, ring_factor("all_reduce", b.world) * grad_bytes),
            "reduce_scatter": (nccl_rs, ring_factor("reduce_scatter", b.world) * grad_bytes),
            "all_gather": (nccl_ag, ring_factor("all_gather", b.world) * ag_bytes)}
    nccl_bw = {k: sent / s / 1e9 for k, (s, sent) in nccl.items()}
    ar, rs = results["all_reduce"], results["reduce_scatter"]
    row("grad sync, all_reduce mode", ar["sync_s"], ar["sync_sent"], "all_reduce")
    row("grad sync, reduce_scatter mode", rs["sync_s"], rs["sync_sent"], "reduce_scatter")
    row("weight rebuild (all-gather BF16)", rs["rebuild_s"], rs["rebuild_sent"], "all_gather")
    update_s = rs["step_s"] - rs["rebuild_s"]
    row("AdamW norm+clip+update (step - rebuild)", update_s,
        update_gb_s=ADAMW_BYTES_PER_ELEMENT * rs["owned"] / update_s / 1e9)
    row("optimizer step, AdamW (incl. rebuild)", rs["step_s"], rs["rebuild_sent"])
    row("optimizer step, Muon matrices + AdamW", rs["muon_step_s"], rs["muon_sent"])
    row("step boundary, all_reduce mode", ar["boundary_s"], ar["sync_sent"] + ar["rebuild_sent"])
    row("step boundary, reduce_scatter mode", rs["boundary_s"], rs["sync_sent"] + rs["rebuild_sent"])
    for k, (s, sent) in nccl.items():
        row(f"{backend} {k}, one flat tensor", s, int(sent))

    if b.rank == 0:
        bytes_ratio = (rs["sync_sent"] + rs["rebuild_sent"]) / (ar["sync_sent"] + ar["rebuild_sent"])
        report = {
            "world": b.world, "device": torch.cuda.get_device_name(b.device) if a.device == "cuda" else "cpu",
            "torch": torch.__version__, "params": n_params, "grad_bytes": grad_bytes,
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "nccl_bus_gb_s": nccl_bw, "step_bytes_ratio_rs_over_ar": bytes_ratio,
            "rows": rows,
        }
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(report, indent=2))
        print(f"\n{n_params / 1e9:.3f} B parameters (BF16), {grad_bytes / 2**30:.2f} GiB FP32 grads, "
              f"{b.world} ranks, bytes per step reduce_scatter/all_reduce = {bytes_ratio:.3f}")
        print(f"{'phase':44s} {'ms':>9s} {'sent MB':>9s} {'bus GB/s':>9s} {'flat GB/s':>10s} {'of flat':>8s}")
        for r in rows:
            base = nccl_bw.get(r["baseline"]) if r["baseline"] else None
            bus, sent = r["bus_gb_s"], r["sent_bytes_per_rank"]
            cells = [f"{r['phase']:44s}", f"{r['ms']:9.2f}",
                     f"{sent / 1e6:9.1f}" if sent else " " * 9,
                     f"{bus:9.1f}" if bus else " " * 9,
                     f"{base:10.1f}" if base else " " * 10,
                     f"{bus / base:8.0%}" if bus and base else " " * 8]
            if "update_gb_s" in r:
                share = r["update_gb_s"] * 1e9 / H200_COPY_BYTES_PER_S
                cells.append(f"  memory traffic {r['update_gb_s']:.0f} GB/s = {share:.0%} of 4.2 TB/s")
            print(" ".join(cells))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
