"""The saving process of the crash test: it parks at a named phase until killed.

``run`` is the target of a process started from a forkserver that has torch
imported already (a child costs a fork, not a torch import). When the save
reaches ``phase`` the process writes ``marker`` and sleeps; the test then kills
it with SIGKILL.
"""

import time
from pathlib import Path

import torch
from moe_ckpt import Checkpointer, CheckpointerConfig, StorageOptions


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(64, 16, generator=g), "b": torch.randn(33, generator=g).bfloat16()}


def run(root: str, step: int, phase: str, marker: str) -> None:

    def park(reached: str) -> None:
        if reached == phase:
            Path(marker).write_text(reached)
            time.sleep(600)

    config = CheckpointerConfig(
        keep_last=1,
        async_save=False,
        storage=StorageOptions(kvstore="file", target_chunk_bytes=512),
    )
    with Checkpointer(root, config, on_phase=park) as ckpt:
        ckpt.save(step, state(step), {"step": step})
