"""Data: layout-independent order, resume from a step, token files, prepare-data."""

from __future__ import annotations

import hashlib
import json
import signal

import numpy as np
import pytest
import torch
from pretrain.cli import main
from pretrain.data import (
    BatchReader,
    DataError,
    GlobalOrder,
    StreamSequences,
    SyntheticSequences,
    TokenArrays,
    TokenizerRecord,
    feistel_permute,
    open_source,
    open_token_files,
    prepare_data,
    token_dir_info,
)
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers


def _stream(n_tokens: int = 5000, seq_len: int = 8, n_files: int = 3) -> StreamSequences:
    tokens = (np.arange(n_tokens) % 251).astype(np.uint16)
    parts = np.array_split(tokens, n_files)
    return StreamSequences(TokenArrays(parts, [f"f{i}" for i in range(n_files)]), seq_len)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_feistel_is_a_bijection(n):
    perm = feistel_permute(np.arange(n), n, seed=3, epoch=1)
    assert sorted(perm.tolist()) == list(range(n))


def test_order_depends_on_seed_and_epoch():
    base = feistel_permute(np.arange(1000), 1000, 0, 0)
    assert not np.array_equal(base, feistel_permute(np.arange(1000), 1000, 1, 0))
    assert not np.array_equal(base, feistel_permute(np.arange(1000), 1000, 0, 1))
    assert not np.array_equal(base, np.arange(1000))


def test_each_epoch_visits_every_sequence_once():
    order = GlobalOrder(n_sequences=37, seed=5)
    ids = order.sequence_ids(np.arange(3 * 37))
    for epoch in range(3):
        assert sorted(ids[epoch * 37:(epoch + 1) * 37].tolist()) == list(range(37))
    assert not np.array_equal(ids[:37], ids[37:74])


def test_windows_cross_file_boundaries():
    source = _stream(n_tokens=100, seq_len=10, n_files=3)  # files of 34, 33, 33 tokens
    rows = source.read(np.array([0, 3, 8]))
    expected = np.stack([np.arange(s * 10, s * 10 + 11) for s in (0, 3, 8)]) % 251
    assert rows.dtype == np.int64 and np.array_equal(rows, expected)
    assert source.n_sequences == 9  # (100 - 1) // 10 full windows of 11 tokens
    with pytest.raises(DataError, match="fewer than one sequence"):
        _stream(n_tokens=8, seq_len=8, n_files=1)


@pytest.mark.parametrize("dp, micro", [(2, 1), (2, 2), (4, 1), (4, 2), (8, 1)])
def test_rank_slices_concatenate_to_the_one_rank_batch(dp, micro):
    source, seed, global_batch = _stream(), 11, 8
    one_rank = BatchReader(source, seed, global_batch, micro_batch=global_batch)
    for step in (1, 2, 70):  # 70 x 8 samples > 624 sequences: crosses an epoch
        reference = one_rank.microbatch(step, 0)
        pieces = []
        for rank in range(dp):
            reader = BatchReader(source, seed, global_batch, micro, dp_rank=rank, dp_size=dp)
            pieces += [reader.microbatch(step, m) for m in range(reader.n_microbatches)]
        assert torch.equal(torch.cat(pieces), reference)


def test_resume_from_a_step_number_reads_the_same_batches():
    source = _stream()
    run = BatchReader(source, 0, 8, 2, dp_rank=1, dp_size=2)
    seen = {(s, m): run.microbatch(s, m) for s in range(1, 7) for m in range(2)}
    resumed = BatchReader(source, 0, 8, 2, dp_rank=1, dp_size=2)  # a new process at step 4
    for s in range(4, 7):
        for m in range(2):
            assert torch.equal(resumed.microbatch(s, m), seen[(s, m)])
    assert not torch.equal(seen[(1, 0)], seen[(2, 0)])


def test_synthetic_tokens_are_deterministic_and_in_vocab():
    a = SyntheticSequences(vocab_size=1000, seq_len=16, seed=1).read(np.array([5, 9]))
    b = SyntheticSequences(vocab_size=1000, seq_len=16, seed=1).read(np.array([5, 9]))
    c = SyntheticSequences(vocab_size=1000, seq_len=16, seed=2).read(np.array([5, 9]))
    assert a.shape == (2, 17) and np.array_equal(a, b) and not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() < 1000


