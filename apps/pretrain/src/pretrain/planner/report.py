"""Plans as text: one column per pipeline rank, one row per memory category (GiB)."""

from __future__ import annotations

from pretrain.planner.memory import GIB, MemoryPlan, not_modelled

_ROWS: tuple[tuple[str, str], ...] = (
    ("compute weights", "weights"),
    ("FP32 gradient buckets", "grads"),
    ("FP32 main weights + states", "optimizer"),
    ("low-precision weight caches", "mxfp8_caches"),
    ("routing statistics", "bookkeeping"),
    ("activations, schedule peak", "activations_peak"),
    ("  of which merged expert grads", "merged_grads_held"),
    ("optimizer-step transients", "optimizer_step_transient"),
    ("kernel workspaces", "kernel_workspaces"),
    ("= peak allocated", "peak_allocated"),
    ("allocator fragmentation", "fragmentation"),
    ("CUDA context", "cuda_context"),
    ("NCCL communicators", "nccl"),
    ("NVSHMEM symmetric heap", "nvshmem_heap"),
    ("= on the device", "device_total"),
)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:8.2f}"


def _layout(plan: MemoryPlan) -> str:
    r = plan.request
    pipe = f", {r.schedule} x{r.virtual}" if r.pp > 1 else ""
    ep = f" (ep {r.ep} x ep_dp {r.dp // r.ep}, {r.ep_backend})" if r.ep_backend != "local" else ""
    return (f"{r.world} GPUs = pp {r.pp} x dp {r.dp}{ep}{pipe}; micro batch {r.micro_batch} x "
            f"{r.seq_len}, {r.microbatches} microbatches/step; {r.optimizer}, {r.ddp_mode}, "
            f"recompute {r.model.recompute}")


def format_plan(plan: MemoryPlan, title: str) -> str:
    """The table: every category per pipeline rank, then the verdict."""
    r, m = plan.request, plan.request.model
    usable = (1 - r.headroom) * r.gpu_gib
    lines = [
        f"{title}: {plan.total_params / 1e9:.2f}B parameters, "
        f"{plan.active_params / 1e9:.2f}B active "
        f"({m.n_layers} layers, d {m.d_model}, {m.n_experts} experts top-{m.top_k}, "
        f"expert hidden {m.expert_hidden})",
        _layout(plan),
        f"expert rows per MoE layer and microbatch: {plan.capacity_rows:,}"
        + (f"; {r.mxfp8_recipe} ({r.mxfp8_gemm}"
           + (f", dense {r.fp8_dense_gemm}" if r.fp8_dense_gemm != r.mxfp8_gemm else "")
           + f"): {', '.join(r.mxfp8_targets)}"
           if r.mxfp8_targets else ""),
        "",
    ]
    ranks = plan.ranks
    header = f"{'GiB per GPU':32}" + "".join(f"{'pp ' + str(k.pp_rank):>10}" for k in ranks)
    lines.append(header)
    for label, attr in _ROWS:
        values = "".join(f"  {_gib(getattr(k, attr))}" for k in ranks)
        lines.append(f"{label:32}{values}")
    lines.append(f"{'microbatches in flight':32}" + "".join(f"{k.in_flight:>10}" for k in ranks))
    lines.append(f"{'activations held / microbatch':32}"
                 + "".join(f"  {_gib(k.activations_held_per_microbatch)}" for k in ranks))
    lines.append("(the peak takes the larger of activations and optimizer-step transients: "
                 "activations are freed before the step; an FP32 weight is its own main weight, "
                 "counted once, as a weight)")
    lines.append("")
    worst = plan.worst
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"{verdict}: worst rank (pp {worst.pp_rank}) needs {worst.device_total / GIB:.1f} GiB of "
        f"{r.gpu_gib:.0f} GiB ({usable:.0f} usable with {r.headroom:.0%} headroom); "
        f"torch.cuda.max_memory_allocated should read {worst.peak_allocated / GIB:.1f} GiB"
    )
    lines += [f"not modelled: {note}" for note in not_modelled(r)]
    return "\n".join(lines)


def summary_row(plan: MemoryPlan) -> dict[str, object]:
    """One line of a sweep: the layout and its worst rank."""
    r, w = plan.request, plan.worst
    return {
        "gpus": r.world, "pp": r.pp, "dp": r.dp, "ep": r.ep, "recompute": r.model.recompute,
        "mxfp8": f"{r.mxfp8_recipe}:{','.join(r.mxfp8_targets)}" if r.mxfp8_targets else "-",
        "micro_batch": r.micro_batch,
        "in_flight": w.in_flight, "persistent_gib": round(w.persistent / GIB, 1),
        "activations_gib": round(w.activations_peak / GIB, 1),
        "peak_allocated_gib": round(w.peak_allocated / GIB, 1),
        "device_gib": round(w.device_total / GIB, 1), "fits": plan.fits,
    }
