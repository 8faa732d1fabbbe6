"""Pre-tokenized token files: headerless arrays plus a JSON sidecar.

A token directory holds ``*.bin`` files, each a headerless little-endian array of
``uint16`` or ``uint32`` token ids (so ``numpy.memmap`` reads them with no copy
and any tool can write them), and ``tokens.json``::

    {"dtype": "uint16", "vocab_size": 50304,
     "eos_id": 50256,                                       # optional: the id ending each document
     "files": [{"name": "part-00000.bin", "tokens": 1048576,     # optional: order, sizes,
                "sha256": "5d1e..."}],                           #   checksums
     "documents": {"file": "documents.u64", "count": 1200,  # optional: the document index
                   "sha256": "77ab..."},
     "tokenizer": {"name": "gpt2.json", "file": "tokenizer.json",  # optional: provenance
                   "sha256": "9f2c..."}}                          # ("bytes": no file)

``tokenizer.file`` is a copy of the tokenizer kept beside the token files, and
``sha256`` the hash of its bytes: runs compare it to refuse validation data of
another tokenizer, and checkpoints carry it to the exported model. (Sidecars
written before it was recorded hold the tokenizer's name as a plain string.)

Without ``files`` every ``*.bin`` is read in name order. The files are one token
stream in that order; ``data.path`` may also name a single ``.bin`` file of such
a directory. Every file the sidecar names is a plain name in its directory (a
crafted ``../x.bin`` or ``/etc/x`` is refused).

``documents.file`` holds the token offset of each document's start in that
stream, as little-endian ``uint64`` (``count`` of them); ``prepare-data`` ends
every document with ``eos_id``. A file's ``sha256`` (of its bytes) is compared on
open when verification is on (``data.verify``; by default for data under 10 GB),
which catches changed ids that are still inside the vocabulary.

A directory that still holds ``prepare-data.unfinished`` is the output of a
``prepare-data`` run that has not finished (or was killed): it is refused here,
and a rerun of ``prepare-data`` replaces it.

Opening checks everything that would otherwise fail deep inside a step: the
dtype, file sizes, the declared vocabulary against the model's, and every token
id against the model's vocabulary (vectorised, in chunks, so the check costs one
read of the data and bounded memory).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.errors import PretrainError

SIDECAR = "tokens.json"
TOKENIZER_FILE = "tokenizer.json"  # the tokenizer's copy in a token directory
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DOCUMENTS_FILE = "documents.u64"  # the document index written by prepare-data
UNFINISHED_MARKER = "prepare-data.unfinished"  # present while prepare-data writes a directory
CHECK_CHUNK = 1 << 24  # tokens per vectorised id check
VERIFY_AUTO_BYTES = 10**10  # data.verify=none verifies data under 10 GB


class DataError(PretrainError, ValueError):
    """Training data the run cannot use; the message names the file or key."""


@dataclass(frozen=True)
class TokenArrays:
    """A token stream made of named 1-D integer arrays, read in order."""

    arrays: list[np.ndarray]
    names: list[str]

    @property
    def n_tokens(self) -> int:
        return sum(a.shape[0] for a in self.arrays)


@dataclass(frozen=True)
class TokenizerRecord:
    """What tokenized a token directory."""

    name: str  # "bytes", or the tokenizer file's name as given to prepare-data
    sha256: str | None  # of the tokenizer file's bytes; None for bytes or when not recorded
    path: Path | None  # the copy kept in the token directory, if there is one

    def same_as(self, other: TokenizerRecord) -> bool:
        """Both tokenized the same way: equal hashes, or both bytes."""
        if self.sha256 is not None or other.sha256 is not None:
            return self.sha256 == other.sha256
        return self.name == other.name == "bytes"


@dataclass(frozen=True)
class DocumentIndex:
    """Where the documents of a token directory start (``read_document_starts``)."""

    path: Path  # little-endian uint64 token offsets into the directory's stream, one per document
    count: int
    sha256: str | None


@dataclass(frozen=True)
class TokenDirInfo:
    """A token directory's sidecar, checked (``token_dir_info``)."""

    directory: Path
    sidecar: Path
    dtype: str
    vocab_size: int
    tokenizer: TokenizerRecord
    eos_id: int | None  # the id written between documents, if the data records one
    documents: DocumentIndex | None = None  # the document index, if the data has one


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest supported dtype holding ids ``< vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_sidecar(directory: Path, meta: dict[str, Any]) -> None:
    """Write ``tokens.json`` atomically: a crashed writer never leaves a valid-looking sidecar.

    ``meta`` holds the keys of the module docstring; ``tokenizer`` is ``{"name": "bytes"}``
    or ``{"name", "file", "sha256"}``.
    """
    tmp = directory / (SIDECAR + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    tmp.replace(directory / SIDECAR)


def _check_name(sidecar: Path, key: str, name: str) -> None:
    """A file a sidecar names must be a plain name in the sidecar's directory."""
    if not name or name in (".", "..") or Path(name).name != name or "\\" in name:
        raise DataError(f"{sidecar}: {key} {name!r} must name a file in {sidecar.parent} "
                        "(no directories, no absolute path)")


def _read_sidecar(directory: Path) -> dict[str, Any]:
    path = directory / SIDECAR
    if (directory / UNFINISHED_MARKER).exists():
        raise DataError(f"{directory} is the unfinished output of a prepare-data run "
                        f"({UNFINISHED_MARKER}); run prepare-data again to replace it")
    if not path.is_file():
        raise DataError(
            f"{directory} has no {SIDECAR}; write the data with `pretrain prepare-data` or add "
            f'{SIDECAR} with {{"dtype": "uint16", "vocab_size": N}}'
        )
    try:
        meta = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not valid JSON: {e}") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: must hold a JSON object, got {type(meta).__name__}")
    if meta.get("dtype") not in DTYPES:
        raise DataError(f"{path}: dtype must be one of {', '.join(DTYPES)}, got {meta.get('dtype')!r}")
    if not isinstance(meta.get("vocab_size"), int) or meta["vocab_size"] <= 0:
        raise DataError(f"{path}: vocab_size must be a positive integer, got {meta.get('vocab_size')!r}")
    files = meta.get("files", [])
    if not isinstance(files, list):
        raise DataError(f"{path}: files must be a list, got {type(files).__name__}")
    for index, entry in enumerate(files):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("tokens", 0), int) and entry.get("tokens", 0) >= 0):
            raise DataError(f"{path}: files[{index}] must be an object with a string name and "
                            f"a non-negative integer tokens, got {entry!r}")
        _check_name(path, f"files[{index}].name", entry["name"])
        if not isinstance(entry.get("sha256", ""), str):
            raise DataError(f"{path}: files[{index}].sha256 must be a string, got {entry['sha256']!r}")
    return meta


