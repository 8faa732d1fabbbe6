"""prepare-data throughput: MB/s of text per worker with a Hugging Face byte-level BPE.

The corpus is real text found on every machine: this interpreter's standard-library
sources, one JSONL document per file, repeated up to ``--mib`` MiB. The tokenizer is
a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, ``<|endoftext|>`` as its
special token) trained here with ``tokenizers`` on the first ``--train-mib`` MiB, since
no hub is reachable. ``pretrain.data.prepare_data`` then tokenizes the corpus with 1, 2
and all cores' worker processes (wall time of the whole call: reading, workers'
start-up, encoding, writing with checksums) and its CPU time (this process and the
workers it waited for: MB per CPU-second is what a core tokenizes, whatever else the
machine runs); the outputs must be identical. The
tokenizer library's own thread pool is off in this process too (``TOKENIZERS_PARALLELISM``,
as prepare-data's worker processes set it), so that one worker is one core.

    uv run python tools/bench_prepare_data.py                      # 64 MiB, vocab 32768
    uv run python tools/bench_prepare_data.py --mib 256 --out $OUT/bench_prepare_data.json

Prints a table last and writes JSON (default ``tools/results/bench_prepare_data.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pretrain.data import default_workers, prepare_data
from pretrain.data.sources import stdlib_sources
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def write_corpus(path: Path, mib: int) -> int:
    """Standard-library sources as JSONL documents, repeated to ``mib`` MiB; bytes of text."""
    target, text_bytes = mib << 20, 0
    with path.open("w") as f:
        while text_bytes < target:
            for source in stdlib_sources():
                try:
                    text = source.read_text("utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                text_bytes += len(text.encode())
                if text_bytes >= target:
                    break
    return text_bytes


def train_tokenizer(corpus: Path, path: Path, vocab: int, train_mib: int) -> None:
    def texts():
        seen = 0
        with corpus.open() as f:
            for line in f:
                text = json.loads(line)["text"]
                seen += len(text)
                yield text
                if seen >= train_mib << 20:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(path))


def cpu_seconds() -> float:
    """User + system time of this process and of the children it has waited for."""
    return sum(getattr(resource.getrusage(who), f"ru_{kind}time")
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for kind in ("u", "s"))


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="corpus size in MiB of text")
    parser.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary size")
    parser.add_argument("--train-mib", type=int, default=8, help="MiB of text to train the BPE on")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=Path("tools/results/bench_prepare_data.json"))
    args = parser.parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before the first encode: one core per worker

    scratch = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        corpus = scratch / "corpus.jsonl"
        text_bytes = write_corpus(corpus, args.mib)
        started = time.perf_counter()
        train_tokenizer(corpus, scratch / "bpe.json", args.vocab, args.train_mib)
        print(f"corpus {text_bytes / 1e6:.1f} MB of text ({corpus.stat().st_size / 1e6:.1f} MB JSONL); "
              f"BPE vocab {args.vocab} trained in {time.perf_counter() - started:.1f} s", flush=True)
        rows, reference = [], None
        for workers in sorted({1, 2, default_workers()}):
            out = scratch / f"tokens_w{workers}"
            started, cpu = time.perf_counter(), cpu_seconds()
            done = prepare_data([corpus], out, scratch / "bpe.json", workers=workers)
            seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
            produced = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
            assert reference is None or produced == reference, f"{workers} workers wrote other bytes"
            reference = produced
            rows.append({"workers": workers, "seconds": seconds, "mb_per_s": text_bytes / seconds / 1e6,
                         "mb_per_s_per_worker": text_bytes / seconds / 1e6 / workers,
                         "cpu_seconds": cpu, "mb_per_cpu_s": text_bytes / cpu / 1e6,
                         "tokens": done.n_tokens, "documents": done.n_documents})
            print(f"{workers} worker(s): {seconds:.1f} s", flush=True)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(scratch)

    result = {"benchmark": "bench_prepare_data", "commit": commit(), "machine": platform.node(),
              "cores": default_workers(), "corpus_text_bytes": text_bytes, "vocab": args.vocab,
              "tokens_per_text_byte": rows[0]["tokens"] / text_bytes, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nprepare-data, byte-level BPE (vocab {args.vocab}), {text_bytes / 1e6:.0f} MB of JSONL "
          f"text, {default_workers()} cores")
    print(f"{'workers':>8} {'seconds':>8} {'MB/s':>8} {'MB/s/worker':>12} {'CPU s':>8} "
          f"{'MB/CPU-s':>9} {'tokens':>12}")
    for r in rows:
        print(f"{r['workers']:>8} {r['seconds']:>8.1f} {r['mb_per_s']:>8.2f} "
              f"{r['mb_per_s_per_worker']:>12.2f} {r['cpu_seconds']:>8.1f} {r['mb_per_cpu_s']:>9.2f} "
              f"{r['tokens']:>12,}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
