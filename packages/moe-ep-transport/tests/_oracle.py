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


def plan_cases():
    """(M, E, k, tokens per rank, capacity, skew) for the plan kernels: dropless, overflowing,
    ranks without tokens, E not a power of two, several slot blocks."""
    yield 2, 8, 2, [7, 5], 28, 0.0
    yield 4, 12, 3, [9, 0, 13, 4], 14, 2.0
    yield 1, 6, 2, [40], 60, 1.0
    yield 2, 64, 8, [300, 260], 3000, 3.0
    yield 4, 16, 4, [0, 0, 0, 0], 8, 0.0


def check_plan_kernels(device: str) -> None:
    """The Triton plan kernels on ``device`` (``ops.<step>(..., backend="triton")``) equal the
    PyTorch definitions (on CPU) bit for bit."""
    from moe_ep_transport import ops, plan_reference

    def same(got, want) -> bool:
        return all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))

    gen = torch.Generator().manual_seed(3)
    cases_overflowing = 0
    for M, E, k, tokens, capacity, skew in plan_cases():
        ids = [torch.topk(torch.randn(T, E, generator=gen) + skew * torch.linspace(3, 0, E), k, dim=1)
               .indices.reshape(-1) for T in tokens]
        slots = [plan_reference.rank_slots_reference(expert_N, E) for expert_N in ids]
        for expert_N, want in zip(ids, slots, strict=True):
            for dtype in (torch.int64, torch.int32):
                assert same(ops.rank_slots(expert_N.to(device, dtype), E, backend="triton"), want), (M, E, dtype)
        counts_ME = torch.stack([s.counts_E for s in slots])
        overflowed = False
        for rank in range(M):
            for salt in (0, 7):
                want_cells = plan_reference.plan_cells_reference(counts_ME, capacity, salt, rank)
                cells = ops.plan_cells(counts_ME.to(device), capacity, salt, rank, backend="triton")
                assert same(cells, want_cells), (M, E, rank, salt)
            overflowed |= bool((want_cells.stats_2ME[0] != want_cells.stats_2ME[1]).any())
            want_rows = plan_reference.plan_rows_reference(ids[rank], slots[rank], want_cells, M, capacity)
            on_device = plan_reference.SlotRanks(*(t.to(device) for t in slots[rank]))
            rows = ops.plan_rows(ids[rank].to(device), on_device, cells, M, capacity, backend="triton")
            assert same(rows, want_rows), (M, E, rank)
        asked_M = counts_ME.view(M, M, E // M).sum((0, 2))
        assert overflowed == bool((asked_M > capacity).any()), (M, E, "drops exactly when over capacity")
        cases_overflowing += overflowed
    assert cases_overflowing >= 2  # the cases exercise the fair drop
    # Ids outside [0, E) are dropped on the device, never addressed.
    bad = torch.tensor([0, 9, -1, 3], device=device)
    slots = ops.rank_slots(bad, 8, backend="triton")
    assert int(slots.counts_E.sum()) == 2
    cells = ops.plan_cells(slots.counts_E.view(1, 8), 8, 0, 0, backend="triton")
    assert ops.plan_rows(bad, slots, cells, 1, 8, backend="triton")[0].tolist() == [0, -1, -1, 0]


def peer_wait(me: int, number: int, parity: int, ranks: int = 3, device: str = "cpu"):
    """A barrier of rank ``me`` whose number is ``number`` with every other rank's flag here
    already at it (their signals came): ``(wait, epochs, flags)``."""
    from moe_ep_transport import ops

    flags = [torch.zeros(ranks, dtype=torch.int64, device=device) for _ in range(ranks)]
    for r in range(ranks):
        if r != me:
            flags[me][r] = number
    epochs = torch.zeros(2, dtype=torch.int64, device=device)
    epochs[parity] = number
    table = torch.tensor([f.data_ptr() for f in flags], device=device)
    return ops.PeerWait(epochs, table, me, parity), epochs, flags


def assert_passed(epochs, flags, me: int, number: int, parity: int, where: str) -> None:
    """The barrier was passed once: the next number left in the other counter, this rank's
    number announced to every rank."""
    assert int(epochs[1 - parity]) == number + 1 and int(epochs[parity]) == number, (where, epochs)
    assert [int(f[me]) for f in flags] == [number] * len(flags), (where, flags)


def check_plan_with_the_count_exchange(device: str) -> None:
    """The plan's first steps with the count exchange folded in, on ``device``, equal the
    PyTorch definitions bit for bit: the slot ranks, the counts put into every rank, and in
    the block scan's program that finishes last the exchange's barrier, the cells and the
    telemetry."""
    from moe_ep_transport import _plan_kernels as plan_kernels
    from moe_ep_transport import ops, plan_reference

    def same(got, want) -> bool:
        return all(torch.equal(a.cpu(), b) for a, b in zip(got, want, strict=True))

    gen = torch.Generator().manual_seed(4)
    # The counts put into row `me` of every rank's table, the exchange's barrier (the others
    # already announced it), the cells from the table in this rank's slab (the other ranks'
    # rows already there), and the telemetry sum; 6 experts, 6 programs take tickets. Twice
    # with one ticket counter, which each launch leaves at zero; the second launch's slots
    # span three blocks, so each column's total sums them all.
    M, me, E, capacity, salt = 3, 1, 6, 20, 3
    assert -(-700 // plan_reference.slot_block(E)) == 3
    tickets = torch.zeros(1, dtype=torch.int32, device=device)
    for launch, n in enumerate((41, 700)):
        expert_N = torch.randint(0, E, (n,), generator=gen)
        want_slots = ops.rank_slots_reference(expert_N, E)
        counts_ME = torch.randint(0, 9, (M, E), generator=gen, dtype=torch.int32)
        counts_ME[me] = want_slots.counts_E
        slabs = [torch.full((32 + M * E * 4,), 7, dtype=torch.uint8, device=device) for _ in range(M)]
        table_ME = slabs[me][32:].view(torch.int32).view(M, E)
        table_ME.copy_(counts_ME)
        table_ME[me] = -1  # the launch's put overwrites it
        stats_sum = torch.arange(2 * M * E, dtype=torch.int64).view(2, M, E)
        want_sum = stats_sum.clone()
        want_cells = ops.plan_cells_reference(counts_ME, capacity, salt, me, want_sum)
        stats_sum = stats_sum.to(device)
        wait, epochs, flags = peer_wait(me, 5 + launch, (5 + launch) % 2, M, device)
        peers = torch.tensor([s.data_ptr() for s in slabs], device=device)
        slots, cells = plan_kernels.rank_slots_and_cells(
            expert_N.to(device), E, tickets, plan_kernels.CountPublish(peers, 32, me),
            plan_kernels.CellRequest(table_ME, capacity, salt, stats_sum, wait))
        assert same(slots, want_slots), launch
        assert same(cells, want_cells), launch
        assert torch.equal(stats_sum.cpu(), want_sum), launch
        for r, slab in enumerate(slabs):
            assert torch.equal(slab[32:].view(torch.int32).view(M, E)[me].cpu(), want_slots.counts_E), (launch, r)
            assert (slab[:32] == 7).all(), (launch, r, "stored outside the table")
        assert_passed(epochs, flags, me, 5 + launch, (5 + launch) % 2, f"launch {launch}")
        assert int(tickets) == 0, launch


def check_partial_kernels(device: str, out_dtype: torch.dtype) -> None:
    """The destination-sum kernels (slot table from the receive kernel, partial sums put,
    partials' sum) equal the PyTorch references bit for bit. ``out_dtype`` of the final sum: BF16 on CUDA; FP32 under
    the interpreter (it rounds FP32 -> BF16 towards zero, the GPU to nearest even)."""
    from moe_ep_transport import _transport_kernels as kernels
    from moe_ep_transport import ops

    gen = torch.Generator().manual_seed(7)
    M, T_max, k, D, me, C = 3, 5, 4, 70, 1, 24
    row_src = torch.randint(-1, M, (C,), generator=gen)
    origin = torch.zeros(C, dtype=torch.int64)
    for s in range(M):  # distinct slot indices per source
        mine = (row_src == s).nonzero().view(-1)
        origin[mine] = torch.randperm(T_max * k, generator=gen)[: mine.numel()]
    origin[row_src < 0] = 10**6  # garbage behind padding rows is never read
    rows = (torch.randn(C, D, generator=gen) * 3).to(torch.bfloat16)
    w = torch.rand(C, generator=gen)
    rows[row_src < 0], w[row_src < 0] = float("nan"), float("nan")
    row_src, origin, rows, w = (t.to(device) for t in (row_src, origin, rows, w))

    clean = ops.slot_table(row_src, origin, M, T_max * k)
    # The receive kernel writes the table into whatever memory it gets; readers validate.
    stale = torch.randint(-5, 2 * C, (M * T_max * k,), generator=gen).to(device)
    out, inbox = (torch.zeros(C, 3, dtype=torch.int32, device=device) for _ in range(2))
    ops.finish_receive(out, inbox, row_src, me, origin, None, 1, 0, stale, T_max * k, backend="triton")
    slots = ops.SlotTable(stale, row_src, origin, T_max * k)
    assert torch.equal(ops.slot_rows_valid(slots, k)[1], ops.slot_rows_valid(clean, k)[1])
    assert torch.equal(ops.slot_rows_valid(clean, k)[1], clean.rows_S.view(-1, k) >= 0)
    present_Q = (clean.rows_S.view(-1, k) >= 0).any(1)
    for weights in (w, None):
        want = ops.partial_sums_reference(rows, weights, clean, k, torch.float32)
        assert torch.equal(ops.partial_sums_reference(rows, weights, slots, k, torch.float32), want)
        slabs = [torch.full((M * T_max, D), -7.0, device=device) for _ in range(M)]
        addresses = torch.tensor([s.data_ptr() for s in slabs], device=device)
        kernels.put_partial_sums(rows, weights, slots, addresses, top_k=k, max_tokens=T_max, byte_offset=0, me=me)
        for s in range(M):
            got = slabs[s][me * T_max : (me + 1) * T_max]
            sent = present_Q[s * T_max : (s + 1) * T_max]
            assert torch.equal(got[sent], want[s * T_max : (s + 1) * T_max][sent]), (s, weights is None)
            assert bool((got[~sent] == -7.0).all()), s  # nothing stored for tokens without a row here
            others = torch.cat([slabs[s][: me * T_max], slabs[s][(me + 1) * T_max :]])
            assert bool((others == -7.0).all()), s
        assert not want.isnan().any()

    T = 4
    partials = torch.randn(M * T_max, D, generator=gen).to(device)
    dst_rank = torch.randint(-1, M, (T * k,), generator=gen).to(device)
    dst_rank[:k] = -1  # a token with every slot dropped
    for r in range(M):  # rows of ranks a token did not reach hold garbage
        reached = (dst_rank.view(T, k) == r).any(1)
        partials[r * T_max : r * T_max + T][~reached] = float("nan")
    want = ops.sum_partials_reference(partials, dst_rank, M, T_max, k, out_dtype)
    got = ops.sum_partials(partials, dst_rank, M, T_max, k, out_dtype, backend="triton")
    assert torch.equal(got, want) and not got.isnan().any()
    assert bool((got[0] == 0).all())


def forward_backward(losses, interleave=None) -> list[torch.Tensor]:
    """The losses of ``losses`` (callables), each with its backward: one at a time, or with an
    ``interleave`` (``MicrobatchInterleave``) the forwards interleaved and one backward over
    all of them, as the trainer runs a pair."""
    if interleave is None:
        out = []
        for loss in losses:
            out.append(loss())
            out[-1].backward()
        return out
    out = interleave.run(list(losses))
    torch.autograd.backward(out)
    return out
