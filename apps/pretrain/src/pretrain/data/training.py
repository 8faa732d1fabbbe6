"""What a run trains on, from its ``data`` config: the source, its vocabulary, its sidecar.

- ``open_data``: ``data.path`` (one source) or ``data.sources`` (a mixture) as the
  ``SequenceSource`` the batch reader reads.
- ``resolve_vocab_size``: ``model.vocab_size`` from the data when the user left it
  unset, once at startup, before the model is built.
- ``training_data_info``: the token directory's checked sidecar (the first source's
  for a mixture, whose sources all agree), for what needs the tokenizer or the
  end-of-text id.
- ``document_eos_id``: the end-of-text id that ``data.document_mask`` splits windows
  into documents at (the token after it starts a document; ``prepare-data`` ends every
  document with it, so these are the starts its document index records).

The sources of a mixture must have been written by one tokenizer with one vocabulary
and one end-of-text id: ids from two tokenizers would mean different text in one model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.data.files import DataError, TokenDirInfo, token_dir_info
from pretrain.data.mixture import MixtureComponent, MixtureSequences
from pretrain.data.sources import STDLIB, SYNTHETIC, SequenceSource, StreamSequences, open_source

if TYPE_CHECKING:
    from pretrain.config import DataConfig, PretrainConfig

VOCAB_MULTIPLE = 64  # a vocabulary taken from the data is rounded up to this (GEMM-friendly)
BYTE_VOCAB = 256  # the embedded corpus: bytes


def _source_infos(data: DataConfig) -> list[TokenDirInfo]:
    """The mixture's sidecars, checked to agree on tokenizer, vocabulary and end-of-text id."""
    infos = [token_dir_info(s.path, f"data.sources[{i}].path") for i, s in enumerate(data.sources)]
    first = infos[0]
    for info in infos[1:]:
        differs = [
            (info.vocab_size != first.vocab_size,
             f"vocab_size {first.vocab_size} and {info.vocab_size}"),
            (not info.tokenizer.same_as(first.tokenizer),
             f"tokenizers {first.tokenizer.name!r} (sha256 {first.tokenizer.sha256}) and "
             f"{info.tokenizer.name!r} (sha256 {info.tokenizer.sha256})"),
            (info.eos_id != first.eos_id, f"eos_id {first.eos_id} and {info.eos_id}"),
        ]
        for bad, what in differs:
            if bad:
                raise DataError(f"data.sources: {first.sidecar} and {info.sidecar} have {what}; "
                                "a mixture's sources must share one tokenizer and vocabulary")
    return infos


def training_data_info(data: DataConfig) -> TokenDirInfo | None:
    """The sidecar of the run's token data; ``None`` for the built-in sources."""
    if data.sources:
        return _source_infos(data)[0]
    if data.path in (STDLIB, SYNTHETIC):
        return None
    return token_dir_info(data.path, "data.path")


def document_eos_id(data: DataConfig) -> int | None:
    """``data.document_mask``'s end-of-text id; ``None`` when the mask is off. Data without
    documents (the built-in sources, a sidecar without ``eos_id``) is refused."""
    if not data.document_mask:
        return None
    info = training_data_info(data)
    if info is None:
        raise DataError(f"data.document_mask=true needs data with documents; data.path={data.path} "
                        "has none (write token data with `pretrain prepare-data`)")
    if info.eos_id is None:
        raise DataError(f"data.document_mask=true needs data with documents; {info.sidecar} records "
                        "no eos_id (write it with `pretrain prepare-data`)")
    return info.eos_id


def open_data(data: DataConfig, seq_len: int, vocab_size: int, seed: int) -> SequenceSource:
    """The run's source: ``data.path``'s, or the mixture of ``data.sources``."""
    if not data.sources:
        return open_source(data.path, seq_len, vocab_size, seed, data.verify)
    _source_infos(data)
    components = []
    for i, s in enumerate(data.sources):
        source = open_source(s.path, seq_len, vocab_size, seed, data.verify)
        assert isinstance(source, StreamSequences), f"data.sources[{i}] is a token directory"
        components.append(MixtureComponent(s.path, s.weight, source))
    return MixtureSequences(components)


def resolve_vocab_size(cfg: PretrainConfig) -> str | None:
    """Set ``model.vocab_size`` from the data unless the user set it; the line to print.

    Unset: the data's vocabulary (``vocab_size`` in ``tokens.json``, 256 for the embedded
    corpus) rounded up to a multiple of 64; synthetic data keeps the model's default.
    Set: a value below the data's is refused (when the data is there: a plan made away
    from the data needs only the set value; the run opening it checks again). Returns what was chosen for data from a token directory,
    else ``None``.
    """
    chosen = "model.vocab_size" not in cfg.key_sources
    if cfg.data.path == SYNTHETIC and not cfg.data.sources:
        return None
    if cfg.data.path == STDLIB and not cfg.data.sources:
        if chosen:
            cfg.model.vocab_size = -(-BYTE_VOCAB // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return None
    if not chosen:
        paths = [s.path for s in cfg.data.sources] or [cfg.data.path]
        if not all(Path(p).exists() for p in paths):
            return None
        info = training_data_info(cfg.data)
        if info is not None and info.vocab_size > cfg.model.vocab_size:
            raise DataError(f"{info.sidecar}: the data's vocab_size {info.vocab_size} exceeds "
                            f"model.vocab_size={cfg.model.vocab_size}")
        return None
    info = training_data_info(cfg.data)
    assert info is not None
    cfg.model.vocab_size = -(-info.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return (f"model.vocab_size={cfg.model.vocab_size}: the data's vocabulary of {info.vocab_size} "
            f"({info.sidecar}) rounded up to a multiple of {VOCAB_MULTIPLE}")
