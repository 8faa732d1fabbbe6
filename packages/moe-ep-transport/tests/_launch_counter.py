"""Count what dispatch and combine launch on the GPU path, per direction, on CPU.

EP ranks run as threads (:mod:`_thread_peers`): the rowwise transport's put kernels,
and every ``ops`` device function on its Triton kernel, run under the interpreter
(``TRITON_INTERPRET=1``) exactly as they launch on CUDA. A *launch* is:

- a Triton kernel launch (``InterpretedFunction.run``: one grid, one CUDA launch);
- a barrier (a ``threading.Barrier`` here, one flag kernel on CUDA: ``_PEER_LAUNCHES``);
- any other aten op that computes (not a view, not an allocation without a fill),
  outside those calls: each is one CUDA launch.

Host calls (Python and C function calls outside kernels and barriers) measure the
Python work of issuing a call. Directions: ``dispatch`` and ``combine`` forward in a
training step, then their backward (``combine_backward`` runs first), and a no-grad
``dispatch`` + ``combine`` (``no_grad``). Rank 0 is counted.

``TRITON_INTERPRET=1 python tests/_launch_counter.py --ranks 2 --experts 8`` prints the table.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))

# GPU launches of a peer-memory call that is no Triton launch here: the flag barrier kernel,
# and none for a barrier the next kernel passes (``PeerMemory.deferred_barrier``).
_PEER_LAUNCHES = {"barrier": 1, "deferred_barrier": 0}
# Aten ops that launch nothing: views, metadata, allocations without a fill.
_NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "slice", "select", "unsqueeze",
    "squeeze", "expand", "permute", "t", "transpose", "detach", "alias", "unbind", "split",
    "split_with_sizes", "narrow", "empty", "empty_like", "new_empty", "empty_strided",
    "new_empty_strided", "lift_fresh", "promote_types", "result_type", "is_same_size",
}
DIRECTIONS = ("dispatch", "combine", "combine_backward", "dispatch_backward", "no_grad")

# Launches per direction (Triton kernels + barrier kernels), by combine site, on the rank
# threads; no aten op launches. Every put's barrier is passed by the kernel that reads what
# it put. Dispatch: slot ranks (hist, block scan + count put), cell plan (+ the counts'
# barrier, telemetry), row plan, token put, receive. Combine: put, sum. Combine's backward
# at the source: scaled gradients, put, receive; at the destination: token put, receive
# (+ row and weight gradients), weight put (+ zeroing the dropped slots), the copy out of
# the slab.
KERNELS = {
    "source": {"dispatch": 6, "combine": 2, "combine_backward": 3, "dispatch_backward": 2, "no_grad": 8},
    "destination": {"dispatch": 6, "combine": 2, "combine_backward": 4, "dispatch_backward": 2, "no_grad": 8},
}
# Where barriers pass inside kernels (NVSHMEM; ``PeerMemory.barriers_in_kernels``) the cell
# plan runs in the block scan's last program: one launch fewer per dispatch. The rank threads
# cannot run that path (their barriers are host waits between launches); ``test_gpu``
# counts it on a GPU.
KERNELS_WITH_BARRIERS_IN_KERNELS = {
    site: {d: n - (d in ("dispatch", "no_grad")) for d, n in per_direction.items()}
    for site, per_direction in KERNELS.items()
}


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


def count_directions(combine: str, n_experts: int, ranks: int, tokens: int = 12, top_k: int = 2) -> dict[str, dict]:
    """Rank 0's launches of each direction (module docstring), ``ranks`` rank threads."""
    import threading

    import triton.runtime.interpreter as interpreter
    from _oracle import make_data
    from _thread_peers import ThreadPeerMemory, ThreadPeers, kernels_on_cpu
    from moe_ep_transport import EPConfig, EPDispatcher
    from moe_ep_transport.rowwise import RowwiseTransport, slab_bytes_for

    kernels_on_cpu()
    E, K, D, M = n_experts, top_k, 16, ranks
    cfg = EPConfig(E, K, tokens, D, capacity_factor=1.0, combine=combine)
    peers = ThreadPeers(M, slab_bytes_for(cfg, M, D * 4))
    data = make_data([tokens] * M, E, K, D, torch.float32, seed=3, skew=1.0)
    counter = LaunchCounter()
    counting = threading.get_ident()  # set by rank 0's thread

    def rank_main(rank: int) -> dict[str, dict] | None:
        nonlocal counting
        memory = ThreadPeerMemory(peers, rank)
        dispatcher = EPDispatcher(cfg, RowwiseTransport(memory, cfg))
        x, ids, w, g = data.x[rank], data.ids[rank], data.w[rank], data.g[rank]

        def phase(name: str):
            def switch(*_: object) -> None:
                counter.phase = name
            return switch if rank == 0 else (lambda *_: None)

        def training() -> None:  # as the MoE layer calls them: the weights are given to dispatch too
            xg, wg = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            phase("dispatch")()
            rows, _, handle = dispatcher.dispatch(xg, ids, wg)
            rows.register_hook(phase("dispatch_backward"))  # combine's backward has returned
            phase("combine")()
            y = dispatcher.combine(rows, wg, handle)
            y.register_hook(phase("combine_backward"))
            y.backward(g)
            with torch.no_grad():
                phase("no_grad")()
                rows, _, handle = dispatcher.dispatch(x, ids, w)
                dispatcher.combine(rows, w, handle)
            phase("none")()

        if rank != 0:
            training()
            training()
            return None
        with LaunchCounter():  # warm-up: cached index tensors, the telemetry's sums, the mode's one-off set-up
            training()
        counting = threading.get_ident()
        for name in _PEER_LAUNCHES:
            setattr(memory, name, counter.wrap(counter.peer, name, getattr(memory, name)))
        with counter:
            sys.setprofile(counter.profile)
            try:
                training()
            finally:
                sys.setprofile(None)
        return {d: counter.summary(d) for d in DIRECTIONS}

    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if threading.get_ident() != counting:
            return run(self, *args, **kwargs)
        return counter.wrap(counter.triton, self.fn.__name__, run)(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted_run
    try:
        return peers.run(rank_main)[0]
    finally:
        interpreter.InterpretedFunction.run = run


def _table(counts: dict[str, dict]) -> str:
    lines = [f"{'direction':18} {'launches':>8} {'kernels':>7} {'aten':>4} {'host calls':>10}  what"]
    for d, c in counts.items():
        what = ", ".join(f"{n} x{k}" if k > 1 else n for part in ("triton", "peer", "aten")
                         for n, k in c[part].items())
        lines.append(f"{d:18} {c['launches']:8} {c['kernels']:7} {sum(c['aten'].values()):4} "
                     f"{c['host_calls']:10}  {what}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--combine", choices=("source", "destination"), nargs="+",
                        default=["source", "destination"])
    args = parser.parse_args()
    for combine in args.combine:
        print(f"EP{args.ranks}, {args.experts} experts, combine summing at the {combine} (rank 0):")
        print(_table(count_directions(combine, args.experts, args.ranks)))


if __name__ == "__main__":
    main()
