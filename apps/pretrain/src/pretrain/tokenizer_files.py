"""The data's tokenizer, carried from the token directory through checkpoints to exports.

A run records the tokenizer of its data in every checkpoint's metadata
(``tokenizer``: ``name``, ``sha256``, ``eos_id`` and ``json``, the tokenizers JSON
itself, so a checkpoint is enough to export or sample from, wherever the data went):

- a token directory written with ``prepare-data --tokenizer``: the copy of that
  tokenizer kept in the directory (checked against the hash ``tokens.json`` records);
- byte data (``prepare-data`` without ``--tokenizer``: ids are bytes, end of text
  256) and the built-in ``stdlib`` corpus (bytes, no end of text): a byte-level
  tokenizers JSON built here (``byte_level_tokenizer``), whose ids 0-255 are the
  bytes and, with an end of text, ``<|endoftext|>`` is the id after them;
- ``synthetic`` data, or a token directory that kept no tokenizer: none
  (``json`` is null); ``export-hf`` and ``generate`` then need ``--tokenizer``.

``hf_tokenizer_files`` gives the files ``transformers.AutoTokenizer`` reads from
an exported folder: ``tokenizer.json`` and a ``tokenizer_config.json`` naming the
end-of-text token and the trained sequence length.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.data import STDLIB, DataError, training_data_info
from pretrain.errors import PretrainError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from pretrain.config import DataConfig

BYTES = "bytes"  # the tokenizer name of byte data
BYTES_EOS_TOKEN = "<|endoftext|>"


class TokenizerError(PretrainError, ValueError):
    """No usable tokenizer; the message names the file or the option that gives one."""


@functools.cache
def byte_level_tokenizer(eos_id: int | None) -> str:
    """A tokenizers JSON whose ids are bytes (0-255), plus ``<|endoftext|>`` at ``eos_id``.

    GPT-2's byte-to-character table maps each byte to one vocabulary entry, and with no
    merges every byte stays one token: ``encode`` gives the UTF-8 bytes, ``decode``
    joins them back into text.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 characters standing for the bytes
    table = _bytes_to_unicode()
    assert sorted(table.values()) == sorted(alphabet)
    vocab = {table[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    if eos_id is not None:
        if eos_id != 256:
            raise TokenizerError(f"byte data's end of text must be id 256 to be written as a "
                                 f"tokenizer, got {eos_id}")
        tokenizer.add_special_tokens([BYTES_EOS_TOKEN])
    return tokenizer.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (tokenizers' ByteLevel)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def data_tokenizer(data: DataConfig) -> dict[str, Any]:
    """The record a checkpoint keeps of the run's tokenizer (see the module doc)."""
    info = training_data_info(data)
    if info is None:
        if data.path == STDLIB and not data.sources:
            return {"name": BYTES, "sha256": None, "eos_id": None, "json": byte_level_tokenizer(None)}
        return {"name": data.path, "sha256": None, "eos_id": None, "json": None}
    record = info.tokenizer
    if record.name == BYTES:
        return {"name": BYTES, "sha256": None, "eos_id": info.eos_id,
                "json": byte_level_tokenizer(info.eos_id)}
    text = None
    if record.path is not None:
        try:
            raw = record.path.read_bytes()
        except OSError as e:
            raise DataError(f"{record.path}: the tokenizer {info.sidecar} names cannot be read: "
                            f"{e.strerror or e}") from None
        if record.sha256 is not None and hashlib.sha256(raw).hexdigest() != record.sha256:
            raise DataError(f"{record.path}: its SHA-256 differs from the one {info.sidecar} records")
        text = raw.decode()
    return {"name": record.name, "sha256": record.sha256, "eos_id": info.eos_id, "json": text}


def tokenizer_from_file(path: Path) -> tuple[str, int | None]:
    """``--tokenizer PATH``: a tokenizers JSON file, or a folder holding ``tokenizer.json``;
    its JSON text and the end-of-text id its folder's generation config names, if any."""
    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        text = file.read_text()
    except OSError as e:
        raise TokenizerError(f"--tokenizer {path}: cannot read {file}: {e.strerror or e}") from None
    return text, _folder_eos_id(file.parent) if path.is_dir() else None


def _folder_eos_id(folder: Path) -> int | None:
    """The end-of-text id a Hugging Face folder's ``generation_config.json`` or ``config.json``
    names (the first, when a list)."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if isinstance(eos, int):
            return eos
    return None


def folder_tokenizer(folder: Path) -> tuple[str, int | None] | None:
    """A Hugging Face folder's ``tokenizer.json`` and end-of-text id; ``None`` without one."""
    if not (folder / "tokenizer.json").is_file():
        return None
    return tokenizer_from_file(folder)


def load_tokenizer(text: str, where: str) -> Tokenizer:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own Exception subclass for a bad JSON
        raise TokenizerError(f"{where}: not a tokenizers JSON: {e}") from None


def token_text(tokenizer: Tokenizer, token_id: int | None) -> str | None:
    return None if token_id is None else tokenizer.id_to_token(token_id)


def hf_tokenizer_files(text: str, eos_id: int | None, model_max_length: int) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained``."""
    eos = token_text(load_tokenizer(text, "the checkpoint's tokenizer"), eos_id)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                              "model_max_length": model_max_length,
                              "clean_up_tokenization_spaces": False}
    if eos is not None:
        config.update(eos_token=eos, pad_token=eos)
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def generation_config(eos_id: int | None) -> str:
    """``generation_config.json``: the end-of-text id (also used to pad)."""
    config: dict[str, Any] = {"_from_model_config": False}
    if eos_id is not None:
        config.update(eos_token_id=eos_id, pad_token_id=eos_id)
    return json.dumps(config, indent=2) + "\n"