def _document_index(meta: dict[str, Any], directory: Path, sidecar: Path) -> DocumentIndex | None:
    entry = meta.get("documents")
    if entry is None:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("file"), str)
            and isinstance(entry.get("count"), int) and entry["count"] >= 0
            and isinstance(entry.get("sha256", ""), str)):
        raise DataError(f"{sidecar}: documents must be an object with a string file and a "
                        f"non-negative integer count, got {entry!r}")
    _check_name(sidecar, "documents.file", entry["file"])
    return DocumentIndex(directory / entry["file"], entry["count"], entry.get("sha256"))


def _tokenizer_record(meta: dict[str, Any], directory: Path, sidecar: Path) -> TokenizerRecord:
    entry = meta.get("tokenizer")
    if entry is None or isinstance(entry, str):  # not recorded, or only a name (older sidecars)
        return TokenizerRecord(entry or "unknown", None, None)
    if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)):
        raise DataError(f"{sidecar}: tokenizer must be an object with a string name, got {entry!r}")
    sha, file = entry.get("sha256"), entry.get("file")
    if sha is not None and not isinstance(sha, str) or file is not None and not isinstance(file, str):
        raise DataError(f"{sidecar}: tokenizer.sha256 and tokenizer.file must be strings, got {entry!r}")
    if file is not None:
        _check_name(sidecar, "tokenizer.file", file)
    return TokenizerRecord(entry["name"], sha, directory / file if file else None)


def token_dir_info(path: str | Path, key: str = "data path") -> TokenDirInfo:
    """The checked sidecar of a token directory (or of the directory of one of its files);
    ``key`` names the setting that gave ``path`` in the error for a missing path."""
    given, path = str(path), Path(path)
    if not path.exists():
        raise DataError(f"{key} {given!r} does not exist")
    directory = path if path.is_dir() else path.parent
    meta = _read_sidecar(directory)
    sidecar = directory / SIDECAR
    eos = meta.get("eos_id")
    if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool)
                            or not 0 <= eos < meta["vocab_size"]):
        raise DataError(f"{sidecar}: eos_id must be an id below vocab_size, got {eos!r}")
    return TokenDirInfo(directory, sidecar, meta["dtype"], meta["vocab_size"],
                        _tokenizer_record(meta, directory, sidecar), eos,
                        _document_index(meta, directory, sidecar))


