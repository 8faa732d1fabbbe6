"""FSDP2 baseline: the same moe_model model under PyTorch's ``fully_shard``, for the
DDP-vs-FSDP comparison (the reference report's Figure 8).

    # two H200s, bench-2gpu, 6 steps (the first 2 warm up)
    tools/from_source.sh python3 -m torch.distributed.run --nproc-per-node 2 \\
        tools/fsdp2_baseline.py --config bench-2gpu --steps 6 --out $OUT/fsdp2_2gpu.json
    # global-batch sweep at a fixed shape: add overrides as for a run
    ... tools/fsdp2_baseline.py --config bench-2gpu train.global_batch=256 --out ...
    # CPU smoke run (gloo, FP32)
    uv run python -m torch.distributed.run --nproc-per-node 2 tools/fsdp2_baseline.py \\
        --config tiny --device cpu --steps 2

What is the same as the app: the model (``moe_model``, layout-independent init),
the data and batch (``pretrain.data``: each DP rank reads its rows of every global
batch as microbatches), the loss (token sum over the global batch's token count,
auxiliary losses at the same scale), the optimizer policy (the app's
``param_rules`` resolved per parameter: no decay on vectors and the embedding,
the experts' LR multiplier), the LR schedule and clipping, the routers' bias step
once per step from the load summed over ranks.

What is FSDP2's: every block and then the root are ``fully_shard``-ed with
``reshard_after_forward=True`` (weights gathered before each use and freed after,
the report's "full reshard"), ``MixedPrecisionPolicy(param_dtype=compute dtype,
reduce_dtype=float32)``; sharded FP32 parameters are the main weights and
``torch.optim.AdamW(fused=True)`` updates them; gradients are reduce-scattered
after every microbatch's backward (FSDP's default: no ``no_sync`` window). Unlike
the app, a non-finite gradient norm does not skip the step (as in torchtitan).
FSDP2 averages gradients over the mesh, so the backward runs on ``world x loss``
to make the reduction the sum the loss normalisation expects.

The full FP32 model is built on every device before sharding (4 B/parameter:
fine up to ~30B parameters on an H200), so the initial weights equal the app's.
Only data parallelism: ``parallel.pp`` and ``parallel.ep`` must be 1, and AdamW.

Interface: ``build_fsdp2_trainer(cfg, mesh_or_group, device, phase_timer)`` returns
an object with ``step(step) -> record`` (``loss``, ``grad_norm``, ``lr``,
``tokens_per_s``, ``step_time_s``; on CUDA ``mfu`` and ``peak_mem_gib``) and the
app's phase marks (``forward``, ``backward``, ``optimizer``, ``stats``) on an
optional ``pretrain.phases.PhaseTimer``. Gradient reduce-scatters run inside
``backward`` (FSDP waits for them at the end of the root's backward). Its ``graphs``
is always ``None``, like the app's ``Trainer`` without ``train.cuda_graphs``: the
baseline runs every step eagerly whatever ``train.cuda_graphs`` says, which its
summary here and ``tools/bench_train_step.py``'s rows record (``cuda_graphs``).

Run standalone, it reports the timed steps (after ``--warmup``): the slowest rank's
median step time (and the tokens/s and MFU from it), the peak memory of the timed
steps (reset after the warm-up) as the maximum over ranks, and each phase's median,
the maximum over ranks, as ``tools/bench_train_step.py`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _bench import max_over_ranks
from moe_model import (
    ModelWiring,
    MoETransformer,
    flops_per_token,
    init_weights,
    lm_loss_sum,
    wire_model,
)
from moe_optim.config import resolve_rule
from pretrain.config import PretrainConfig, load_config
from pretrain.data import BatchReader, open_source
from pretrain.optimizer import optim_config, param_rules
from pretrain.phases import PhaseTimer
from pretrain.runtime import distributed
from pretrain.schedule import build_schedule
from pretrain.trainer import PEAK_FLOPS, StepResult, resolve_dtype
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def param_groups(model: nn.Module, cfg: PretrainConfig) -> list[dict[str, Any]]:
    """``torch.optim.AdamW`` groups from the app's optimizer policy, one per (LR scale, decay)."""
    rules, optim = param_rules(cfg.optim), optim_config(cfg.optim)
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        rule = resolve_rule(name, p, rules, optim)
        groups.setdefault((rule.lr_scale, rule.weight_decay), []).append(p)
    return [{"params": ps, "lr_scale": scale, "weight_decay": decay}
            for (scale, decay), ps in groups.items()]


