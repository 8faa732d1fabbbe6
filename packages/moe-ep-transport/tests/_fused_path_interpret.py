"""The GPU path on CPU (:mod:`_thread_peers`) equals the reference ops bit for bit, then ``ok``.

A training step (dispatch with the weights, a toy expert, combine, backward) on rank
threads, once with every ``ops`` kernel (Triton under the interpreter) and once under
``use_reference_kernels`` (the puts stay kernels, as on CUDA): rows, offsets, output and
input gradient equal bit for bit; the weights' gradient within rounding (the kernel sums
its dot products in another order). FP32 rows (the interpreter rounds to BF16 towards zero).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, str(Path(__file__).parent))
from _oracle import experts, make_data  # noqa: E402
from _thread_peers import ThreadPeerMemory, ThreadPeers, kernels_on_cpu  # noqa: E402
from moe_ep_transport import EPConfig, EPDispatcher, use_reference_kernels  # noqa: E402
from moe_ep_transport.rowwise import RowwiseTransport, slab_bytes_for  # noqa: E402


def step(cfg: EPConfig, M: int, tokens: list[int], skew: float) -> list[tuple[torch.Tensor, ...]]:
    E, K, D = cfg.n_experts, cfg.top_k, cfg.d_model
    data = make_data(tokens, E, K, D, torch.float32, seed=11, skew=skew)
    peers = ThreadPeers(M, slab_bytes_for(cfg, M, D * 4))

    def rank_main(rank: int) -> tuple[torch.Tensor, ...]:
        dispatcher = EPDispatcher(cfg, RowwiseTransport(ThreadPeerMemory(peers, rank), cfg), seed=5)
        L = E // M
        x = data.x[rank].clone().requires_grad_(True)
        w = data.w[rank].clone().requires_grad_(True)
        outs, pipelined = [], 0
        W_L = data.W[rank * L : (rank + 1) * L]
        if cfg.overlap_chunks > 1:  # the chunked pipeline: a dispatch and combine per chunk
            pipelined, _ = dispatcher.run_experts(x, data.ids[rank], w, lambda r, o: experts(r, o, W_L))
            outs.append(pipelined.detach())
        for _ in range(2):  # a second call: the slabs alternate, the route state is fresh
            rows, offsets, handle = dispatcher.dispatch(x, data.ids[rank], w)
            y = dispatcher.combine(experts(rows, offsets, W_L), w, handle)
            outs += [rows.detach(), offsets, y.detach()]
        (y + pipelined).backward(data.g[rank])
        return (*outs, x.grad, w.grad)

    return peers.run(rank_main)


def check_copy_engine(cfg: EPConfig, M: int, tokens: list[int], skew: float) -> None:
    """The copy engines' bulk moves (a memmove between the rank threads here) give the bits of the put
    kernel's stores: every output and gradient equal, the weights' gradient too (the same kernels)."""
    bulk = step(replace(cfg, copy_engine=True), M, tokens, skew)
    stores = step(cfg, M, tokens, skew)
    for rank, (got, want) in enumerate(zip(bulk, stores, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), (cfg, M, rank, i)


def check(cfg: EPConfig, M: int, tokens: list[int], skew: float) -> None:
    fused = step(cfg, M, tokens, skew)
    with use_reference_kernels(True):
        reference = step(cfg, M, tokens, skew)
    for rank, (got, want) in enumerate(zip(fused, reference, strict=True)):
        for i, (a, b) in enumerate(zip(got[:-1], want[:-1], strict=True)):
            assert torch.equal(a, b), (cfg, M, rank, i)
        assert torch.allclose(got[-1], want[-1], rtol=1e-5, atol=1e-6), (cfg, M, rank)


if __name__ == "__main__":
    kernels_on_cpu()
    for combine in ("source", "destination"):
        # EP2: token inbox; drops (capacity 1.0 under skew); a rank with fewer tokens.
        check(EPConfig(8, 2, 12, 16, capacity_factor=1.0, combine=combine), 2, [12, 7], 2.0)
    # Top-1: a token feeds one slot, so every put (combine's backward at the destination
    # included) goes one row per slot, no token inbox.
    check(EPConfig(8, 1, 12, 16, capacity_factor=None, combine="destination"), 2, [12, 7], 1.0)
    # Two chunks pipelined (each its own dispatch and combine), then unsplit calls on top.
    check(EPConfig(8, 2, 12, 16, capacity_factor=None, combine="destination", overlap_chunks=2), 2, [12, 7], 1.0)
    # EP4 at top-2 and capacity factor 1 sends one row per slot (the token inbox would not fit).
    check(EPConfig(8, 2, 6, 16, capacity_factor=1.0, combine="source"), 4, [6, 5, 6, 3], 1.0)
    # The copy engines' blocks: token inbox sends (both sites) and the partial sums, on two and four
    # ranks (a block per other rank), with drops and a rank with fewer tokens.
    for combine in ("source", "destination"):
        check_copy_engine(EPConfig(8, 2, 12, 16, capacity_factor=1.0, combine=combine), 2, [12, 7], 2.0)
    check_copy_engine(EPConfig(8, 2, 6, 16, capacity_factor=None, combine="destination"), 4, [6, 5, 6, 3], 1.0)
    print("fused path ok")