def read_document_starts(info: TokenDirInfo) -> np.ndarray:
    """The document index of a token directory, memory-mapped (``uint64`` token offsets)."""
    if info.documents is None:
        raise DataError(f"{info.sidecar}: records no document index")
    path, count = info.documents.path, info.documents.count
    if not path.is_file():
        raise DataError(f"{path}: listed in {SIDECAR} but missing")
    if path.stat().st_size != 8 * count:
        raise DataError(f"{path}: holds {path.stat().st_size} bytes, {SIDECAR} says {count} "
                        "uint64 document offsets")
    if count == 0:
        return np.zeros(0, dtype="<u8")
    return np.memmap(path, dtype="<u8", mode="r")


def check_token_ids(array: np.ndarray, vocab_size: int, name: str, sha256: str | None = None) -> None:
    """Raise ``DataError`` naming ``name`` if any id is ``>= vocab_size`` (chunked max), or
    if ``sha256`` is given and the array's bytes hash to another value (the same pass)."""
    digest = hashlib.sha256() if sha256 is not None else None
    for start in range(0, array.shape[0], CHECK_CHUNK):
        chunk = array[start:start + CHECK_CHUNK]
        if digest is not None:
            digest.update(memoryview(np.ascontiguousarray(chunk)).cast("B"))
        if int(chunk.max()) >= vocab_size:
            offset = start + int(np.argmax(chunk >= vocab_size))
            raise DataError(
                f"{name}: token id {int(array[offset])} at position {offset} is >= "
                f"model.vocab_size={vocab_size}"
            )
    if digest is not None and digest.hexdigest() != sha256:
        raise DataError(
            f"{name}: SHA-256 {digest.hexdigest()[:16]}... differs from {sha256[:16]}... recorded in "
            f"{SIDECAR}: the file changed after it was written (data.verify=false skips the check)")


def open_token_files(path: str | Path, vocab_size: int, verify: bool | None = None) -> TokenArrays:
    """Memory-map a token directory (or one ``.bin`` of it) after checking it fully.

    ``verify``: compare each file's SHA-256 with the one ``tokens.json`` records (files
    without one are not hashed); ``None`` verifies when the files total under 10 GB.
    """
    given, path = str(path), Path(path)
    if not path.exists():
        raise DataError(f"data.path {given!r} does not exist")
    directory = path if path.is_dir() else path.parent
    meta = _read_sidecar(directory)
    dtype = DTYPES[meta["dtype"]]
    if meta["vocab_size"] > vocab_size:
        raise DataError(
            f"{directory / SIDECAR}: the data's vocab_size {meta['vocab_size']} exceeds "
            f"model.vocab_size={vocab_size}"
        )
    if path.is_file():
        # one file of the directory: a token file (not the sidecar or text kept beside it),
        # and one the sidecar lists if it lists any
        listed = {f["name"]: f.get("tokens") for f in meta.get("files", [])}
        hashes = [{f["name"]: f.get("sha256") for f in meta.get("files", [])}.get(path.name)]
        if path.suffix != ".bin" or (listed and path.name not in listed):
            raise DataError(
                f"data.path {str(path)!r} is not a token file of {directory}: name the directory "
                f"or one of its .bin files{' listed in ' + SIDECAR if listed else ''}")
        files, expected = [path], [listed.get(path.name)]
    elif "files" in meta:
        files = [directory / f["name"] for f in meta["files"]]
        expected = [f.get("tokens") for f in meta["files"]]
        hashes = [f.get("sha256") for f in meta["files"]]
    else:
        files = sorted(directory.glob("*.bin"))
        expected = hashes = [None] * len(files)
    if not files:
        raise DataError(f"{directory} holds no *.bin token files")
    if verify is None:
        verify = sum(f.stat().st_size for f in files if f.is_file()) < VERIFY_AUTO_BYTES
    arrays, names = [], []
    for file, n_expected, sha256 in zip(files, expected, hashes, strict=True):
        if not file.is_file():
            raise DataError(f"{file}: listed in {SIDECAR} but missing")
        size = file.stat().st_size
        if size % dtype.itemsize:
            raise DataError(f"{file}: {size} bytes is not a whole number of {meta['dtype']} tokens")
        if n_expected is not None and size // dtype.itemsize != n_expected:
            raise DataError(
                f"{file}: holds {size // dtype.itemsize} tokens, {SIDECAR} says {n_expected}"
            )
        if size == 0:
            continue
        try:
            array = np.memmap(file, dtype=dtype, mode="r")
        except OSError as e:
            raise DataError(f"{file}: cannot read: {e.strerror or e}") from None
        check_token_ids(array, vocab_size, str(file), sha256 if verify else None)
        arrays.append(array)
        names.append(str(file))
    if not arrays:
        raise DataError(f"{directory}: every token file is empty")
    return TokenArrays(arrays, names)
