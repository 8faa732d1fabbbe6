"""FP8 experts against BF16 on real text: loss curves, held-out loss and the 1% target.

    # one H200, in chunks of 500 steps: the same command again continues every recipe's run from its
    # last checkpoint until --steps (the JSON and the plot hold the curves so far after
    # every call; the run root must still be there for the next call)
    tools/from_source.sh python3 tools/bench_fp8_convergence.py --resume --chunk-steps 500 \\
        --run-root runs/fp8_convergence --out $OUT/fp8_convergence.json \\
        --plot $OUT/fp8_convergence.png
    # CPU smoke run (tests/test_bench_fp8_convergence.py runs one like it)
    uv run python tools/bench_fp8_convergence.py --config tiny --recipes bf16 fp8_rowwise \\
        --steps 8 --run-root runs/conv_cpu --out conv.json

Every recipe trains the same model from the same seed on the same data in the same
order through the app's own ``pretrain.train.train``; only the GEMMs of the routed
experts (and of the layers ``--targets`` adds) differ: ``bf16`` is the plain model (no
``mxfp8.targets``; on a CPU it computes in FP32), every other recipe is
``mxfp8.targets=[<--targets>] mxfp8.recipe=<recipe> mxfp8.gemm=<--gemm>`` (and
``mxfp8.dense_gemm=<--dense-gemm>``, given one). Each recipe's run directory is ``<run-root>/<recipe>``; its
``metrics.jsonl`` holds the curves the report reads.

The default config, ``fp8-conv-450m``, is ``bench-1gpu``'s shapes (d_model 2048, 16
heads, expert hidden 1024) with 4 layers of 16 experts, top-4: 446M parameters, 143M
active, 64 Ki tokens per step (32 x 2048), AdamW at 1e-3 (not tuned), 100 warm-up
steps, cosine to 0.1 over 2,000 steps. Its data is real text: this interpreter's Python
sources, the standard library's and the installed packages' (``python_sources``; beside
torch 2.11 and its dependencies about 430M byte tokens) written as byte tokens by the
app's ``prepare-data`` (``pretrain.data.prepare_data``), every ``HELD_OUT_EVERY``-th
file (5%) held out, so the held-out loss scores files the model never trained on.
2,000 steps read 131M tokens, under one pass; a run that would read its training data
more than once is refused (``--allow-repeat`` to run it anyway): repeated data turns the
comparison into one of memorisation. ``--corpus`` names other text, ``--data`` /
``--val-data`` prepared token directories.

GPU time, an estimate (not measured): 6 x 143M active parameters + attention = 0.96
GFLOP per token; at bench-1gpu's measured model FLOP rate (106.4k tokens/s x 4.56 GFLOP
per token = 485 TFLOP/s, docs/performance.md) that is ~505k tokens/s: 4.3 minutes for
2,000 steps of 64 Ki tokens with BF16 experts, 5.5 with FP8 experts (the bench-1gpu step
with native ``fp8_rowwise_gw_hp`` experts runs at 0.78x BF16's), 15.4 minutes for the
three default recipes, plus an evaluation of 1 Mi held-out tokens every 100 steps, the
checkpoints, preparing the data (once, under a second) and the start of each run. A
smaller model keeps less of the GPU busy, so count on 20 to 25 minutes in all;
``--chunk-steps 500`` makes four calls of about 5 to 7 minutes each. The tool prints its
own estimate for each call before training.

Chunks: ``--chunk-steps N`` trains each recipe at most N more steps per call
(``train.stop_after``, which checkpoints), recipe after recipe, so after every call
all curves reach the same step; the app also checkpoints every ``--checkpoint-every``
steps and on SIGTERM, after which the tool stops and a ``--resume`` call continues.
Without ``--resume`` the run root must be new (nothing is overwritten).

Reported per recipe (``--out`` JSON, a table printed last): the training-loss curve
(step, loss), the held-out curve (step, val_loss at the evaluation steps), the median
tokens/s of the steps without an evaluation, the final loss (the mean training loss of
the last ``--tail`` steps all recipes have run) and the final held-out loss (at the last
evaluation all have run), and each one's relative difference to ``bf16``'s, PASS when
within ``TARGET_REL_DIFF``. ``--plot`` draws the curves and the relative difference.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from moe_ckpt.directory import committed_steps
from moe_model import active_params, flops_per_token, total_params
from pretrain.checkpoint import CHECKPOINT_DIR
from pretrain.config import PretrainConfig, load_config
from pretrain.data import prepare_data, resolve_vocab_size
from pretrain.data.files import SIDECAR, UNFINISHED_MARKER, open_token_files
from pretrain.data.inputs import expand_inputs
from pretrain.data.sources import python_files, stdlib_sources
from pretrain.errors import PretrainError
from pretrain.metrics import METRICS_FILE
from pretrain.plot import read_metrics, rolling_mean
from pretrain.train import train

TARGET_REL_DIFF = 0.01  # FP8's final loss within 1% of BF16's
BASELINE = "bf16"
RECIPES = (BASELINE, "fp8_rowwise_gw_hp", "fp8_rowwise", "fp8_blockwise", "fp8_blockwise_gw_fp8", "mxfp8")
HELD_OUT_EVERY = 20  # every 20th corpus file (sorted order) is held out: 5%
# bench-1gpu's model FLOP rate on one H200: 106.4k tokens/s x 4.5615 GFLOP per token
# (docs/performance.md, `tools/bench_train_step.py --config bench-1gpu`); for the estimate
REFERENCE_FLOPS_PER_S = 106.4e3 * 4.5615e9
# the bench-1gpu step with native fp8_rowwise_gw_hp experts against BF16's: 83,467 / 106,973
# tokens/s (docs/performance.md, `tools/bench_train_step.py --config bench-1gpu ...
# mxfp8.targets=experts mxfp8.recipe=fp8_rowwise_gw_hp mxfp8.gemm=native`); for the estimate
FP8_STEP_RATIO = 0.78

# Named configs: a preset and the overrides on top of it.
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "fp8-conv-450m": ("bench-1gpu", [
        "model.n_layers=4", "model.n_experts=16", "model.top_k=4",
        "train.seq_len=2048", "train.global_batch=32", "train.micro_batch=8",
        "optim.lr=1e-3", "optim.warmup_steps=100", "optim.schedule=cosine",
    ]),
}
DEFAULT_CONFIG = "fp8-conv-450m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="+", choices=RECIPES,
                   default=[BASELINE, "fp8_rowwise_gw_hp", "fp8_rowwise"],
                   help=f"expert recipes; {BASELINE} (the reference) must be among them")
    p.add_argument("--gemm", choices=["native", "triton", "emulated"], default=None,
                   help="mxfp8.gemm of the FP8 recipes (default: native on CUDA, else emulated)")
    p.add_argument("--dense-gemm", choices=["native", "triton", "emulated"], default=None,
                   help="mxfp8.dense_gemm of the FP8 recipes: the GEMM of the dense layers "
                        "--targets adds (default: --gemm's)")
    p.add_argument("--fast-accum", nargs="*", default=None, metavar="ROLE",
                   help="mxfp8.fp8_fast_accum of the FP8 recipes: the GEMM roles (output, "
                        "grad_input, grad_weight) run with fast accumulation (default: the "
                        "package's, output)")
    p.add_argument("--targets", nargs="+", default=["experts"], metavar="GLOB",
                   help="mxfp8.targets of the low-precision recipes (default: experts; e.g. "
                        "experts attn.w? head for the dense layers too)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"a named config ({', '.join(CONFIGS)}), a preset or a TOML file")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps of every run")
    p.add_argument("--chunk-steps", type=int, default=0,
                   help="train each recipe at most this many more steps in this call (0: to --steps)")
    p.add_argument("--checkpoint-every", type=int, default=250, help="checkpoint.every")
    p.add_argument("--eval-every", type=int, default=None,
                   help="eval.every (default: --steps / 20) when there is held-out data")
    p.add_argument("--tail", type=int, default=None,
                   help="steps whose mean training loss is the final loss (default: 100, at "
                        "most 5%% of --steps)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", nargs="+", default=None, metavar="PATH",
                   help="text files, folders or globs (as prepare-data reads them) split into "
                        "training and held-out files, written as byte tokens (default: the "
                        "Python sources of this interpreter: standard library and installed "
                        "packages)")
    p.add_argument("--data", default=None, help="a prepared token directory to train on")
    p.add_argument("--val-data", default=None, help="with --data: a held-out token directory")
    p.add_argument("--allow-repeat", action="store_true",
                   help="train even when --steps read the training data more than once")
    p.add_argument("--run-root", type=Path, default=Path("runs/fp8_convergence"))
    p.add_argument("--resume", action="store_true",
                   help="continue the runs under --run-root (or start them there)")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    p.add_argument("--plot", type=Path, default=None, help="PNG file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    a = p.parse_args(argv)
    if len(set(a.recipes)) != len(a.recipes):
        p.error(f"--recipes names a recipe twice: {' '.join(a.recipes)}")
    if BASELINE not in a.recipes:
        p.error(f"--recipes must include {BASELINE}, the reference")
    if a.steps < 1 or a.chunk_steps < 0 or a.checkpoint_every < 0:
        p.error("--steps must be >= 1, --chunk-steps and --checkpoint-every >= 0")
    if a.val_data is not None and a.data is None:
        p.error("--val-data needs --data")
    if a.data is not None and a.corpus is not None:
        p.error("--corpus and --data exclude each other")
    if a.tail is None:
        a.tail = max(1, min(100, a.steps // 20))
    if a.eval_every is None:
        a.eval_every = max(1, a.steps // 20)
    if a.gemm is None:
        cuda = a.device != "cpu" and torch.cuda.is_available()
        a.gemm = "native" if cuda else "emulated"
    return a


# -- data ------------------------------------------------------------------------------

def split_corpus(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Training and held-out files: every ``HELD_OUT_EVERY``-th file (from the
    ``HELD_OUT_EVERY // 2``-th on) held out, so both halves sample the whole corpus."""
    held = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    kept = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    if not held or not kept:
        raise SystemExit(f"bench_fp8_convergence: error: the corpus has {len(files)} files; "
                         f"a held-out split needs at least {HELD_OUT_EVERY // 2 + 1}")
    return kept, held


