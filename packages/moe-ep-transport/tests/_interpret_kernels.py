"""Run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 and compare with PyTorch.

Executed in a subprocess by test_kernels_interpret.py (the variable must be set
before triton is imported, and must not leak into other tests).
"""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from moe_ep_transport import kernels, ops, plan_kernels, plan_reference  # noqa: E402


def check_put_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    offset = 64  # bytes of metadata (one int64 per row) before the rows
    for dtype, width in ((torch.int32, 24), (torch.bfloat16, 1030), (torch.uint8, 7)):
        src = torch.randint(0, 100, (6, width), generator=gen).to(dtype)
        src_index = torch.tensor([0, 5, 2, 2, 3, 1, 4])
        dst_rank = torch.tensor([2, 0, -1, 1, 2, 0, 1])
        dst_row = torch.tensor([4, 0, 3, 1, 0, 2, 3])
        meta = torch.arange(7) + 100
        row_bytes = width * src.element_size()
        for me, local, skip in ((1, False, False), (1, True, False), (2, False, True)):
            slabs = [torch.zeros(offset + 5 * row_bytes, dtype=torch.uint8) for _ in range(3)]
            local_dst = torch.zeros(5, width, dtype=dtype) if local else None
            table = torch.tensor([s.data_ptr() for s in slabs])
            kernels.put_rows(src, src_index, dst_rank, dst_row, table, byte_offset=offset, me=me,
                             local_dst=local_dst, skip_local=skip, meta_N=meta)
            want = [torch.zeros(offset + 5 * row_bytes, dtype=torch.uint8) for _ in range(3)]
            want_local = torch.zeros(5, width, dtype=dtype)
            for i in range(7):
                r = int(dst_rank[i])
                if r < 0 or (skip and r == me):
                    continue
                rows = want[r][offset:].view(dtype).view(5, width)
                (want_local if (local and r == me) else rows)[dst_row[i]] = src[src_index[i]]
                want[r][:offset].view(torch.int64)[dst_row[i]] = meta[i]
            for r in range(3):
                assert torch.equal(slabs[r], want[r]), (dtype, me, local, skip, r)
            if local:
                assert torch.equal(local_dst, want_local), (dtype, me)


def check_finish_receive() -> None:
    gen = torch.Generator().manual_seed(1)
    out = torch.randint(0, 9, (9, 33), generator=gen, dtype=torch.int32)
    inbox = torch.randint(10, 99, (9, 33), generator=gen, dtype=torch.int32)
    row_src = torch.tensor([0, 1, 1, 2, 0, 2, -1, -1, -1])
    origin_in = torch.randint(0, 1000, (9,), generator=gen)
    want, want_origin = out.clone(), torch.zeros(9, dtype=torch.int64)
    ops.finish_receive_reference(want, inbox, row_src, 1, want_origin, origin_in)
    origin = torch.zeros(9, dtype=torch.int64)
    kernels.finish_receive(out, inbox, row_src, 1, origin, origin_in)
    assert torch.equal(out, want) and torch.equal(origin, want_origin)
    kernels.finish_receive(out, inbox, row_src, 1)


def check_topk_gather_sum() -> None:
    gen = torch.Generator().manual_seed(2)
    T, k, D, me = 5, 3, 70, 1
    for dtype, wdtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                          (torch.float64, torch.float64)):
        inbox = (torch.randn(T * k, D, generator=gen) * 3).to(dtype)
        local = (torch.randn(6, D, generator=gen) * 3).to(dtype)
        rank = torch.randint(-1, 3, (T * k,), generator=gen)
        row = torch.randint(0, 6, (T * k,), generator=gen)
        rank[4] = -1
        inbox[4] = float("nan")  # garbage behind a dropped slot must not leak ...
        w = torch.rand(T * k, generator=gen).to(wdtype)
        w[4] = float("nan")  # ... nor its weight
        # The sum is compared in its accumulation dtype: the interpreter rounds FP32 -> BF16
        # towards zero where the GPU rounds to nearest even (the GPU test compares BF16 too).
        y_ref, rows_ref = ops.topk_gather_sum_reference(inbox, local, rank, row, me, w, k, wdtype, True)
        y, rows = kernels.topk_gather_sum(inbox, local, rank, row, me, w, k, wdtype, True)
        assert torch.equal(y, y_ref), dtype
        assert torch.equal(rows, rows_ref), dtype
        assert not y.isnan().any()
        y2, none = kernels.topk_gather_sum(inbox, local, rank, row, me, w, k, wdtype, False)
        assert none is None and torch.equal(y2, y_ref)


def _routings():
    """(M, E, k, tokens per rank, capacity, skew): dropless, overflowing, empty ranks, odd E."""
    yield 2, 8, 2, [7, 5], 28, 0.0
    yield 4, 12, 3, [9, 0, 13, 4], 14, 2.0
    yield 1, 6, 2, [40], 60, 1.0
    yield 2, 64, 8, [300, 260], 3000, 3.0  # several slot blocks, overflow at rank 0
    yield 4, 16, 4, [0, 0, 0, 0], 8, 0.0


def check_plan() -> None:
    gen = torch.Generator().manual_seed(3)
    for M, E, k, tokens, capacity, skew in _routings():
        ids = [torch.topk(torch.randn(T, E, generator=gen) + skew * torch.linspace(3, 0, E), k, dim=1)
               .indices.reshape(-1) for T in tokens]
        slots = []
        for expert_N in ids:
            for as_dtype in (torch.int64, torch.int32):
                got = plan_kernels.rank_slots(expert_N.to(as_dtype), E)
                want = plan_reference.rank_slots_reference(expert_N, E)
                assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (M, E, "rank_slots")
            slots.append(want)
        counts_ME = torch.stack([s.counts_E for s in slots])
        for rank in range(M):
            for salt in (0, 7):
                cells = plan_kernels.plan_cells(counts_ME, capacity, salt, rank)
                want_cells = plan_reference.plan_cells_reference(counts_ME, capacity, salt, rank)
                for name, a, b in zip(want_cells._fields, cells, want_cells, strict=True):
                    assert torch.equal(a, b), (M, E, rank, salt, name)
            rows = plan_kernels.plan_rows(ids[rank], slots[rank], cells, M, capacity)
            want_rows = plan_reference.plan_rows_reference(ids[rank], slots[rank], cells, M, capacity)
            for name, a, b in zip(("dst_rank", "dst_row", "row_src"), rows, want_rows, strict=True):
                assert torch.equal(a, b), (M, E, rank, name)
        if skew >= 2.0:
            assert bool((cells.stats_2ME[0] != cells.stats_2ME[1]).any()), "the case should overflow"
    # Ids outside [0, E) are dropped on the device, never addressed.
    bad = torch.tensor([0, 9, -1, 3])
    slots = plan_kernels.rank_slots(bad, 8)
    assert slots.counts_E.sum() == 2
    cells = plan_kernels.plan_cells(slots.counts_E.view(1, 8), 8, 0, 0)
    dst_rank, _, _ = plan_kernels.plan_rows(bad, slots, cells, 1, 8)
    assert dst_rank.tolist() == [0, -1, -1, 0]


if __name__ == "__main__":
    check_put_rows()
    check_finish_receive()
    check_topk_gather_sum()
    check_plan()
    print("kernels ok")