def build_adamw(model: nn.Module, cfg: PretrainConfig) -> torch.optim.AdamW:
    o = cfg.optim
    return torch.optim.AdamW(param_groups(model, cfg), lr=o.lr, betas=(o.beta1, o.beta2),
                             eps=o.eps, fused=True)


def _mesh(mesh_or_group: DeviceMesh | dist.ProcessGroup | None, device: torch.device) -> DeviceMesh:
    if isinstance(mesh_or_group, DeviceMesh):
        return mesh_or_group
    return DeviceMesh.from_group(mesh_or_group or dist.group.WORLD, device.type)


class FSDP2Trainer:
    """One rank of a data-parallel FSDP2 run of ``cfg``; ``train_step`` runs one optimizer
    step (the app's ``Trainer`` interface as the benchmarks use it)."""

    def __init__(self, cfg: PretrainConfig, mesh: DeviceMesh, device: torch.device,
                 phase_timer: PhaseTimer | None = None) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if cfg.parallel.pp != 1 or cfg.parallel.ep != 1 or cfg.optim.name != "adamw":
            raise ValueError("the FSDP2 baseline runs data parallelism with AdamW only: needs "
                             f"parallel.pp=1, parallel.ep=1, optim.name=adamw (got pp="
                             f"{cfg.parallel.pp}, ep={cfg.parallel.ep}, optim={cfg.optim.name})")
        self.cfg, self.mesh, self.device, self.timer = cfg, mesh, device, phase_timer
        self.group = mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        t, m = cfg.train, cfg.model
        data_seed = cfg.seed if cfg.data.seed is None else cfg.data.seed
        source = open_source(cfg.data.path, t.seq_len, m.vocab_size, data_seed)
        self.data = BatchReader(source, data_seed, t.global_batch, t.micro_batch, self.rank,
                                self.world)
        self.dtype = resolve_dtype(t.compute_dtype, device)
        with torch.device(device):
            self.model = MoETransformer(m)
        init_weights(self.model, m, cfg.seed)
        policy = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for block in self.model.blocks.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
        self.optimizer = build_adamw(self.model, cfg)
        self.schedule = build_schedule(cfg.optim, t.steps)
        self.tokens_per_step = t.global_batch * t.seq_len  # target tokens of the global batch
        self.loss_scale = 1.0 / self.tokens_per_step
        wire_model(self.model, ModelWiring(
            aux_loss_scale=self.world * self.loss_scale,  # FSDP2 averages gradients
            count_reducer=self._sum if self.world > 1 else None))
        self.flops_per_token = flops_per_token(m, t.seq_len)
        self.graphs = None  # train.cuda_graphs is not applied: every step runs eagerly

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def _mark(self, phase: str | None) -> None:
        if self.timer is not None:
            self.timer.mark(phase)

    def train_step(self, step: int) -> StepResult:
        start = time.perf_counter()
        lr_factor = self.schedule(step)
        loss_sum = torch.zeros((), device=self.device)
        for index in range(self.data.n_microbatches):
            tokens = self.data.microbatch(step, index).to(self.device, non_blocking=True)
            self._mark("forward")
            loss = lm_loss_sum(self.model(tokens[:, :-1]), tokens[:, 1:]) * self.loss_scale
            self._mark("backward")
            (loss * self.world).backward()  # reduce-scatter averages: world x loss sums
            loss_sum += loss.detach()
        self._mark("optimizer")
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.optim.lr * lr_factor * group["lr_scale"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._mark("stats")
        self._router_bias_step()
        dist.all_reduce(loss_sum, group=self.group)
        self._mark(None)
        loss, norm = torch.stack([loss_sum, grad_norm.float()]).tolist()  # the one host sync
        elapsed = time.perf_counter() - start
        record: dict[str, Any] = {
            "step": step, "loss": loss, "grad_norm": norm, "lr": self.cfg.optim.lr * lr_factor,
            "tokens_per_s": self.tokens_per_step / elapsed, "step_time_s": elapsed,
        }
        if self.device.type == "cuda":
            flops = self.flops_per_token * record["tokens_per_s"]
            record["mfu"] = flops / (self.world * PEAK_FLOPS)
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return StepResult(record, stop=False)

    def capture_graphs(self) -> None:
        """Nothing to capture: the baseline runs every step eagerly."""

    def _router_bias_step(self) -> None:
        """Aux-loss-free balancing once per step, from the step's load summed over ranks."""
        for _, layer in self.model.moe_layers():
            counts = layer.pop_step_stats()["tokens_per_expert"]
            dist.all_reduce(counts, group=self.group)
            layer.update_bias(counts)

    def close(self) -> None:
        """Nothing to release (symmetry with the app's Trainer)."""


def build_fsdp2_trainer(cfg: PretrainConfig,
                        mesh_or_group: DeviceMesh | dist.ProcessGroup | None = None,
                        device: torch.device | None = None,
                        phase_timer: PhaseTimer | None = None) -> FSDP2Trainer:
    """The FSDP2 run of ``cfg`` over ``mesh_or_group`` (default: the world), on ``device``
    (default: this rank's GPU, else the CPU)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    return FSDP2Trainer(cfg, _mesh(mesh_or_group, device), device, phase_timer)


def summarize(trainer: FSDP2Trainer, timed: list[dict[str, Any]], device: torch.device
              ) -> dict[str, Any]:
    """The timed steps over all ranks: the slowest rank's median step time (tokens/s and
    MFU from it), the largest peak memory, each phase's largest median. Every rank calls it."""
    phases = sorted({p for r in timed for p in r["phases_s"]})
    step_s, peak, *phase_s = max_over_ranks(
        [statistics.median(r["step_time_s"] for r in timed),
         max(r.get("peak_mem_gib", 0.0) for r in timed),
         *(statistics.median(r["phases_s"].get(p, 0.0) for r in timed) for p in phases)], device)
    tokens_per_s = trainer.tokens_per_step / step_s
    summary = {"cuda_graphs": trainer.graphs is not None, "tokens_per_s": tokens_per_s,
               "step_time_s": step_s, "peak_mem_gib": peak,
               "phases_ms": {p: 1e3 * s for p, s in zip(phases, phase_s, strict=True)}}
    if device.type == "cuda":
        summary["mfu"] = trainer.flops_per_token * tokens_per_s / (trainer.world * PEAK_FLOPS)
    return summary


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-2gpu", help="preset name or TOML file")
    p.add_argument("--steps", type=int, default=6, help="steps to run (the first --warmup untimed)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--out", type=Path, default=None, help="JSON file (rank 0)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    cfg = load_config(args.config, [*args.overrides, f"train.steps={args.steps}",
                                    f"train.device={args.device}"])
    with distributed(cfg.train.device) as rt:
        timer = PhaseTimer(rt.device)
        trainer = build_fsdp2_trainer(cfg, None, rt.device, timer)
        if cfg.train.cuda_graphs and rt.rank == 0:
            print("train.cuda_graphs is not applied: the FSDP2 baseline runs eagerly", flush=True)
        records = []
        for step in range(1, args.steps + 1):
            record = trainer.train_step(step).record
            record["phases_s"] = timer.collect()
            records.append(record)
            if step == args.warmup and rt.device.type == "cuda":  # the timed steps' peak alone
                torch.cuda.reset_peak_memory_stats(rt.device)
        summary = summarize(trainer, records[args.warmup:] or records, rt.device)
        summary = {"method": "fsdp2", "config": args.config, "overrides": args.overrides,
                   "world": rt.world_size, **summary}
        if rt.rank == 0:
            if args.out is not None:
                args.out.write_text(json.dumps({"summary": summary, "steps": records}, indent=1))
            print(f"{'step':>5} {'loss':>9} {'tok/s':>10} {'ms':>8}   (rank 0)")
            for r in records:
                print(f"{r['step']:>5} {r['loss']:9.4f} {r['tokens_per_s']:10.0f} "
                      f"{1e3 * r['step_time_s']:8.1f}")
            mfu = f", MFU {summary['mfu']:.1%}" if "mfu" in summary else ""
            per_gpu = summary["tokens_per_s"] / rt.world_size
            print(f"FSDP2 {args.config} on {rt.world_size} ranks (timed steps, slowest rank): "
                  f"{summary['tokens_per_s']:.0f} tokens/s ({per_gpu:.0f} per GPU){mfu}, peak "
                  f"{summary['peak_mem_gib']:.1f} GiB (max over ranks), eager; phases (ms): "
                  + ", ".join(f"{p} {v:.1f}" for p, v in summary["phases_ms"].items()))


if __name__ == "__main__":
    main()
