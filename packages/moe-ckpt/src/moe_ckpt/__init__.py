"""moe_ckpt: topology-agnostic checkpoints of sharded tensors on tensorstore.

Every logical tensor is stored as one zarr v3 array of its global shape; each rank
writes only the boxes it owns and any rank can load any box or flat run of it, so
a run saved on one parallel layout resumes on another. Commits are atomic, saves
can run in the background, loads verify checksums, and a checkpoint exports to
Hugging Face safetensors in one CPU process. Depends on torch, tensorstore,
safetensors and numpy only; works with or without torch.distributed.
"""

from moe_ckpt.checkpointer import Checkpointer, CheckpointerConfig
from moe_ckpt.errors import (
    CheckpointError,
    ChecksumError,
    IncompleteCheckpointError,
    MissingTensorError,
    PostCommitError,
    TensorMismatchError,
)
from moe_ckpt.hf_export import export_hf
from moe_ckpt.load import load, open_checkpoint, read_tensor, read_tensors
from moe_ckpt.lock import DirectoryLock, DirectoryLockedError
from moe_ckpt.manifest import Manifest, TensorRecord
from moe_ckpt.save import save
from moe_ckpt.shards import BoxShardLike, FlatShard, FlatShardLike, Shard, ShardLike
from moe_ckpt.storage import StorageOptions

__all__ = [
    "BoxShardLike",
    "CheckpointError",
    "Checkpointer",
    "CheckpointerConfig",
    "ChecksumError",
    "DirectoryLock",
    "DirectoryLockedError",
    "FlatShard",
    "FlatShardLike",
    "IncompleteCheckpointError",
    "Manifest",
    "MissingTensorError",
    "PostCommitError",
    "Shard",
    "ShardLike",
    "StorageOptions",
    "TensorMismatchError",
    "TensorRecord",
    "export_hf",
    "load",
    "open_checkpoint",
    "read_tensor",
    "read_tensors",
    "save",
]
