"""Run a command with a time limit, and past it kill every process it started.

A tool that launches ``torch.distributed.run`` cannot stop a hung run by killing its
process group: torchrun starts each rank in a session of its own, so a group kill
leaves the ranks running (on a GPU: spinning, and slowing whatever the tool runs next).
``kill_tree`` finds the descendants through Linux's ``/proc`` instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process descended from it (Linux ``/proc``), parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone since the listing
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_tree(pid: int, wait_s: float = 30.0) -> None:
    """Stop ``pid`` and its descendants (so none starts another), kill them all, and wait up
    to ``wait_s`` until they are gone (a GPU's memory is free again when this returns)."""
    tree = descendants(pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        tree = list(dict.fromkeys(tree + descendants(pid)))
        for p in tree:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)


def run_with_timeout(cmd: list[str], timeout_s: float, **popen: Any) -> tuple[int, bool]:
    """``(exit status, timed out)`` of ``cmd``; past ``timeout_s`` it is killed with every
    process it started (``kill_tree``) and its status is the kill's."""
    proc = subprocess.Popen(cmd, **popen)
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        return proc.wait(), True