def python_sources() -> list[Path]:
    """This interpreter's Python sources: the standard library's ``.py`` files, then those of
    the installed packages (``purelib`` / ``platlib``), each sorted by path. The standard
    library alone (10M byte tokens) is far too little: 2,000 steps of 64 Ki tokens would
    repeat it 13 times, and the curves would then compare how fast each recipe memorises."""
    files = stdlib_sources()
    for root in sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")}):
        files += python_files(root, lambda d: d.startswith("."))
    return files


def corpus_files(paths: list[str] | None) -> list[Path]:
    """The corpus files, in ``prepare-data``'s order (``pretrain.data.inputs``)."""
    return python_sources() if paths is None else [f.path for f in expand_inputs(paths)]


def training_epochs(cfg: PretrainConfig, steps: int) -> float:
    """How many times ``steps`` steps read the training data (``data.path``) over."""
    tokens = open_token_files(cfg.data.path, cfg.model.vocab_size, verify=False).n_tokens
    return steps * cfg.train.global_batch * cfg.train.seq_len / max(tokens, 1)


def _prepared(directory: Path, files: list[Path]) -> Path:
    """``directory`` as a byte-token directory of ``files``; kept when a finished one is there."""
    if (directory / SIDECAR).is_file() and not (directory / UNFINISHED_MARKER).exists():
        return directory
    done = prepare_data(files, directory)  # bytes: one process keeps up
    print(f"wrote {done.n_tokens:,} tokens of {done.n_documents:,} files to {directory}",
          flush=True)
    return directory


