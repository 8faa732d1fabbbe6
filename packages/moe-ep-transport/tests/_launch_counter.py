"""Count what dispatch and combine launch on the fused (Triton) path, per direction, on CPU.

Each gloo rank runs the rowwise transport with every ``ops`` device function on its
Triton kernel under ``TRITON_INTERPRET=1`` (``fused_kernels_enabled`` patched to true
for CPU tensors, so ``backend="auto"`` takes the kernel as on CUDA). A *launch* is:

- a Triton kernel launch (``InterpretedFunction.run``: one grid, the CUDA launch);
- a peer-memory put or barrier (``EmulatedPeerMemory`` emulates them with gloo
  all-gathers; on CUDA each is one kernel: ``_PEER_LAUNCHES``);
- any other aten op that computes (not a view, not an allocation without a fill),
  outside those calls: each is one CUDA launch.

Host calls (Python and C function calls outside kernels and peer-memory calls) measure
the Python work of issuing a call. Directions: ``dispatch`` and ``combine`` forward in
a training step, then their backward (``combine_backward`` runs first), and a no-grad
``dispatch`` + ``combine`` (``no_grad``).

``python tests/_launch_counter.py --ranks 2 --experts 8`` prints the table.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

# GPU launches of a peer-memory call (put kernel, flag barrier kernel).
_PEER_LAUNCHES = {"put_rows": 1, "put_partial_sums": 1, "barrier": 1}
# Aten ops that launch nothing: views, metadata, allocations without a fill.
_NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "unsqueeze",
    "squeeze", "expand", "permute", "t", "transpose", "detach", "alias", "unbind", "split",
    "split_with_sizes", "narrow", "empty", "empty_like", "new_empty", "empty_strided",
    "new_empty_strided", "lift_fresh", "promote_types", "result_type", "is_same_size",
}
DIRECTIONS = ("dispatch", "combine", "combine_backward", "dispatch_backward", "no_grad")


class LaunchCounter(TorchDispatchMode):
    """Counts launches by direction (``phase``); see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "none"
        self.triton: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.peer: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.aten: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.host_calls: collections.Counter[str] = collections.Counter()
        self._inside = 0

    def profile(self, frame, event: str, arg) -> None:
        if not self._inside and event in ("call", "c_call"):
            self.host_calls[self.phase] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside and name not in _NO_LAUNCH:
            self.aten[self.phase][name] += 1
        return func(*args, **(kwargs or {}))

    def wrap(self, kind: dict, name: str, fn):
        def call(*args, **kwargs):
            if not self._inside:
                kind[self.phase][name] += 1
            self._inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside -= 1

        return call

    def summary(self, phase: str) -> dict:
        triton, peer, aten = self.triton[phase], self.peer[phase], self.aten[phase]
        kernels = sum(triton.values()) + sum(_PEER_LAUNCHES[n] * c for n, c in peer.items())
        return dict(launches=kernels + sum(aten.values()), kernels=kernels, triton=dict(triton),
                    peer=dict(peer), aten=dict(aten), host_calls=self.host_calls[phase])


def count_directions(combine: str, n_experts: int, tokens: int = 12, top_k: int = 2) -> dict[str, dict]:
    """On every rank of the default gloo group: the launches of each direction (module docstring)."""
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules and not sys.modules["triton"].runtime.interpreter.interpreter_builder:
        raise RuntimeError("triton was imported before TRITON_INTERPRET was set")
    import triton.runtime.interpreter as interpreter

    from _oracle import make_data
    from moe_ep_transport import EPConfig, EPDispatcher, _triton_support, make_transport

    _triton_support.fused_kernels_enabled = lambda device: not _triton_support.reference_kernels_enabled()
    rank, M = dist.get_rank(), dist.get_world_size()
    E, K, D = n_experts, top_k, 16
    cfg = EPConfig(E, K, tokens, D, capacity_factor=1.0, combine=combine)
    transport = make_transport("rowwise", cfg, dtype=torch.float32)
    dispatcher = EPDispatcher(cfg, transport)
    data = make_data([tokens] * M, E, K, D, torch.float32, seed=3, skew=1.0)
    x, ids, w, g = data.x[rank], data.ids[rank], data.w[rank], data.g[rank]
    counter = LaunchCounter()

    def phase(name: str):
        def switch(*_: object) -> None:
            counter.phase = name
        return switch

    def training() -> None:  # as the MoE layer calls them: the weights are given to dispatch too
        xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        counter.phase = "dispatch"
        rows, _, handle = dispatcher.dispatch(xg, ids, wg)
        rows.register_hook(phase("dispatch_backward"))  # combine's backward has returned
        counter.phase = "combine"
        y = dispatcher.combine(rows, wg, handle)
        y.register_hook(phase("combine_backward"))
        y.backward(g)
        counter.phase = "none"
        with torch.no_grad():
            counter.phase = "no_grad"
            rows, _, handle = dispatcher.dispatch(x, ids, w)
            dispatcher.combine(rows, w, handle)
        counter.phase = "none"

    training()  # warm-up: cached index tensors, the telemetry's sums
    run = interpreter.InterpretedFunction.run
    memory = transport.memory
    interpreter.InterpretedFunction.run = lambda self, *a, **k: counter.wrap(
        counter.triton, self.fn.__name__, run)(self, *a, **k)
    for name in _PEER_LAUNCHES:
        setattr(memory, name, counter.wrap(counter.peer, name, getattr(type(memory), name).__get__(memory)))
    try:
        with counter:
            sys.setprofile(counter.profile)
            try:
                training()
            finally:
                sys.setprofile(None)
    finally:
        interpreter.InterpretedFunction.run = run
        for name in _PEER_LAUNCHES:
            delattr(memory, name)
    transport.close()
    return {d: counter.summary(d) for d in DIRECTIONS}


def _table(counts: dict[str, dict]) -> str:
    lines = [f"{'direction':18} {'launches':>8} {'kernels':>7} {'aten':>4} {'host calls':>10}  what"]
    for d, c in counts.items():
        what = ", ".join(f"{n} x{k}" if k > 1 else n for part in ("triton", "peer", "aten")
                         for n, k in c[part].items())
        lines.append(f"{d:18} {c['launches']:8} {c['kernels']:7} {sum(c['aten'].values()):4} "
                     f"{c['host_calls']:10}  {what}")
    return "\n".join(lines)


def main() -> None:
    from moe_testing import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--combine", choices=("source", "destination"), nargs="+",
                        default=["source", "destination"])
    args = parser.parse_args()
    for combine in args.combine:
        out = run_distributed(count_directions, args.ranks, combine, args.experts, timeout=300)
        print(f"EP{args.ranks}, {args.experts} experts, combine summing at the {combine} (rank 0):")
        print(_table(out[0]))


if __name__ == "__main__":
    main()
