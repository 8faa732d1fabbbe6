"""Tokenize text files into a token directory for data.path.

    pretrain prepare-data FILES... --out DIR [--tokenizer TOKENIZER_JSON]
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "tokenize text into a token directory for data.path"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", type=Path, metavar="FILES",
                        help="text files, concatenated in this order")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output token directory (must not hold token files yet)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="TOKENIZER_JSON",
                        help="a tokenizers JSON file (default: bytes, vocab 256)")


def run(args: argparse.Namespace) -> int:
    from pretrain.cli import fail
    from pretrain.data import prepare_data

    try:
        done = prepare_data(args.files, args.out, args.tokenizer)
    except OSError as e:  # an input unreadable, --out not writable
        return fail(str(e), 1)
    print(f"wrote {done.n_tokens:,} tokens ({done.dtype}, vocab {done.vocab_size}) in "
          f"{len(done.files)} file(s) to {done.directory}")
    return 0