def resolve_data(a: argparse.Namespace) -> tuple[str, str | None, dict[str, Any]]:
    """The training and held-out token directories, and what they were made from."""
    if a.data is not None:
        return a.data, a.val_data, {"data": a.data, "val_data": a.val_data}
    train_files, held_files = split_corpus(corpus_files(a.corpus))
    root = a.run_root / "data"
    data = _prepared(root / "train", train_files)
    held = _prepared(root / "held_out", held_files)
    source = "the Python sources (standard library and installed packages) of Python " \
        + sys.version.split()[0] if a.corpus is None else f"{a.corpus}"
    return str(data), str(held), {"corpus": source, "train_files": len(train_files),
                                  "held_out_files": len(held_files), "held_out_every": HELD_OUT_EVERY,
                                  "data": str(data), "val_data": str(held)}


# -- configs ---------------------------------------------------------------------------

def recipe_overrides(recipe: str, gemm: str, fast_accum: list[str] | None = None,
                     targets: tuple[str, ...] = ("experts",), dense_gemm: str | None = None) -> list[str]:
    """The config keys of ``recipe``; ``fast_accum`` and ``dense_gemm`` (the FP8 recipes'
    settings, None: the package's defaults) are left out of ``mxfp8``, which has neither."""
    if recipe == BASELINE:
        return ["mxfp8.targets=[]"]
    keys = [f"mxfp8.targets=[{','.join(targets)}]", f"mxfp8.recipe={recipe}", f"mxfp8.gemm={gemm}"]
    if fast_accum is not None and recipe != "mxfp8":
        keys.append(f"mxfp8.fp8_fast_accum=[{','.join(fast_accum)}]")
    if dense_gemm is not None and recipe != "mxfp8":
        keys.append(f"mxfp8.dense_gemm={dense_gemm}")
    return keys


