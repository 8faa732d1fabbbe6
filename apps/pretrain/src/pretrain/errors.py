"""The errors a command foresees, and how the command line reports them.

Every error a user can cause (a bad key, a missing file, data that does not fit the
model, a checkpoint that cannot be loaded) derives from ``PretrainError``: ``pretrain``
prints it as one line, ``pretrain: error: <message>``, and exits with its
``exit_status``. Anything else is a bug and keeps its traceback. The module imports
nothing heavy, so the command line can name these classes before it loads torch.
"""

from __future__ import annotations


class PretrainError(Exception):
    """An error the run foresees; the message names the key, file or tensor at fault."""

    exit_status = 1


class UsageError(PretrainError):
    """A command line or config the run cannot use (exit status 2)."""

    exit_status = 2
