"""Export a checkpoint as a Hugging Face Qwen3-MoE folder (one CPU process).

    pretrain export-hf CHECKPOINT OUT_DIR [--dtype bfloat16|float32] [--tokenizer PATH]
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
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="PATH",
                        help="a tokenizers JSON file or a folder with tokenizer.json (default: "
                             "the tokenizer the checkpoint records)")


def run(args: argparse.Namespace) -> int:
    from pretrain.cli import fail
    from pretrain.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, args.dtype, args.tokenizer)
    except FileExistsError as e:
        return fail(str(e), 1)
    print(out)
    if not (out / "tokenizer.json").is_file():
        print("note: the checkpoint records no tokenizer (synthetic data?): the folder holds no "
              "tokenizer files; pass --tokenizer to add them", flush=True)
    return 0
