"""Expert-parallel dispatch with quantized payloads (``parallel.ep_payload=mxfp8`` and
``fp8_rowwise``) on two gloo ranks, against an oracle: the same dispatch without a codec
on inputs that went through the format first (``moe_mxfp8.dequantize(quantize(x))``,
``dequantize_fp8(quantize_fp8(x))`` with the rowwise recipe's power-of-two row scales).
The uncoded dispatch is checked against the local MoE computation in moe-ep-transport's
own tests; here the payload must change nothing but the rows' values, and exactly as
the format rounds them, on both transports (the receive buffers sized by the codec's
``packed_width``). Gradients pass the codec straight through (a transport's backward
sends gradients uncoded), so the input gradient equals the oracle's too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from moe_ep_transport import EPConfig, EPDispatcher, make_transport
from moe_mxfp8 import (
    FP8RowCodec,
    MXFP8RowCodec,
    dequantize,
    dequantize_fp8,
    quantize,
    quantize_fp8_reference,
)
from moe_testing import run_distributed

E, K, D, T = 4, 2, 64, 12  # D: two MXFP8 blocks a row


def _mxfp8_rounded(x: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize(x, -1, backend="reference"), -1, dtype=x.dtype, backend="reference")


def _fp8_rowwise_rounded(x: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8(quantize_fp8_reference(x, (1, 0), pow2=True), x.dtype)


PAYLOADS = {  # parallel.ep_payload -> (its codec, the format's round trip)
    "mxfp8": (MXFP8RowCodec(backend="reference"), _mxfp8_rounded),
    "fp8_rowwise": (FP8RowCodec(), _fp8_rowwise_rounded),
}


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


def _coded_vs_quantized_inputs(payload: str) -> list[str]:
    rank = dist.get_rank()
    x, ids, w, W = _data(rank)
    W_local = W[rank * (E // 2):(rank + 1) * (E // 2)]
    codec, rounded = PAYLOADS[payload]
    x_q = rounded(x)
    assert not torch.equal(x_q, x)  # the format rounds these rows
    assert torch.equal(codec.decode(codec.encode(x), torch.bfloat16), x_q)
    failures = []
    cfg = EPConfig(E, K, T, D, capacity_factor=None)
    for backend in ("all_to_all", "rowwise"):
        coded = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.bfloat16, codec=codec),
                             codec=codec)
        plain = EPDispatcher(cfg, make_transport(backend, cfg, dtype=torch.bfloat16))
        got, want = _step(coded, x, ids, w, W_local), _step(plain, x_q, ids, w, W_local)
        failures += [f"{backend}: {key}" for key in want if not torch.equal(got[key], want[key])]
        if int(got["offsets"][-1]) == 0:
            failures.append(f"{backend}: rank {rank} received no rows")
    return failures


@pytest.mark.multiprocess
@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_dispatch_equals_dispatching_rounded_rows(payload):
    assert run_distributed(_coded_vs_quantized_inputs, 2, payload, timeout=120) == [[], []]
