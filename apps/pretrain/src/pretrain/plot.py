"""``pretrain plot RUN_DIR``: loss, throughput and expert load as PNGs beside the metrics.

Reads ``metrics.jsonl`` only, so it works on a finished run, a running one, or a
copied folder. The loss figure holds the training loss and, when the run evaluates
held-out data (``data.val_path``), the validation loss at its evaluation steps. The expert-load figure has one heatmap per MoE layer (experts
down, recorded steps across), coloured by each expert's share relative to a
uniform load on a log2 scale: white is balanced, red overloaded, blue starved,
which makes a collapsing router visible at a glance. matplotlib is imported
here only, so training never needs it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.errors import PretrainError
from pretrain.metrics import METRICS_FILE

LOAD_RANGE_LOG2 = 3.0  # colour scale: loads from 1/8 to 8 times the mean


class PlotError(PretrainError, ValueError):
    """Nothing to plot; the message names the file."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise PlotError(f"{path} does not exist (is {run_dir} a run directory?)")
    records = []
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError as e:
        raise PlotError(f"{path}: not a metrics file (not UTF-8 text: byte {e.start})") from None
    except OSError as e:
        raise PlotError(f"{path}: cannot be read: {e.strerror}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if n == len(lines):  # a running run's record, not all written yet
                    break
                raise PlotError(f"{path}:{n}: not a JSON object") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise PlotError(f"{path}:{n}: not a metrics record (a JSON object with a step)")
            records.append(record)
    if not records:
        raise PlotError(f"{path} holds no records yet")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of the records where ``key`` holds a number."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    steps, values = zip(*pts, strict=True) if pts else ((), ())
    return np.array(steps, dtype=int), np.array(values, dtype=float)


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (shorter at the start)."""
    sums = np.cumsum(np.insert(values, 0, 0.0))
    idx = np.arange(1, len(values) + 1)
    lo = np.maximum(idx - window, 0)
    return (sums[idx] - sums[lo]) / (idx - lo)


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_loss(plt: Any, records: list[dict[str, Any]], path: Path) -> None:
    fig, (ax_loss, ax_grad) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True,
                                           height_ratios=[2, 1])
    steps, loss = _series(records, "loss")
    window = max(1, len(loss) // 25)
    if window > 1:
        ax_loss.plot(steps, loss, color="tab:blue", alpha=0.3, lw=1, label="loss")
        ax_loss.plot(steps, rolling_mean(loss, window), color="tab:blue", lw=2,
                     label=f"mean of {window} steps")
    else:
        ax_loss.plot(steps, loss, color="tab:blue", lw=1.5, marker=".", label="loss")
    val_steps, val_loss = _series(records, "val_loss")
    if len(val_loss):
        ax_loss.plot(val_steps, val_loss, color="tab:orange", lw=1.5, marker="o", ms=4,
                     label="validation loss (data.val_path)")
    skipped = [r["step"] for r in records if r.get("skipped")]
    for s in skipped:
        ax_loss.axvline(s, color="tab:red", alpha=0.4, lw=1)
    title = f"Loss ({len(skipped)} skipped steps, red)" if skipped else "Loss"
    ax_loss.set(title=title, ylabel="loss (nats/token)")
    ax_loss.legend(loc="upper right")
    ax_loss.grid(alpha=0.3)

    steps, grad = _series(records, "grad_norm")
    ax_grad.plot(steps, grad, color="tab:green", lw=1)
    ax_grad.set(xlabel="step", ylabel="grad norm")
    ax_grad.grid(alpha=0.3)
    ax_lr = ax_grad.twinx()
    steps, lr = _series(records, "lr")
    ax_lr.plot(steps, lr, color="tab:gray", lw=1, ls="--")
    ax_lr.set_ylabel("learning rate (dashed)")
    _integer_steps(ax_grad)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_throughput(plt: Any, records: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    steps, tps = _series(records, "tokens_per_s")
    ax.plot(steps, tps, color="tab:blue", lw=1.5, label="tokens/s (all ranks)")
    steady = tps[1:] if len(tps) > 1 else tps  # the first step pays for warm-up
    if len(steady):
        median = float(np.median(steady))
        ax.axhline(median, color="tab:blue", ls=":", lw=1)
        ax.set_ylim(0, max(steady.max(), median) * 1.15)
        ax.set_title(f"Throughput: median {median:,.0f} tokens/s after step 1")
    ax.set(xlabel="step", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    _integer_steps(ax)
    steps_mfu, mfu = _series(records, "mfu")
    if len(mfu):
        ax_mfu = ax.twinx()
        ax_mfu.plot(steps_mfu, 100 * mfu, color="tab:orange", lw=1, label="MFU")
        ax_mfu.set_ylabel("MFU (%)", color="tab:orange")
        ax_mfu.set_ylim(0, max(100 * mfu[1:].max() if len(mfu) > 1 else 100 * mfu.max(), 1) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_expert_load(plt: Any, records: list[dict[str, Any]], path: Path) -> bool:
    rows = [(r["step"], np.asarray(r["expert_load"], dtype=float))
            for r in records if r.get("expert_load")]
    if not rows:
        return False
    steps = [s for s, _ in rows]
    load_SLE = np.stack([load for _, load in rows])  # S recorded steps, L layers, E experts
    n_steps, n_layers, n_experts = load_SLE.shape
    mean = load_SLE.mean(axis=2, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel_SLE = np.log2(np.where(mean > 0, load_SLE / mean, 1.0))
    rel_SLE = np.clip(np.nan_to_num(rel_SLE, neginf=-LOAD_RANGE_LOG2), -LOAD_RANGE_LOG2,
                      LOAD_RANGE_LOG2)

    ncols = min(n_layers, 4)
    nrows = math.ceil(n_layers / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols + 1.2, 2.8 * nrows + 0.8),
                             squeeze=False)
    step_ticks = np.unique(np.linspace(0, n_steps - 1, min(n_steps, 6)).round().astype(int))
    expert_ticks = np.arange(0, n_experts, max(1, n_experts // 8))
    image = None
    for layer, ax in enumerate(axes.flat):
        if layer >= n_layers:
            ax.set_visible(False)
            continue
        image = ax.imshow(rel_SLE[:, layer, :].T, aspect="auto", interpolation="nearest",
                          cmap="RdBu_r", vmin=-LOAD_RANGE_LOG2, vmax=LOAD_RANGE_LOG2,
                          extent=(-0.5, n_steps - 0.5, n_experts - 0.5, -0.5))
        worst = load_SLE[-1, layer].max() / max(mean[-1, layer, 0], 1e-9)
        ax.set_title(f"MoE layer {layer}: max/mean {worst:.2f} at step {steps[-1]}", fontsize=9)
        ax.set_xticks(step_ticks, [str(steps[i]) for i in step_ticks], fontsize=8)
        ax.set_yticks(expert_ticks, [str(e) for e in expert_ticks], fontsize=8)
        if layer % ncols == 0:
            ax.set_ylabel("expert")
        if layer + ncols >= n_layers:  # nothing below it
            ax.set_xlabel("step")
    fig.suptitle("Expert load: tokens per expert relative to a uniform load (log2 scale)")
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    cbar_ax = fig.add_axes((0.9, 0.12, 0.018, 0.72))
    cbar = fig.colorbar(image, cax=cbar_ax)
    ticks = np.arange(-LOAD_RANGE_LOG2, LOAD_RANGE_LOG2 + 1)
    labels = [f"{2.0 ** t:g}x" for t in ticks]
    labels[0], labels[-1] = "\u2264" + labels[0], "\u2265" + labels[-1]  # the scale is clipped
    cbar.set_ticks(ticks, labels=labels)
    cbar_ax.set_title("load /\nmean", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_run(run_dir: Path) -> list[Path]:
    """Write ``loss.png``, ``throughput.png`` and (if recorded) ``expert_load.png``."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    written = [run_dir / "loss.png", run_dir / "throughput.png"]
    _plot_loss(plt, records, written[0])
    _plot_throughput(plt, records, written[1])
    if _plot_expert_load(plt, records, run_dir / "expert_load.png"):
        written.append(run_dir / "expert_load.png")
    return written
