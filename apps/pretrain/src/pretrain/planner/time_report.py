"""Predicted step times as text: the step, throughput and MFU, then what the step is made of."""

from __future__ import annotations

from pretrain.planner.memory import not_modelled
from pretrain.planner.step_time import StepTime

_COMPUTE = (("expert grouped GEMMs", "expert_gemm"), ("dense GEMMs", "dense_gemm"),
            ("attention", "attention"), ("memory-bound kernels", "memory_bound"),
            ("launch gaps / host waits", "launch_gaps"), ("optimizer", "optimizer"),
            ("weight rebuild (local)", "weight_rebuild"))
_COMM = (("EP dispatch/combine all-to-all", "ep_all_to_all"),
         ("DP gradient reduction", "dp_grad_sync"), ("weight all-gather", "weight_all_gather"),
         ("PP sends", "pp_sends"))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f}"


def format_step_time(st: StepTime) -> str:
    """The prediction and its breakdown (ms per step, busiest rank)."""
    r = st.request
    nodes = -(-r.world // st.gpus_per_node)
    lines = [
        f"predicted step time (profile {st.profile}; {r.world} GPU{'s' if r.world > 1 else ''} "
        f"on {nodes} node"
        f"{'s' if nodes > 1 else ''} of {st.gpus_per_node}; CUDA graphs "
        f"{'on' if st.cuda_graphs else 'off'}): a prediction, not a measurement",
        f"  step {st.step_s * 1e3:,.1f} ms = compute {st.compute_s * 1e3:,.1f} + exposed "
        f"communication {st.exposed_comm_s * 1e3:,.1f} + pipeline bubble {st.bubble_s * 1e3:,.1f}",
        f"  {st.tokens_per_s:,.0f} tokens/s, {st.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"MFU {st.mfu:.1%}",
        "",
        f"  {'ms per step':34}{'time':>10}",
    ]
    lines += [f"  {label:34}{_ms(st.compute[key])}" for label, key in _COMPUTE]
    lines.append(f"  {'':34}{'total':>10}{'exposed':>10}")
    chunks = r.ep_overlap_chunks if r.ep > 1 else 1
    for label, key in _COMM:
        if key == "ep_all_to_all" and chunks > 1:
            label = f"EP dispatch/combine, {chunks} chunks"
        elif key == "ep_all_to_all" and r.ep > 1 and r.ep_overlap_microbatches:
            label = "EP dispatch/combine, interleaved"
        lines.append(f"  {label:34}{_ms(st.comm[key])}{_ms(st.exposed[key])}")
    lines.append(f"  {'pipeline bubble':34}{_ms(st.bubble_s)}")
    lines += [f"  not modelled: {note}" for note in not_modelled(r)]
    return "\n".join(lines)


def time_row(st: StepTime) -> dict[str, object]:
    """One line of a time sweep."""
    return {"step_s": round(st.step_s, 3), "tokens_per_s_per_gpu": round(st.tokens_per_s_per_gpu),
            "mfu": round(st.mfu, 4), "compute_s": round(st.compute_s, 3),
            "exposed_comm_s": round(st.exposed_comm_s, 3), "bubble_s": round(st.bubble_s, 3)}
