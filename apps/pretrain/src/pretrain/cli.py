"""The ``pretrain`` command.

    uv run pretrain                                      # the embedded default (stdlib bytes)
    uv run pretrain --config tiny train.steps=10         # a preset plus dotted overrides
    uv run pretrain --config my_run.toml run_dir=runs/a  # a TOML file
    torchrun --nproc-per-node 8 -m pretrain --config my_run.toml
    uv run pretrain --config tiny checkpoint.every=2 run_dir=runs/a  # resumes runs/a when rerun
    uv run pretrain export-hf runs/a/checkpoints/step_0000000004 hf/a
    uv run pretrain prepare-data docs/*.txt --out data/docs --tokenizer tokenizer.json
    uv run pretrain plot runs/a
    uv run pretrain plan --config my_run.toml

Exit status: 0 done (also after a clean stop on SIGTERM); 2 bad command line or
config (one line on stderr naming the key); 1 any other error the run reports
(bad data, a checkpoint that cannot be loaded, too many non-finite steps), also one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_ckpt import CheckpointError

from pretrain.config import PRESETS, ConfigError, load_config
from pretrain.data import DataError, prepare_data
from pretrain.export import EXPORT_DTYPES, ExportError, export_checkpoint
from pretrain.plot import PlotError, plot_run
from pretrain.train import train
from pretrain.trainer import TrainingAborted

COMMANDS = ("export-hf", "prepare-data", "plot", "plan")


def _fail(message: str, status: int) -> int:
    print(f"pretrain: error: {message}", file=sys.stderr, flush=True)
    return status


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain",
        description="Train a mixture-of-experts language model. "
                    f"Other commands: {', '.join(COMMANDS)} (pretrain COMMAND --help).",
        epilog="Overrides are dotted KEY=VALUE pairs, e.g. train.steps=10 model.n_experts=16. "
               f"Presets: {', '.join(PRESETS)}.",
    )
    parser.add_argument("--config", default=None, metavar="FILE_OR_NAME",
                        help="built-in preset name or TOML file (default: default)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config override, applied in order")
    args = parser.parse_args(argv)
    try:
        train(load_config(args.config, args.overrides))
    except ConfigError as e:
        return _fail(str(e), 2)
    except (DataError, CheckpointError, TrainingAborted) as e:
        return _fail(str(e), 1)
    return 0


def _export_hf(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain export-hf",
        description="Export a checkpoint as a Hugging Face Qwen3-MoE folder (one CPU process).",
    )
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a checkpoint directory, e.g. RUN_DIR/checkpoints/step_0000001000")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new folder to write")
    parser.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="bfloat16",
                        help="stored weight dtype (default: bfloat16)")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
    except (CheckpointError, ExportError, FileExistsError) as e:
        return _fail(str(e), 1)
    print(out)
    return 0


def _prepare_data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain prepare-data",
        description="Tokenize text files into a token directory for data.path.",
    )
    parser.add_argument("files", nargs="+", type=Path, metavar="FILES",
                        help="text files, concatenated in this order")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output token directory (must not hold token files yet)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="TOKENIZER_JSON",
                        help="a tokenizers JSON file (default: bytes, vocab 256)")
    args = parser.parse_args(argv)
    try:
        done = prepare_data(args.files, args.out, args.tokenizer)
    except (DataError, OSError) as e:  # OSError: an input unreadable, --out not writable
        return _fail(str(e), 1)
    print(f"wrote {done.n_tokens:,} tokens ({done.dtype}, vocab {done.vocab_size}) in "
          f"{len(done.files)} file(s) to {done.directory}")
    return 0


def _plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain plot",
        description="Plot a run's loss, throughput and expert load as PNGs in RUN_DIR.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a run directory holding metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.run_dir)
    except PlotError as e:
        return _fail(str(e), 1)
    for path in written:
        print(path)
    return 0


def _plan(argv: list[str]) -> int:
    from pretrain.plan import plan_command  # the planner's dependencies load only for `plan`

    return plan_command(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"export-hf": _export_hf, "prepare-data": _prepare_data, "plot": _plot,
                "plan": _plan}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return _train(argv)


if __name__ == "__main__":
    sys.exit(main())