def recipe_config(a: argparse.Namespace, recipe: str, data: str, val: str | None,
                  stop_after: int | None) -> PretrainConfig:
    """The run config of ``recipe``: the named config, the benchmark's run keys, the user's
    overrides, then the recipe's keys (nothing else differs between the recipes)."""
    preset, named = CONFIGS.get(a.config, (a.config, []))
    user_keys = {o.partition("=")[0].strip() for o in a.overrides}
    run = [f"seed={a.seed}", f"train.steps={a.steps}", f"data.path={data}",
           f"checkpoint.every={a.checkpoint_every}", "checkpoint.final=true",
           "checkpoint.keep_last=1", "checkpoint.resume=auto", "metrics.expert_load_every=0",
           f"train.device={a.device}",
           f"train.stop_after={'none' if stop_after is None else stop_after}",
           f"run_dir={a.run_root / recipe}"]
    if val is not None:
        run += [f"data.val_path={val}", f"eval.every={a.eval_every}"]
    if a.gemm == "emulated" or a.device == "cpu" or not torch.cuda.is_available():
        # emulated FP8 GEMMs read the expert offsets on the host; every recipe runs alike
        run.append("train.cuda_graphs=false")
    cfg = load_config(preset, [*named, *run, *a.overrides,
                                      *recipe_overrides(recipe, a.gemm, a.fast_accum, a.targets, a.dense_gemm)])
    if "model.vocab_size" not in user_keys:  # the data's, as a run without a preset takes it
        cfg.key_sources.pop("model.vocab_size", None)
        resolve_vocab_size(cfg)
    return cfg


def steps_done(run_dir: Path) -> int:
    """The step of the run's latest committed checkpoint (0: none)."""
    steps = committed_steps(run_dir / CHECKPOINT_DIR) if (run_dir / CHECKPOINT_DIR).is_dir() else {}
    return max(steps, default=0)


def estimate_minutes(cfg: PretrainConfig, steps: int, recipe: str) -> float:
    """GPU minutes of ``steps`` steps of ``recipe`` at bench-1gpu's measured model FLOP rate
    (slowed by its measured FP8 step ratio for an FP8 recipe): an estimate."""
    t = cfg.train
    flops = flops_per_token(cfg.model, t.seq_len) * t.global_batch * t.seq_len * steps
    return flops / REFERENCE_FLOPS_PER_S / 60 / (1.0 if recipe == BASELINE else FP8_STEP_RATIO)


# -- report ----------------------------------------------------------------------------

def curves(run_dir: Path) -> dict[str, Any]:
    """The run's training and held-out curves and its median tokens/s (over the steps
    without an evaluation where there are any: an evaluating step's time includes it)."""
    if not (run_dir / METRICS_FILE).is_file():
        return {"loss": [], "val_loss": [], "tokens_per_s": None}
    records = read_metrics(run_dir)
    speeds = [r["tokens_per_s"] for r in records if "val_loss" not in r] \
        or [r["tokens_per_s"] for r in records]
    return {"loss": [{"step": r["step"], "loss": r["loss"]} for r in records],
            "val_loss": [{"step": r["step"], "val_loss": r["val_loss"]}
                         for r in records if "val_loss" in r],
            "tokens_per_s": statistics.median(speeds) if speeds else None}


