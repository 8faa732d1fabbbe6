"""Tokenize a corpus into a token directory for data.path.

    pretrain prepare-data INPUTS... --out DIR [--tokenizer TOKENIZER_JSON] [--text-field NAME]
                                    [--eos-id ID] [--workers N]
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "tokenize a corpus into a token directory for data.path"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUTS",
                        help="files, directories (every file below, sorted) or globs, in this "
                             "order: .jsonl / .jsonl.gz (a document per line), .parquet (a "
                             "document per row), anything else plain text (one document a file)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output token directory (must not hold token files yet)")
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="TOKENIZER_JSON",
                        help="a tokenizers JSON file (default: bytes, end of text 256, vocab 257)")
    parser.add_argument("--text-field", default="text", metavar="NAME",
                        help="the JSONL field / parquet column holding the text (default: text)")
    parser.add_argument("--eos-id", type=int, default=None, metavar="ID",
                        help="the id ending each document (default: the tokenizer's end-of-text "
                             "special token)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizing processes (default: every core)")


def run(args: argparse.Namespace) -> int:
    import sys

    from pretrain.cli import fail
    from pretrain.data import default_workers, prepare_data

    try:
        done = prepare_data(args.inputs, args.out, args.tokenizer, text_field=args.text_field,
                            eos_id=args.eos_id, workers=default_workers() if args.workers is None else args.workers,
                            progress=True)
    except OSError as e:  # --out not writable, a full disk
        return fail(str(e), 1)
    if done.replaced:
        print(f"replaced the unfinished output of an earlier run ({done.replaced})", file=sys.stderr)
    print(f"wrote {done.n_tokens:,} tokens of {done.n_documents:,} documents from {done.n_inputs} "
          f"input file(s) ({done.dtype}, vocab {done.vocab_size}, end of text {done.eos_id}) in "
          f"{len(done.files)} file(s) to {done.directory}")
    return 0
