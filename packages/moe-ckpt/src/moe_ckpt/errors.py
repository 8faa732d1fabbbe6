"""Errors raised by moe-ckpt; each message names the tensor or file at fault."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be saved or loaded as asked."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a committed checkpoint, or lacks data a target needs."""


class MissingTensorError(CheckpointError, KeyError):
    """A requested tensor is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0])


class TensorMismatchError(CheckpointError):
    """A requested tensor's global shape or dtype differs from the stored one."""


class ChecksumError(CheckpointError):
    """Stored bytes do not match the checksum recorded when they were written."""


class PostCommitError(CheckpointError):
    """The checkpoint is committed (complete, loadable, resumed from); what follows failed.

    That is the ``committed`` phase hook, or a ``Checkpointer``'s ``latest`` pointer
    update, retention or cleanup. A caller may log it and train on: the next
    successful save redoes them.
    """