def rel_diff(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return (value - reference) / reference


def summarise(runs: dict[str, dict[str, Any]], tail: int) -> dict[str, Any]:
    """Final losses over the steps every run has, and their differences to the baseline."""
    common = min((len(r["loss"]) for r in runs.values()), default=0)
    val_steps = set.intersection(*({v["step"] for v in r["val_loss"]} for r in runs.values()))
    last_val = max(val_steps, default=None)
    window = (max(0, common - tail), common)
    for r in runs.values():
        losses = [p["loss"] for p in r["loss"][window[0]:window[1]]]
        r["final_loss"] = statistics.fmean(losses) if losses else None
        r["final_val_loss"] = next((v["val_loss"] for v in r["val_loss"] if v["step"] == last_val),
                                   None)
    base = runs[BASELINE]
    for r in runs.values():
        r["rel_diff_loss"] = rel_diff(r["final_loss"], base["final_loss"])
        r["rel_diff_val_loss"] = rel_diff(r["final_val_loss"], base["final_val_loss"])
        checks = [d for d in (r["rel_diff_loss"], r["rel_diff_val_loss"]) if d is not None]
        r["pass"] = bool(checks) and all(abs(d) <= TARGET_REL_DIFF for d in checks)
    first = runs[BASELINE]["loss"]
    return {"common_steps": common, "tail_steps": [first[window[0]]["step"], first[window[1] - 1]["step"]]
            if common else None, "val_step": last_val}


def print_table(report: dict[str, Any]) -> None:
    s = report["summary"]
    print(f"final loss: mean of steps {s['tail_steps']} (of {report['steps']}); held-out loss at "
          f"step {s['val_step']}; target |diff| <= {TARGET_REL_DIFF:.0%} of {BASELINE}")

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    head = ("recipe", "steps", "tok/s", "loss", "diff", "val loss", "diff", "verdict")
    print(" ".join(f"{h:>17}" for h in head))
    for name, r in report["recipes"].items():
        verdict = "reference" if name == BASELINE else "PASS" if r["pass"] else "FAIL"
        cells = [name, str(len(r["loss"])), num(r["tokens_per_s"], ",.0f"),
                 num(r["final_loss"], ".4f"), num(r["rel_diff_loss"], "+.2%"),
                 num(r["final_val_loss"], ".4f"), num(r["rel_diff_val_loss"], "+.2%"), verdict]
        print(" ".join(f"{c:>17}" for c in cells))


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_val, ax_diff) = plt.subplots(1, 3, figsize=(16, 4.5))
    tail = report["tail"]
    smoothed: dict[str, tuple[list[int], list[float]]] = {}
    for name, r in report["recipes"].items():
        steps = [p["step"] for p in r["loss"]]
        losses = [p["loss"] for p in r["loss"]]
        mean = rolling_mean(np.array(losses, dtype=float), tail).tolist()
        smoothed[name] = (steps, mean)
        ax_loss.plot(steps, mean, label=name)
        ax_val.plot([v["step"] for v in r["val_loss"]], [v["val_loss"] for v in r["val_loss"]],
                    marker="o", ms=3, label=name)
    base_steps, base = smoothed[BASELINE]
    for name, (steps, mean) in smoothed.items():
        if name != BASELINE:
            n = min(len(mean), len(base))
            ax_diff.plot(steps[:n], [100 * (m - b) / b for m, b in zip(mean[:n], base[:n],
                                                                      strict=True)], label=name)
    for bound in (-100 * TARGET_REL_DIFF, 100 * TARGET_REL_DIFF):
        ax_diff.axhline(bound, color="grey", ls="--", lw=0.8)
    ax_loss.set(title=f"training loss (mean of {tail} steps)", xlabel="step", ylabel="loss")
    ax_val.set(title="held-out loss", xlabel="step", ylabel="loss")
    ax_diff.set(title=f"training loss vs {BASELINE} (%)", xlabel="step", ylabel="%")
    for ax in (ax_loss, ax_val, ax_diff):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['config']}: {report['params']['total']:,} parameters, "
                 f"{report['params']['active']:,} active; experts' GEMMs {report['gemm']} "
                 f"(FP8 recipes); {report['gpu'] or 'CPU'}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Plan:
    """A recipe's run in this call: from step ``done`` to ``target`` with ``cfg``."""

    recipe: str
    done: int
    target: int
    cfg: PretrainConfig