def test_prepare_data_bytes_round_trip(tmp_path):
    """Bytes are the ids; each file, one document, ends with the end-of-text id 256."""
    texts = [b"def f(x):\n    return x\n", "caf\u00e9 \u2014 unicode\n".encode(), b"no newline"]
    inputs = []
    for i, text in enumerate(texts):
        path = tmp_path / f"in{i}.txt"
        path.write_bytes(text)
        inputs.append(path)
    out = tmp_path / "tokens"
    assert main(["prepare-data", *map(str, inputs), "--out", str(out)]) == 0
    meta = json.loads((out / "tokens.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and meta["tokenizer"] == {"name": "bytes"}
    assert meta["eos_id"] == 256 and meta["documents"]["count"] == 3
    tokens = open_token_files(out, vocab_size=257)
    expected = np.concatenate([np.append(np.frombuffer(t, np.uint8), 256) for t in texts])
    assert np.concatenate(tokens.arrays).tobytes() == expected.astype("<u2").tobytes()
    source = open_source(str(out), seq_len=4, vocab_size=257, seed=0)
    assert bytes(source.read(np.array([0]))[0].astype(np.uint8)) == b"def f"


def test_prepare_data_shards_and_single_file_path(tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(bytes(range(100)) * 3)
    done = prepare_data([src], tmp_path / "out", shard_tokens=128)
    assert [f["tokens"] for f in done.files] == [128, 128, 45]
    all_tokens = np.concatenate(open_token_files(tmp_path / "out", 257).arrays)
    assert np.array_equal(all_tokens, np.append(np.frombuffer(src.read_bytes(), np.uint8), 256))
    one = open_token_files(tmp_path / "out" / "part-00001.bin", 257)
    assert np.array_equal(one.arrays[0], all_tokens[128:256])
    with pytest.raises(DataError, match="already holds token files"):
        prepare_data([src], tmp_path / "out")


def _word_tokenizer(path, n_words: int) -> Tokenizer:
    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(n_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])  # the end-of-text token: id n_words + 1
    tok.save(str(path))
    return tok


@pytest.mark.parametrize("n_words, dtype", [(50, "uint16"), (70_000, "uint32")])
def test_prepare_data_with_a_tokenizer(tmp_path, n_words, dtype):
    tok = _word_tokenizer(tmp_path / "tokenizer.json", n_words)
    texts = ["w1 w2 w3\nw4 w49\n", "w0 w7 unknown w5\n"]
    if n_words > 1 << 16:
        texts.append("w69999 w65536\n")
    inputs = []
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
        inputs.append(tmp_path / f"{i}.txt")
    out = tmp_path / "out"
    done = prepare_data(inputs, out, tokenizer=tmp_path / "tokenizer.json")
    assert done.dtype == dtype and done.vocab_size == n_words + 2 and done.eos_id == n_words + 1
    expected = sum((tok.encode(t, add_special_tokens=False).ids + [n_words + 1] for t in texts), [])
    got = np.concatenate(open_token_files(out, vocab_size=n_words + 2).arrays)
    assert got.tolist() == expected


def test_prepare_data_keeps_the_tokenizer_and_its_hash(tmp_path):
    """The token directory carries a copy of its tokenizer and the SHA-256 of its bytes,
    which runs compare (validation data, checkpoints, export)."""
    _word_tokenizer(tmp_path / "tok.json", 5)
    (tmp_path / "in.txt").write_text("w1 w2\n")
    prepare_data([tmp_path / "in.txt"], tmp_path / "a", tokenizer=tmp_path / "tok.json")
    info = token_dir_info(tmp_path / "a")
    data = (tmp_path / "tok.json").read_bytes()
    assert info.tokenizer.path == tmp_path / "a" / "tokenizer.json"
    assert info.tokenizer.path.read_bytes() == data and info.tokenizer.name == "tok.json"
    assert info.tokenizer.sha256 == hashlib.sha256(data).hexdigest()
    prepare_data([tmp_path / "in.txt"], tmp_path / "b")
    bytes_info = token_dir_info(tmp_path / "b")
    assert bytes_info.tokenizer == TokenizerRecord("bytes", None, None)
    assert not info.tokenizer.same_as(bytes_info.tokenizer)
    assert bytes_info.tokenizer.same_as(token_dir_info(tmp_path / "b").tokenizer)


def test_the_shards_dtype_holds_the_largest_id_of_a_vocabulary_with_gaps(tmp_path):
    """Three entries, ids up to 70000: uint16 would wrap 70000 to 4464."""
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    (tmp_path / "in.txt").write_text("a b a b\n")
    done = prepare_data([tmp_path / "in.txt"], tmp_path / "out", tokenizer=tmp_path / "tok.json",
                        eos_id=0)
    assert (done.dtype, done.vocab_size) == ("uint32", 70001)
    got = np.concatenate(open_token_files(tmp_path / "out", vocab_size=70001).arrays)
    assert got.tolist() == [1, 70000, 1, 70000, 0]


@pytest.mark.parametrize("start_marker", [
    normalizers.Prepend("\u2581"),  # Llama / Mistral style: a text starts with "▁"
    None,  # no marker: blocks are encoded as they are
])
def test_block_boundaries_add_no_token(tmp_path, monkeypatch, start_marker):
    """A file is tokenized in blocks (8 bytes here, 1 MiB in use); a tokenizer that marks a
    text's start must not see every block as one: the ids equal the whole file's."""
    monkeypatch.setattr("pretrain.data.inputs.BLOCK_BYTES", 8)
    vocab = {c: i for i, c in enumerate(["[UNK]", "\u2581", "\n", *"abcdefgh"])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="[UNK]"))
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([start_marker, replace] if start_marker else [replace])
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tok.json"))
    eos = len(vocab)
    texts = ["ab cd\nef gh\n\nab\nhg fe dc ba\n", "ab\ncd"]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    prepare_data([tmp_path / "0.txt", tmp_path / "1.txt"], tmp_path / "out", tokenizer=tmp_path / "tok.json")
    got = np.concatenate(open_token_files(tmp_path / "out", vocab_size=len(vocab) + 1).arrays).tolist()
    assert got == sum((tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts), [])


def test_prepare_data_rejects_non_utf8_with_a_tokenizer(tmp_path, capsys):
    _word_tokenizer(tmp_path / "tok.json", 5)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"w1 w2\n\xff\xfe w3\n")
    status = main(["prepare-data", str(bad), "--out", str(tmp_path / "o"),
                   "--tokenizer", str(tmp_path / "tok.json")])
    err = capsys.readouterr().err.strip()
    assert status == 1 and err == f"pretrain: error: {bad}: not UTF-8 text at byte 6; omit --tokenizer to tokenize it as bytes"


