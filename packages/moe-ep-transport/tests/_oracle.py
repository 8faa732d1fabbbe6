"""Test helpers: seeded routing data, a toy expert, and the all-experts-on-one-rank oracle.

The oracle is the local (non-parallel) MoE computation written in plain torch:
every token's top-k experts applied to it directly and summed with its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class MoEData:
    x: list[torch.Tensor]  # per rank [T_r, D]
    ids: list[torch.Tensor]  # per rank [T_r, k] global expert ids
    w: list[torch.Tensor]  # per rank [T_r, k] routing weights
    g: list[torch.Tensor]  # per rank [T_r, D] upstream gradient
    W: torch.Tensor  # [E, D, D] expert weights


def make_data(
    tokens: list[int], E: int, k: int, D: int, dtype: torch.dtype, seed: int,
    banned: tuple[int, ...] = (), skew: float = 0.0,
) -> MoEData:
    """Identical on every rank. ``banned`` experts get no token; ``skew`` favours low ids."""
    gen = torch.Generator().manual_seed(seed)
    xs, ids, ws, gs = [], [], [], []
    for T in tokens:
        xs.append(torch.randn(T, D, generator=gen, dtype=torch.float64).to(dtype))
        logits = torch.randn(T, E, generator=gen, dtype=torch.float64) + skew * torch.linspace(2, 0, E, dtype=torch.float64)
        logits[:, list(banned)] = -math.inf
        top = torch.topk(logits, k, dim=1)
        ids.append(top.indices)
        ws.append(torch.softmax(top.values, dim=1).to(dtype))
        gs.append(torch.randn(T, D, generator=gen, dtype=torch.float64).to(dtype))
    W = (torch.randn(E, D, D, generator=gen, dtype=torch.float64) / math.sqrt(D)).to(dtype)
    return MoEData(xs, ids, ws, gs, W)


def experts(rows_CD: torch.Tensor, offsets_L: torch.Tensor, W_LDD: torch.Tensor) -> torch.Tensor:
    """A toy grouped expert, ``tanh(rows @ W_e)`` per expert segment; padding rows give 0."""
    pieces, start = [], 0
    for e, end in enumerate(offsets_L.tolist()):
        pieces.append(torch.tanh(rows_CD[start:end] @ W_LDD[e]))
        start = end
    pieces.append(rows_CD[start:] * 0)
    return torch.cat(pieces)


def oracle(data: MoEData, keep: list[torch.Tensor]):
    """Local MoE on all ranks' tokens; ``keep[r]`` masks dropped slots (weight 0, not renormalised)."""
    W = data.W.clone().requires_grad_(True)
    xs = [x.clone().requires_grad_(True) for x in data.x]
    ws = [w.clone().requires_grad_(True) for w in data.w]
    ys = []
    loss = 0
    for x, ids, w, g, m in zip(xs, data.ids, ws, data.g, keep, strict=True):
        out = torch.tanh(torch.einsum("td,tkde->tke", x, W[ids]))
        y = (out * (w * m)[..., None]).sum(1)
        ys.append(y.detach())
        loss = loss + (y * g).sum()
    loss.backward()
    return ys, [x.grad for x in xs], [w.grad for w in ws], W.grad


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Elementwise |got - want| <= tol * (1 + |want|).

    (``torch.testing.assert_close`` imports DTensor and sympy, which costs each
    test process many seconds.)
    """
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    err = ((got - want).abs() / (1 + want.abs())).max() if got.numel() else torch.tensor(0.0)
    assert float(err) <= tol, f"{what}: relative error {float(err):.3g} > {tol}"


def all_gather_objects(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class BytesCodec:
    """A trivial RowCodec: a BF16 row as its bytes."""

    def packed_width(self, d: int) -> int:
        return 2 * d

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(torch.bfloat16).contiguous().view(torch.uint8)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return packed.contiguous().view(torch.bfloat16).to(dtype)
