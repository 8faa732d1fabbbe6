"""Training data: token files, the embedded corpus, synthetic tokens, and batch order.

- ``files``: the on-disk format (headerless ``uint16``/``uint32`` + ``tokens.json``).
- ``sources``: indexable sequence sources (token streams, stdlib bytes, synthetic).
- ``order``: the global order, a keyed permutation per epoch (layout-independent).
- ``batches``: a rank's slice of each global batch, by DP rank and microbatch.
- ``prepare``: ``pretrain prepare-data`` (text to a token directory).
"""

from pretrain.data.batches import BatchReader
from pretrain.data.files import (
    DataError,
    TokenArrays,
    TokenDirInfo,
    TokenizerRecord,
    open_token_files,
    token_dir_info,
)
from pretrain.data.order import GlobalOrder, feistel_permute
from pretrain.data.prepare import PreparedData, prepare_data
from pretrain.data.sources import (
    STDLIB,
    SYNTHETIC,
    SequenceSource,
    StreamSequences,
    SyntheticSequences,
    open_source,
)

__all__ = [
    "STDLIB",
    "SYNTHETIC",
    "BatchReader",
    "DataError",
    "GlobalOrder",
    "PreparedData",
    "SequenceSource",
    "StreamSequences",
    "SyntheticSequences",
    "TokenArrays",
    "TokenDirInfo",
    "TokenizerRecord",
    "feistel_permute",
    "open_source",
    "open_token_files",
    "prepare_data",
    "token_dir_info",
]
