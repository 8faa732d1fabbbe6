"""prepare-data on corpora: formats, documents, workers, memory, bad input, interruption, checksums."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pretrain.cli import main
from pretrain.data import (
    DataError,
    open_token_files,
    prepare_data,
    read_document_starts,
    token_dir_info,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

WORDS = ("the of and to in is was for on that with as by at from his it an were are which this "
         "be or has had one first their its new after who they have her she two been other when "
         "there all during into school time may years more most only over city some world would "
         "where later up such used many can state about national out known university united then "
         "made").split()


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, n_words)
    return "".join(w + ("\n" if i % 13 == 12 else " ") for i, w in enumerate(words)).strip() + "\n"


def _bpe_tokenizer(path: Path) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained here, with <|endoftext|> as its special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = np.random.default_rng(0)
    tok.train_from_iterator([_text(rng, 200) for _ in range(50)], trainer)
    tok.save(str(path))
    return tok


def _nested_corpus(root: Path) -> list[str]:
    """.jsonl.gz, .jsonl, .parquet and .txt files in nested folders; the documents in the
    order prepare-data reads them (sorted paths)."""
    rng = np.random.default_rng(1)
    docs = {name: [_text(rng, int(n)) for n in rng.integers(1, 300, count)]
            for name, count in [("a/b/one.jsonl.gz", 40), ("a/notes.txt", 1), ("a/rows.parquet", 30),
                                ("b.jsonl", 25), ("c/long.txt", 1)]}
    docs["a/empty.txt"] = [""]
    docs["c/long.txt"] = [_text(rng, 3000)]  # spans several blocks
    for name, texts in docs.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".txt"):
            path.write_text(texts[0])
        elif name.endswith(".parquet"):
            pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path,
                           row_group_size=7)
        else:
            lines = "".join(json.dumps({"text": t, "n": i}) + "\n" + ("\n" if i == 3 else "")
                            for i, t in enumerate(texts))  # a blank line is skipped
            path.write_bytes(gzip.compress(lines.encode()) if name.endswith(".gz") else lines.encode())
    return [t for name in sorted(docs, key=lambda n: Path(n).parts) for t in docs[name]]


def test_a_nested_corpus_gives_the_same_bytes_on_1_and_3_workers(tmp_path, monkeypatch):
    """Documents end with the tokenizer's <|endoftext|>, the index holds their starts, and the
    chunking (small here, so that chunks are many) does not depend on the worker count."""
    monkeypatch.setattr("pretrain.data.inputs.CHUNK_BYTES", 2000)
    monkeypatch.setattr("pretrain.data.inputs.BLOCK_BYTES", 3000)
    monkeypatch.setattr("pretrain.data.inputs.PARQUET_BATCH_ROWS", 4)
    tok = _bpe_tokenizer(tmp_path / "bpe.json")
    eos = tok.token_to_id("<|endoftext|>")
    docs = _nested_corpus(tmp_path / "corpus")
    outs = {}
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        done = prepare_data([tmp_path / "corpus"], out, tmp_path / "bpe.json", workers=workers,
                            shard_tokens=5000)
        assert (done.n_documents, done.n_inputs, done.eos_id) == (len(docs), 6, eos)
        outs[workers] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert outs[1] == outs[3] and len([n for n in outs[1] if n.endswith(".bin")]) > 2

    doc_ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    expected = np.array([i for ids in doc_ids for i in [*ids, eos]])
    info = token_dir_info(tmp_path / "w3")
    assert info.eos_id == eos and info.documents.count == len(docs)
    tokens = np.concatenate(open_token_files(tmp_path / "w3", info.vocab_size, verify=True).arrays)
    assert np.array_equal(tokens, expected)
    starts = read_document_starts(info)
    assert np.array_equal(starts, np.cumsum([0] + [len(ids) + 1 for ids in doc_ids[:-1]]))
    assert np.all(tokens[starts[1:] - 1] == eos) and tokens[-1] == eos
    assert np.sum(tokens == eos) == len(docs)  # the id appears nowhere else


def _peak_rss_mib(tmp_path: Path, inputs: list[Path], out: Path) -> float:
    """Peak RSS (MiB) of the largest process of a prepare-data run on 2 workers: the main
    process's high-water mark (``VmHWM``: its ``ru_maxrss`` would start at this test
    process's, which a fork and exec carry over) and the workers' ``ru_maxrss``."""
    script = ("import re, resource, sys\nfrom pretrain.cli import main\n"
              "status = main(['prepare-data', *sys.argv[2:], '--out', sys.argv[1], '--workers', '2'])\n"
              "own = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
              "print(max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024)\n"
              "sys.exit(status)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(out), *map(str, inputs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.strip().splitlines()[-1])


def _big_inputs(root: Path, mib: int) -> list[Path]:
    """``mib`` MiB of corpus: half one plain-text document, half JSONL documents."""
    root.mkdir()
    line = ("x" * 99 + "\n").encode()
    with (root / "one.txt").open("wb") as f:
        for _ in range(mib // 2):
            f.write(line * ((1 << 20) // 100))
    record = (json.dumps({"text": "y" * 4000}) + "\n").encode()
    with (root / "docs.jsonl").open("wb") as f:
        for _ in range(mib // 2):
            f.write(record * ((1 << 20) // len(record)))
    return [root / "one.txt", root / "docs.jsonl"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """8x the corpus, about the same peak memory: reading, encoding and writing stream."""
    small = _peak_rss_mib(tmp_path, _big_inputs(tmp_path / "s", 24), tmp_path / "s_out")
    large = _peak_rss_mib(tmp_path, _big_inputs(tmp_path / "l", 192), tmp_path / "l_out")
    assert large < small + 40, (small, large)
    assert large < 500


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_1_gb_corpus_needs_under_500_mb(tmp_path):
    peak = _peak_rss_mib(tmp_path, _big_inputs(tmp_path / "in", 1024), tmp_path / "out")
    assert peak < 500, peak


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[Path], str]]:
    """Each bad input and the error it must give."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "ok.txt").write_text("fine\n")
    (folder / "zz.txt").symlink_to(tmp_path / "gone.txt")  # listed, but cannot be read
    (tmp_path / "nofield.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\n{"text": \n')
    good = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(5000)))
    (tmp_path / "corrupt.jsonl.gz").write_bytes(good[:len(good) // 2] + b"\x00" * 64 + good[len(good) // 2:])
    (tmp_path / "truncated.jsonl.gz").write_bytes(good[:len(good) // 2])
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "nocolumn.parquet")
    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "null.parquet")
    (tmp_path / "data.txt.gz").write_bytes(gzip.compress(b"text"))
    return {
        "unreadable": ([folder], f"{folder / 'zz.txt'}: cannot read: No such file or directory"),
        "missing field": ([tmp_path / "nofield.jsonl"],
                          f"{tmp_path / 'nofield.jsonl'}:3: no 'text' field (--text-field); the line has 'body'"),
        "not json": ([tmp_path / "notjson.jsonl"], f"{tmp_path / 'notjson.jsonl'}:2: not a JSON line: "),
        "corrupt gzip": ([tmp_path / "corrupt.jsonl.gz"], f"{tmp_path / 'corrupt.jsonl.gz'}:"),
        "truncated gzip": ([tmp_path / "truncated.jsonl.gz"], f"{tmp_path / 'truncated.jsonl.gz'}:"),
        "no column": ([tmp_path / "nocolumn.parquet"],
                      f"{tmp_path / 'nocolumn.parquet'}: no column 'text' (--text-field); its columns: 'body'"),
        "null row": ([tmp_path / "null.parquet"],
                     f"{tmp_path / 'null.parquet'}: row 2: column 'text' is null, not text"),
        "other compression": ([tmp_path / "data.txt.gz"], f"{tmp_path / 'data.txt.gz'}: compressed files"),
        "missing": ([tmp_path / "nope.txt"], f"input '{tmp_path / 'nope.txt'}' does not exist"),
    }


@pytest.mark.parametrize("case", ["unreadable", "missing field", "not json", "corrupt gzip", "truncated gzip",
                                  "no column", "null row", "other compression", "missing"])
def test_bad_input_is_one_line_naming_the_file_and_nothing_is_left(tmp_path, capsys, case):
    inputs, message = _bad_inputs(tmp_path)[case]
    good = tmp_path / "good.txt"
    good.write_text("a document before the bad one\n" * 100)
    out = tmp_path / "new" / "out"
    status = main(["prepare-data", str(good), *map(str, inputs), "--out", str(out), "--workers", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and err[0].startswith(f"pretrain: error: {message}"), err
    if case.endswith("gzip"):
        assert "corrupt gzip data" in err[0]
    assert not (tmp_path / "new").exists()


def test_an_error_in_a_worker_process_is_one_line_too(tmp_path, capsys):
    """The JSON lines are parsed by the workers: their error reaches the user the same way."""
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(5000)]
    lines[4321] = json.dumps({"txt": "typo"})
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    out.mkdir()
    status = main(["prepare-data", str(tmp_path / "in.jsonl"), "--out", str(out), "--workers", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and err == [f"pretrain: error: {tmp_path / 'in.jsonl'}:4322: no 'text' field "
                                   "(--text-field); the line has 'txt'"]
    assert list(out.iterdir()) == []


def test_the_end_of_text_token_is_found_or_named(tmp_path, capsys):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "plain.json"))
    (tmp_path / "in.txt").write_text("a b\n")
    args = ["prepare-data", str(tmp_path / "in.txt"), "--tokenizer", str(tmp_path / "plain.json"),
            "--workers", "1", "--out"]
    assert main([*args, str(tmp_path / "o1")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pretrain: error: {tmp_path / 'plain.json'}: no end-of-text token among its "
                          "special tokens (looked for <|endoftext|>, <|end_of_text|>, </s>")
    assert err.endswith("name its id with --eos-id") and not (tmp_path / "o1").exists()
    assert main([*args, str(tmp_path / "o2"), "--eos-id", "0"]) == 0
    assert np.fromfile(tmp_path / "o2" / "part-00000.bin", "<u2").tolist() == [1, 2, 0]
    assert main([*args, str(tmp_path / "o3"), "--eos-id", "3"]) == 1
    assert "--eos-id 3 is not an id of" in capsys.readouterr().err
    tok.add_special_tokens(["<|im_end|>", "</s>"])  # </s> comes first in the preference order
    tok.save(str(tmp_path / "chat.json"))
    prepare_data([tmp_path / "in.txt"], tmp_path / "o4", tmp_path / "chat.json")
    assert token_dir_info(tmp_path / "o4").eos_id == tok.token_to_id("</s>") == 4


def test_inputs_by_glob_and_in_the_order_given(tmp_path):
    for name in ("b.txt", "a.txt", "sub/c.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name[-5])
    prepare_data([tmp_path / "sub", str(tmp_path / "*.txt")], tmp_path / "out")
    assert bytes(np.fromfile(tmp_path / "out" / "part-00000.bin", "<u2").astype(np.uint8)) == \
        b"c\x00a\x00b\x00"
    with pytest.raises(DataError, match=r"input '.*\*.jsonl' matches no files"):
        prepare_data([str(tmp_path / "*.jsonl")], tmp_path / "out2")


def _start(tmp_path: Path, out: Path) -> subprocess.Popen:
    """A prepare-data process slow enough to be stopped mid-way (BPE on one worker)."""
    _bpe_tokenizer(tmp_path / "bpe.json")
    if not (tmp_path / "in.txt").exists():
        rng = np.random.default_rng(2)
        (tmp_path / "in.txt").write_text("".join(_text(rng, 20_000) for _ in range(24)))
    cmd = [sys.executable, "-m", "pretrain", "prepare-data", str(tmp_path / "in.txt"), "--out",
           str(out), "--tokenizer", str(tmp_path / "bpe.json"), "--workers", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "part-00000.bin").exists() or (out / "part-00000.bin").stat().st_size == 0:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    return proc


@pytest.mark.multiprocess
def test_sigterm_removes_the_unfinished_output(tmp_path):
    out = tmp_path / "new" / "out"
    proc = _start(tmp_path, out)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == f"pretrain: error: stopped by SIGTERM; removed the unfinished output in {out}"
    assert "Traceback" not in err and not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rerun_replaces_the_output_of_a_killed_run(tmp_path):
    out = tmp_path / "out"
    proc = _start(tmp_path, out)
    proc.kill()  # SIGKILL: nothing runs, the marker stays
    proc.wait(timeout=60)
    assert (out / "prepare-data.unfinished").exists()
    with pytest.raises(DataError, match="unfinished output of a prepare-data run"):
        open_token_files(out, vocab_size=400)
    status = main(["prepare-data", str(tmp_path / "in.txt"), "--out", str(out), "--tokenizer",
                   str(tmp_path / "bpe.json"), "--workers", "1"])
    assert status == 0 and not (out / "prepare-data.unfinished").exists()
    clean = tmp_path / "clean"
    prepare_data([tmp_path / "in.txt"], clean, tmp_path / "bpe.json")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in clean.iterdir()}


def test_a_running_prepare_data_is_not_replaced(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "prepare-data.unfinished").write_text(json.dumps(
        {"pid": os.getppid(), "host": os.uname().nodename, "started": "then", "files": []}))
    with pytest.raises(DataError, match=f"{out} is being written by prepare-data process {os.getppid()}"):
        prepare_data([Path(__file__)], out)


@pytest.mark.parametrize("entry", [
    {"files": [{"name": "../x.bin", "tokens": 1}]},
    {"files": [{"name": "/tmp/x.bin", "tokens": 1}]},
    {"files": [{"name": "sub/x.bin", "tokens": 1}]},
    {"documents": {"file": "../documents.u64", "count": 1}},
    {"tokenizer": {"name": "t", "file": "/etc/passwd"}},
])
def test_a_sidecar_naming_a_file_outside_its_directory_is_refused(tmp_path, entry):
    (tmp_path / "x.bin").write_bytes(b"\x01\x00")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256, **entry}))
    with pytest.raises(DataError, match=r"must name a file in .*d \(no directories, no absolute path\)"):
        token_dir_info(tmp_path / "d")
        open_token_files(tmp_path / "d", 256)


def test_the_checksum_catches_a_changed_id_inside_the_vocabulary(tmp_path, capsys):
    (tmp_path / "in.txt").write_bytes(b"abcdefgh" * 1000)
    prepare_data([tmp_path / "in.txt"], tmp_path / "out")
    shard = tmp_path / "out" / "part-00000.bin"
    ids = np.fromfile(shard, "<u2")
    ids[4321] = ord("z")  # still a byte: the vocabulary check cannot see it
    ids.tofile(shard)
    for verify in (True, None):  # None: on, for data under 10 GB
        with pytest.raises(DataError) as e:
            open_token_files(tmp_path / "out", 257, verify=verify)
        assert str(e.value).startswith(f"{shard}: SHA-256 ") and "recorded in tokens.json" in str(e.value)
    assert open_token_files(tmp_path / "out", 257, verify=False).n_tokens == 8001
    status = main(["--config", "tiny", f"data.path={tmp_path / 'out'}", f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1 and err[0].startswith(f"pretrain: error: {shard}: SHA-256")