def test_token_ids_beyond_the_vocab_name_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr("pretrain.data.files.CHECK_CHUNK", 1000)  # exercise the chunking
    ids = np.full(5000, 7, dtype="<u2")
    ids[3456] = 300
    (tmp_path / "a.bin").write_bytes(np.zeros(10, "<u2").tobytes())
    (tmp_path / "b.bin").write_bytes(ids.tobytes())
    (tmp_path / "tokens.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 256}))
    with pytest.raises(DataError) as e:
        open_token_files(tmp_path, vocab_size=256)
    assert str(e.value) == f"{tmp_path / 'b.bin'}: token id 300 at position 3456 is >= model.vocab_size=256"


@pytest.mark.parametrize("sidecar, data, message", [
    (None, b"", "has no tokens.json"),
    ({"dtype": "int8", "vocab_size": 256}, b"", "dtype must be one of uint16, uint32"),
    ({"dtype": "uint16", "vocab_size": 512}, b"\x01\x00", "the data's vocab_size 512 exceeds model.vocab_size=256"),
    ({"dtype": "uint16", "vocab_size": 256}, b"\x01\x00\x02", "3 bytes is not a whole number of uint16 tokens"),
    ({"dtype": "uint16", "vocab_size": 256, "files": [{"name": "x.bin", "tokens": 1}]}, b"", "x.bin: listed in tokens.json but missing"),
    (["not", "an", "object"], b"", "must hold a JSON object, got list"),
    ({"dtype": "uint16", "vocab_size": 256, "files": ["a.bin"]}, b"", r"files\[0\] must be an object"),
    ({"dtype": "uint16", "vocab_size": 256, "files": [{"file": "a.bin"}]}, b"", r"files\[0\] must be an object"),
    ({"dtype": "uint16", "vocab_size": 256, "files": {"a.bin": 1}}, b"", "files must be a list"),
])
def test_bad_token_directories(tmp_path, sidecar, data, message):
    (tmp_path / "a.bin").write_bytes(data)
    if sidecar is not None:
        (tmp_path / "tokens.json").write_text(json.dumps(sidecar))
    with pytest.raises(DataError, match=message):
        open_token_files(tmp_path, vocab_size=256)
    with pytest.raises(DataError, match="does not exist"):
        open_token_files(tmp_path / "nope", vocab_size=256)


def test_data_path_naming_one_file_takes_only_token_files(tmp_path, capsys):
    """Text kept beside the tokens (or the sidecar) would read as token ids that pass the
    vocabulary check: only a ``.bin`` the sidecar lists is a token file."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"hello world\n" * 20)
    out = tmp_path / "corpus"
    prepare_data([src], out)
    (out / "corpus.txt").write_bytes(src.read_bytes())
    (out / "stray.bin").write_bytes(b"\x01\x00" * 8)
    for name in ("corpus.txt", "tokens.json", "stray.bin"):
        with pytest.raises(DataError, match=f"data.path .*{name}' is not a token file of"):
            open_source(str(out / name), seq_len=8, vocab_size=50304, seed=0)
    assert open_source(str(out / "part-00000.bin"), seq_len=8, vocab_size=257, seed=0).n_sequences == 30


def test_prepare_data_out_must_be_a_directory(tmp_path, capsys):
    (tmp_path / "in.txt").write_bytes(b"abc\n")
    (tmp_path / "out").write_text("x")
    status = main(["prepare-data", str(tmp_path / "in.txt"), "--out", str(tmp_path / "out")])
    assert status == 1 and capsys.readouterr().err.strip() == f"pretrain: error: --out '{tmp_path / 'out'}' is not a directory"


@pytest.mark.slow
def test_a_failed_prepare_data_leaves_no_half_written_directory(tmp_path, capsys):
    """The non-UTF-8 file comes after a shard holds the first file's tokens: a rerun must not be refused
    as 'already holds token files', and only what the failed call created is removed."""
    _word_tokenizer(tmp_path / "tok.json", 5)
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("w1 w2 w3\n" * 40)
    bad.write_bytes(b"w1 w2\n\xff\xfe w3\n")
    args = ["--tokenizer", str(tmp_path / "tok.json")]
    new = tmp_path / "new" / "out"
    assert main(["prepare-data", str(good), str(bad), "--out", str(new), *args]) == 1
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["prepare-data", str(good), str(bad), "--out", str(kept), *args]) == 1
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]
    capsys.readouterr()
    assert main(["prepare-data", str(good), "--out", str(new), *args]) == 0
    assert (new / "tokens.json").is_file()


def test_a_missing_data_path_is_named_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # './corpus' (a folder) and 'corpus' (the source) differ
    with pytest.raises(DataError, match=r"data.path './corpus' does not exist"):
        open_token_files("./corpus", vocab_size=256)


def test_a_failed_prepare_data_keeps_files_it_did_not_write(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokens.json.tmp").write_text("the user's own file")  # not a token file: accepted
    (tmp_path / "bad.jsonl").write_bytes(b'{"body": "no text field"}\n')
    with pytest.raises(DataError, match="no 'text' field"):
        prepare_data([tmp_path / "bad.jsonl"], out)
    assert (out / "tokens.json.tmp").read_text() == "the user's own file"


def test_a_write_error_still_cleans_up(tmp_path):
    """A failed write (a file-size limit here; a full disk fails the same way) leaves bytes in
    the shard's buffer, so closing the shard in the cleanup raises again."""
    resource = pytest.importorskip("resource")
    inputs = []
    for i in range(100):
        (tmp_path / f"in{i}.txt").write_bytes(b"abcdefghi\n" * 100)
        inputs.append(tmp_path / f"in{i}.txt")
    out = tmp_path / "new" / "tok"
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        with pytest.raises(OSError):
            prepare_data(inputs, out)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert not (tmp_path / "new").exists(), sorted(str(p) for p in (tmp_path / "new").rglob("*"))
