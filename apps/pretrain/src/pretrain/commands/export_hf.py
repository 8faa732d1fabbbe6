"""Export a checkpoint as a Hugging Face Qwen3-MoE folder (one CPU process).

    pretrain export-hf CHECKPOINT OUT_DIR [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "export a checkpoint as a Hugging Face Qwen3-MoE folder"
DTYPES = ("bfloat16", "float32")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a checkpoint directory, e.g. RUN_DIR/checkpoints/step_0000001000")
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new folder to write")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="stored weight dtype (default: bfloat16)")


def run(args: argparse.Namespace) -> int:
    from pretrain.cli import fail
    from pretrain.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
    except FileExistsError as e:
        return fail(str(e), 1)
    print(out)
    return 0
