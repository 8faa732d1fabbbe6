"""Expert-parallel dispatch with MXFP8 payloads (``parallel.ep_payload=mxfp8``) on two gloo
ranks, against an oracle: the same dispatch without a codec on inputs that went through
MXFP8 first (``moe_mxfp8.dequantize(quantize(x))``). The uncoded dispatch is checked
against the local MoE computation in moe-ep-transport's own tests; here the payload must
change nothing but the rows' values, and exactly as MXFP8 rounds them, on both
transports. Gradients pass the codec straight through (a transport's backward sends
gradients uncoded), so the input gradient equals the oracle's too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from moe_ep_transport import EPConfig, EPDispatcher, make_transport
from moe_mxfp8 import MXFP8RowCodec, dequantize, quantize
from moe_testing import run_distributed

E, K, D, T = 4, 2, 64, 12  # D: two MXFP8 blocks a row


def _data(rank: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(T, D, generator=gen) * torch.logspace(-2, 2, D)).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen).to(torch.bfloat16)
    W = (torch.randn(E, D, D, generator=torch.Generator().manual_seed(7)) / D**0.5).to(torch.bfloat16)
    return x, ids, w, W


def _step(dispatcher: EPDispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
          W_local: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    rows, offsets, handle = dispatcher.dispatch(x, ids, w)
    pieces, start = [], 0
    for e, end in enumerate(offsets.tolist()):
        pieces.append(rows[start:end] @ W_local[e])
        start = end
    pieces.append(rows[start:] * 0)
    y = dispatcher.combine(torch.cat(pieces), w, handle)
    y.float().square().sum().backward()
    return {"rows": rows.detach(), "offsets": offsets, "y": y.detach(), "dx": x.grad}


def _coded_vs_quantized_inputs() -> list[str]:
    rank = dist.get_rank()
    x, ids, w, W = _data(rank)
    W_local = W[rank * (E // 2):(rank + 1) * (E // 2)]
    x_mx = dequantize(*quantize(x, -1, backend="reference"), -1, dtype=torch.bfloat16, backend="reference")
    assert not torch.equal(x_mx, x)  # MXFP8 rounds these rows
    codec = MXFP8RowCodec(backend="reference")
    assert torch.equal(codec.decode(codec.encode(x), torch.bfloat16), x_mx)
    failures = []
    cfg = EPConfig(E, K, T, D, capacity_factor=None)
    for backend in ("all_to_all", "rowwise"):
        coded = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.bfloat16, codec=codec),
                             codec=codec)
        plain = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.bfloat16))
        got, want = _step(coded, x, ids, w, W_local), _step(plain, x_mx, ids, w, W_local)
        failures += [f"{backend}: {key}" for key in want if not torch.equal(got[key], want[key])]
        if int(got["offsets"][-1]) == 0:
            failures.append(f"{backend}: rank {rank} received no rows")
    return failures


@pytest.mark.multiprocess
def test_mxfp8_payload_dispatch_equals_dispatching_mxfp8_rounded_rows():
    assert run_distributed(_coded_vs_quantized_inputs, 2, timeout=120) == [[], []]
