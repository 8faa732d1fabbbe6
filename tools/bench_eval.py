"""What a held-out evaluation costs: ``eval.tokens`` scored against the training forward.

    # one H200: 1 Mi held-out tokens on bench-1gpu against 1.2 Mi tokens of training forward
    tools/from_source.sh python3 tools/bench_eval.py --out $OUT/bench_eval.json
    # CPU smoke run
    uv run python tools/bench_eval.py --config tiny --device cpu --eval-tokens 4096 --steps 1

Both run through the app's own ``Trainer`` on random token directories (training and
held-out data, ``tokens.json`` with the preset's vocabulary), measured by its phase timer
(CUDA events at the phase marks, no extra synchronisation):

1. eager (``train.cuda_graphs=false``, so each microbatch's forward is its own phase):
   ``--warmup`` steps, then ``--steps`` steps that each evaluate. ``forward`` is the sum
   of the step's microbatch forwards (loss included, autograd recording), scaled to
   ``--budget-tokens`` (1.2 Mi) tokens; ``eval`` the phase ``Trainer.evaluate`` marks
   (the held-out forwards, no autograd, and the all-reduce of the sum). The medians over
   the steps, and their ratio: at most 1 is the target.
2. with the preset's CUDA graphs (``bench-1gpu``; skipped where the config runs eagerly):
   steps that evaluate between replays must keep replaying the graphs captured before
   them (no recapture: the launch fingerprint is unchanged), and the losses are compared
   with the same steps of a trainer that never evaluates (the largest relative
   difference is reported; on a GPU non-deterministic kernels may make it nonzero).

A short table is printed; ``--out`` gets the JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pretrain.config import load_config, validate_layout
from pretrain.data.files import dtype_for_vocab
from pretrain.mesh import build_mesh
from pretrain.phases import PhaseTimer
from pretrain.runtime import distributed
from pretrain.trainer import Trainer

MI = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="bench-1gpu", help="preset name or TOML file")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--eval-tokens", type=int, default=MI, help="eval.tokens (default 1 Mi)")
    p.add_argument("--budget-tokens", type=int, default=MI * 6 // 5,
                   help="training tokens whose forward the evaluation is held against (1.2 Mi)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=3, help="timed steps, each evaluating")
    p.add_argument("--graph-steps", type=int, default=4,
                   help="steps of the CUDA-graph check (evaluating from the third on); 0: skip")
    p.add_argument("--out", type=Path, default=None, help="JSON file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return p.parse_args(argv)


def write_token_dir(directory: Path, n_tokens: int, vocab_size: int, seed: int) -> None:
    """Uniform random ids in a token directory (only ``dtype`` and ``vocab_size`` recorded,
    as token files from other tools)."""
    directory.mkdir(parents=True)
    dtype = dtype_for_vocab(vocab_size)
    ids = np.random.default_rng(seed).integers(0, vocab_size, n_tokens, dtype=np.int64)
    ids.astype(dtype).tofile(directory / "part-00000.bin")
    (directory / "tokens.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab_size}))


def build(a: argparse.Namespace, data: Path, device: torch.device, extra: list[str],
          timer: PhaseTimer | None = None) -> Trainer:
    cfg = load_config(a.config, [*a.overrides, f"data.path={data / 'train'}",
                                 f"data.val_path={data / 'val'}", f"eval.tokens={a.eval_tokens}",
                                 f"train.device={device.type}", "checkpoint.every=0",
                                 "checkpoint.final=false", "metrics.expert_load_every=0",
                                 "optim.schedule=constant", f"run_dir={data / 'run'}", *extra])
    return Trainer(cfg, build_mesh(validate_layout(cfg, 1), device.type), device, phase_timer=timer)


def release(trainer: Trainer) -> None:
    trainer.close()
    del trainer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_eager(a: argparse.Namespace, data: Path, device: torch.device) -> dict[str, Any]:
    """Median per-step forward and evaluation seconds of an eager trainer."""
    timer = PhaseTimer(device)
    trainer = build(a, data, device, ["train.cuda_graphs=false",
                                      f"train.steps={a.warmup + a.steps}"], timer)
    try:
        for step in range(1, a.warmup + 1):
            trainer.train_step(step)
            timer.collect()
        forward, evaluation = [], []
        for step in range(a.warmup + 1, a.warmup + a.steps + 1):
            trainer.train_step(step, evaluate=True)
            phases = timer.collect()
            forward.append(phases["forward"])
            evaluation.append(phases["eval"])
        tokens_per_step, eval_tokens = trainer.tokens_per_step, trainer.evaluator.n_tokens
        n_windows = trainer.evaluator.n_windows
    finally:
        release(trainer)
    forward_s, eval_s = statistics.median(forward), statistics.median(evaluation)
    budget_s = forward_s / tokens_per_step * a.budget_tokens
    return {"tokens_per_step": tokens_per_step, "eval_tokens": eval_tokens,
            "eval_windows": n_windows, "budget_tokens": a.budget_tokens,
            "forward_s_per_step": forward, "eval_s": evaluation,
            "forward_s_median": forward_s, "eval_s_median": eval_s,
            "budget_forward_s": budget_s, "eval_over_budget": eval_s / budget_s}


def _graph_run(a: argparse.Namespace, data: Path, device: torch.device,
               evaluate: bool) -> tuple[list[float], bool]:
    """Losses of ``--graph-steps`` graphed steps (evaluating from the third on when
    ``evaluate``), and whether the graphs captured after step 1 replayed to the end."""
    trainer = build(a, data, device, [f"train.steps={a.graph_steps}"])
    try:
        if trainer.graphs is None:
            raise SystemExit("the config runs eagerly (train.cuda_graphs=false): no graph check")
        losses = [trainer.train_step(1).record["loss"]]
        trainer.capture_graphs()
        captured = trainer.graphs.graphs
        for step in range(2, a.graph_steps + 1):
            losses.append(trainer.train_step(step, evaluate=evaluate and step >= 3).record["loss"])
        kept = trainer.graphs.graphs is captured and captured.captured
    finally:
        release(trainer)
    return losses, kept


def check_graphs(a: argparse.Namespace, data: Path, device: torch.device) -> dict[str, Any]:
    with_eval, kept = _graph_run(a, data, device, evaluate=True)
    without, _ = _graph_run(a, data, device, evaluate=False)
    diff = max(abs(x - y) / abs(y) for x, y in zip(with_eval, without, strict=True))
    return {"graphs_kept": kept, "losses_with_eval": with_eval, "losses_without_eval": without,
            "loss_max_rel_diff": diff}


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    with distributed(a.device) as rt, tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        cfg = load_config(a.config, a.overrides)
        vocab, seq = cfg.model.vocab_size, cfg.train.seq_len
        write_token_dir(data / "train", cfg.train.global_batch * seq * 2 + 1, vocab, 0)
        write_token_dir(data / "val", a.eval_tokens + seq + 1, vocab, 1)
        result: dict[str, Any] = {"config": a.config, "overrides": a.overrides,
                                  "device": str(rt.device),
                                  "gpu": torch.cuda.get_device_name(rt.device)
                                  if rt.device.type == "cuda" else None}
        result.update(measure_eager(a, data, rt.device))
        graphs = a.graph_steps > 0 and rt.device.type == "cuda" and cfg.train.cuda_graphs
        if graphs:
            result.update(check_graphs(a, data, rt.device))
    ms = 1e3
    print(f"{a.config} on {result['gpu'] or result['device']}: eval of {result['eval_tokens']:,} "
          f"held-out tokens ({result['eval_windows']} windows) vs the forward of "
          f"{result['budget_tokens']:,} training tokens")
    print("| what | ms |")
    print("|---|---|")
    print(f"| training forward, one step ({result['tokens_per_step']:,} tokens) | "
          f"{result['forward_s_median'] * ms:.1f} |")
    print(f"| training forward, {result['budget_tokens']:,} tokens (budget) | "
          f"{result['budget_forward_s'] * ms:.1f} |")
    print(f"| evaluation, {result['eval_tokens']:,} tokens | {result['eval_s_median'] * ms:.1f} |")
    print(f"eval / budget = {result['eval_over_budget']:.3f} "
          f"({'within' if result['eval_over_budget'] <= 1 else 'OVER'} the budget)")
    if graphs:
        print(f"CUDA graphs kept replaying across evaluations: {result['graphs_kept']}; "
              f"largest loss difference to a run without evaluation: {result['loss_max_rel_diff']:.2e}")
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
