"""Run a command with a time limit, and past it kill every process it started.

A test or tool that launches ``torch.distributed.run`` cannot stop a hung run with
``subprocess.run(timeout=...)`` (it kills torchrun alone) or by killing its process
group: torchrun starts each rank with setsid (a new process group), so the ranks keep running (on
a GPU: spinning, and slowing or hanging whatever runs next). ``kill_tree`` finds the
descendants through Linux's ``/proc`` instead.
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


def run_process_tree(cmd: list[str], *, timeout: float, capture_output: bool = False,
                     **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, timeout=timeout, ...)``, except that past ``timeout`` every
    process ``cmd`` started is killed too (``kill_tree``) before ``TimeoutExpired`` is
    raised (its ``output``/``stderr``: what was captured by then)."""
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(cmd, **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
