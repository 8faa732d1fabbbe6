"""Training data: token files, the embedded corpus, synthetic tokens, mixtures, batch order.

- ``files``: the on-disk format (headerless ``uint16``/``uint32`` + ``tokens.json``).
- ``sources``: indexable sequence sources (token streams, stdlib bytes, synthetic).
- ``mixture``: weighted mixtures of token directories and their order (``data.sources``).
- ``order``: the global order, a keyed permutation per epoch (layout-independent).
- ``batches``: a rank's slice of each global batch, by DP rank and microbatch.
- ``training``: a run's source and vocabulary from its ``data`` config.
- ``prepare`` (with ``inputs``, ``encode``, ``writer``, ``output``, ``progress``):
  ``pretrain prepare-data`` (a corpus to a token directory).
"""

from pretrain.data.batches import BatchReader
from pretrain.data.files import (
    DataError,
    DocumentIndex,
    TokenArrays,
    TokenDirInfo,
    TokenizerRecord,
    open_token_files,
    read_document_starts,
    token_dir_info,
)
from pretrain.data.mixture import MixtureSequences, sample_order
from pretrain.data.order import GlobalOrder, feistel_permute
from pretrain.data.prepare import Interrupted, PreparedData, default_workers, prepare_data
from pretrain.data.sources import (
    STDLIB,
    SYNTHETIC,
    SequenceSource,
    StreamSequences,
    SyntheticSequences,
    open_source,
)
from pretrain.data.training import (
    document_eos_id,
    open_data,
    resolve_vocab_size,
    training_data_info,
)

__all__ = [
    "STDLIB",
    "SYNTHETIC",
    "BatchReader",
    "DataError",
    "DocumentIndex",
    "GlobalOrder",
    "Interrupted",
    "MixtureSequences",
    "PreparedData",
    "SequenceSource",
    "StreamSequences",
    "SyntheticSequences",
    "TokenArrays",
    "TokenDirInfo",
    "TokenizerRecord",
    "default_workers",
    "document_eos_id",
    "feistel_permute",
    "open_data",
    "open_source",
    "open_token_files",
    "prepare_data",
    "read_document_starts",
    "resolve_vocab_size",
    "sample_order",
    "token_dir_info",
    "training_data_info",
]
