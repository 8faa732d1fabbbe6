"""Run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 and compare with PyTorch.

Executed in a subprocess by test_kernels_interpret.py (the variable must be set
before triton is imported, and must not leak into other tests).
"""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _oracle import check_plan_kernels  # noqa: E402
from moe_ep_transport import kernels, ops  # noqa: E402


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


if __name__ == "__main__":
    check_put_rows()
    check_finish_receive()
    check_topk_gather_sum()
    check_plan_kernels("cpu")
    print("kernels ok")