def plan_run(a: argparse.Namespace, recipe: str, data: str, val: str | None) -> Plan:
    """The recipe's run in this call: to ``--steps``, or ``--chunk-steps`` past its last
    checkpoint (``train.stop_after``)."""
    done = steps_done(a.run_root / recipe)
    target = max(done, a.steps if a.chunk_steps == 0 else min(a.steps, done + a.chunk_steps))
    stop_after = None if target == a.steps else target
    return Plan(recipe, done, target, recipe_config(a, recipe, data, val, stop_after))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    try:
        return run(a)
    except PretrainError as e:  # a bad config, data or run directory: one line
        raise SystemExit(f"bench_fp8_convergence: error: {e}") from None


def run(a: argparse.Namespace) -> dict[str, Any]:
    if not a.resume and a.run_root.exists() and any(a.run_root.iterdir()):
        raise SystemExit(f"bench_fp8_convergence: error: --run-root {a.run_root} is not empty; "
                         "add --resume to continue its runs, or name a new one")
    new_root = not a.run_root.exists()
    a.run_root.mkdir(parents=True, exist_ok=True)
    try:
        data, val, data_info = resolve_data(a)
        plans = [plan_run(a, recipe, data, val) for recipe in a.recipes]  # all checked first
        cfg = plans[0].cfg
        epochs = training_epochs(cfg, a.steps)
        if epochs > 1 and not a.allow_repeat:
            raise SystemExit(
                f"bench_fp8_convergence: error: {a.steps} steps would read the training data "
                f"{epochs:.1f} times: the curves would compare memorisation; give more text "
                "(--corpus, --data), fewer --steps, or --allow-repeat")
    except BaseException:
        if new_root:  # a config or the data refused: leave no half-made run root behind
            shutil.rmtree(a.run_root)
        raise
    params = {"total": total_params(cfg.model), "active": active_params(cfg.model)}
    todo = sum(p.target - p.done for p in plans)
    minutes = sum(estimate_minutes(p.cfg, p.target - p.done, p.recipe) for p in plans)
    print(f"{a.config}: {params['total']:,} parameters, {params['active']:,} active; "
          f"{todo} steps to train in this call over {len(plans)} recipes, about "
          f"{minutes:.1f} GPU minutes at bench-1gpu's FLOP rate (an estimate)", flush=True)
    report: dict[str, Any] = {
        "config": a.config, "overrides": a.overrides, "steps": a.steps, "seed": a.seed,
        "gemm": a.gemm, "tail": a.tail, "target_rel_diff": TARGET_REL_DIFF,
        "params": params, "data": {**data_info, "epochs": epochs}, "gpu": torch.cuda.get_device_name()
        if a.device != "cpu" and torch.cuda.is_available() else None,
        "torch": torch.__version__, "recipes": {}, "complete": False, "summary": {}}
    stopped = False
    for plan in plans:
        if plan.target > plan.done and not stopped:
            train(plan.cfg)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            reached = steps_done(a.run_root / plan.recipe)
            stopped = reached < plan.target  # stopped by a signal: leave the rest for --resume
        keys = recipe_overrides(plan.recipe, a.gemm, a.fast_accum, a.targets, a.dense_gemm)
        report["recipes"][plan.recipe] = {"overrides": keys,
                                          "run_dir": str(a.run_root / plan.recipe),
                                          **curves(a.run_root / plan.recipe)}
        if a.out is not None:  # the curves so far, after every run
            _write(report, a)
    report["complete"] = all(steps_done(a.run_root / p.recipe) == a.steps for p in plans)
    _write(report, a)
    if a.plot is not None:
        plot(report, a.plot)
    print_table(report)
    if not report["complete"]:
        print(f"not finished: run the same command with --resume to train on to step {a.steps}")
    return report


def _write(report: dict[str, Any], a: argparse.Namespace) -> None:
    report["summary"] = summarise(report["recipes"], a.tail) \
        if BASELINE in report["recipes"] else {}
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(a.out.suffix + ".partial")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(a.out)


if __name__ == "__main__":
    main()
