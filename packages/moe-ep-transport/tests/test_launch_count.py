"""Dispatch and combine launch a small, fixed number of device operations (a regression guard).

Their cost at per-layer sizes was host time: a hundred and more small launches per
dispatch, not bytes. On CUDA every ``moe_ep_transport.ops`` device function is one
Triton launch (``rank_slots`` two, with its block scan), every ``PeerMemory.put_rows``
one kernel and every barrier one NVSHMEM launch; any other aten op that computes
(not a view, not an allocation) is one more CUDA launch. On CPU the same code runs
with the PyTorch references and the emulated peer memory, so counting aten ops
*outside* those calls, plus the calls at their GPU cost, gives the launches of the
GPU path without a GPU.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from moe_testing import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import make_data  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, make_transport, ops  # noqa: E402

# GPU launches per call of each device function (ops: Triton; memory: put kernel, NVSHMEM barrier).
_GPU_LAUNCHES = {"rank_slots": 2, "plan_cells": 1, "plan_rows": 1, "finish_receive": 1,
                 "topk_gather_sum": 1, "combine_grads": 1, "sum_partials": 1,
                 "put_rows": 1, "put_partial_sums": 1, "barrier": 1}
_OPS = ("rank_slots", "plan_cells", "plan_rows", "finish_receive", "topk_gather_sum", "combine_grads",
        "sum_partials")
_MEMORY = ("put_rows", "put_partial_sums", "barrier")
# Aten ops that launch nothing: views, metadata, allocations without a fill.
_NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "unsqueeze",
    "squeeze", "expand", "permute", "t", "transpose", "detach", "alias", "unbind", "split",
    "split_with_sizes", "narrow", "empty", "empty_like", "new_empty", "empty_strided",
    "new_empty_strided", "lift_fresh", "promote_types", "result_type",
}
# Bounds: one no-grad dispatch+combine; one training step (dispatch, combine, both backwards),
# summing at the source / at the destinations (EPConfig.combine).
_MAX_FORWARD = {"source": 13, "destination": 13}
_MAX_TRAINING = {"source": 24, "destination": 24}


class _LaunchCounter(TorchDispatchMode):
    """Counts launching aten ops, except inside calls that :meth:`device_call` accounts for."""

    def __init__(self) -> None:
        super().__init__()
        self.aten: collections.Counter[str] = collections.Counter()
        self.device: collections.Counter[str] = collections.Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and name not in _NO_LAUNCH:
            self.aten[name] += 1
        return func(*args, **(kwargs or {}))

    def device_call(self, name: str, fn):
        def call(*args, **kwargs):
            if not self._inside:
                self.device[name] += 1
            self._inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= 1

        return call

    @property
    def launches(self) -> int:
        return sum(self.aten.values()) + sum(_GPU_LAUNCHES[n] * c for n, c in self.device.items())


def _count_launches(combine: str) -> dict:
    rank = dist.get_rank()
    E, K, D = 8, 2, 16
    cfg = EPConfig(E, K, 12, D, capacity_factor=1.0, combine=combine)
    transport = make_transport("rowwise", cfg, dtype=torch.bfloat16)
    dispatcher = EPDispatcher(cfg, transport)
    data = make_data([12, 12], E, K, D, torch.bfloat16, seed=3, skew=1.0)
    x, ids, w, g = data.x[rank], data.ids[rank], data.w[rank].float(), data.g[rank]

    # As the MoE layer calls them: the weights are given to dispatch too.
    def forward() -> None:
        with torch.no_grad():
            rows, _, handle = dispatcher.dispatch(x, ids, w)
            dispatcher.combine(rows, w, handle)

    def training() -> None:
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        rows, _, handle = dispatcher.dispatch(xg, ids, wg)
        dispatcher.combine(rows, wg, handle).backward(g)

    counts = {}
    for name, step in (("forward", forward), ("training", training)):
        step()  # warm-up: cached index tensors and telemetry sums are built once
        counter = _LaunchCounter()
        patched = {}
        for fn_name in _OPS:
            patched[fn_name] = getattr(ops, fn_name)
            setattr(ops, fn_name, counter.device_call(fn_name, patched[fn_name]))
        memory = transport.memory
        for fn_name in _MEMORY:
            setattr(memory, fn_name, counter.device_call(fn_name, getattr(type(memory), fn_name).__get__(memory)))
        try:
            with counter:
                step()
        finally:
            for fn_name, fn in patched.items():
                setattr(ops, fn_name, fn)
            for fn_name in _MEMORY:
                delattr(memory, fn_name)
        counts[name] = dict(launches=counter.launches, aten=dict(counter.aten), device=dict(counter.device))
    return counts


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("combine", ["source", "destination"])
def test_dispatch_and_combine_launch_few_device_operations(combine: str) -> None:
    out = run_distributed(_count_launches, 2, combine, timeout=120)
    at_source = {"topk_gather_sum"}
    at_destination = {"sum_partials", "put_partial_sums"}
    used = set(_GPU_LAUNCHES) - (at_destination if combine == "source" else at_source)
    for counts in out:
        fwd, train = counts["forward"], counts["training"]
        # Every device function is reached (a renamed one would silently count nothing).
        assert set(train["device"]) == used, train
        assert set(fwd["device"]) == used - {"combine_grads"}, fwd
        puts = 3  # counts, tokens (with the weights), rows or partials back
        assert fwd["device"]["put_rows"] + fwd["device"].get("put_partial_sums", 0) == puts, fwd
        assert fwd["device"]["barrier"] == puts, fwd
        assert fwd["launches"] <= _MAX_FORWARD[combine], fwd
        assert train["launches"] <= _MAX_TRAINING[combine], train
