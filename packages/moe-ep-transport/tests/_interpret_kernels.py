"""Run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 and compare with PyTorch.

Executed in a subprocess by test_kernels_interpret.py (the variable must be set
before triton is imported, and must not leak into other tests).
"""

from __future__ import annotations

import os

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"

from moe_ep_transport import kernels, ops  # noqa: E402


def check_put_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype, width in ((torch.int32, 24), (torch.bfloat16, 1030), (torch.uint8, 7)):
        src = torch.randint(0, 100, (6, width), generator=gen).to(dtype)
        dsts = [torch.zeros(5, width, dtype=dtype) for _ in range(3)]
        metas = [torch.full((5,), -7, dtype=torch.int64) for _ in range(3)]
        src_index = torch.tensor([0, 5, 2, 2, 3, 1, 4])
        dst_rank = torch.tensor([2, 0, -1, 1, 2, 0, 1])
        dst_row = torch.tensor([4, 0, 3, 1, 0, 2, 3])
        meta = torch.arange(7) + 100
        table = torch.tensor([d.data_ptr() for d in dsts])
        meta_table = torch.tensor([m.data_ptr() for m in metas])
        kernels.put_rows(src, src_index, dst_rank, dst_row, table, meta, meta_table)
        want = [torch.zeros(5, width, dtype=dtype) for _ in range(3)]
        want_meta = [torch.full((5,), -7, dtype=torch.int64) for _ in range(3)]
        for i in range(7):
            r = int(dst_rank[i])
            if r >= 0:
                want[r][dst_row[i]] = src[src_index[i]]
                want_meta[r][dst_row[i]] = meta[i]
        for r in range(3):
            assert torch.equal(dsts[r], want[r]), (dtype, r)
            assert torch.equal(metas[r], want_meta[r]), (dtype, r)


def check_finish_receive() -> None:
    gen = torch.Generator().manual_seed(1)
    out = torch.randint(0, 9, (9, 33), generator=gen, dtype=torch.int32)
    inbox = torch.randint(10, 99, (9, 33), generator=gen, dtype=torch.int32)
    row_src = torch.tensor([0, 1, 1, 2, 0, 2, -1, -1, -1])
    want = out.clone()
    ops.finish_receive(want, inbox, row_src, 1)
    kernels.finish_receive(out, inbox, row_src, 1)
    assert torch.equal(out, want)


def check_topk_gather_sum() -> None:
    gen = torch.Generator().manual_seed(2)
    T, k, D = 5, 3, 70
    for dtype, wdtype in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                          (torch.float64, torch.float64)):
        primary = (torch.randn(8, D, generator=gen) * 3).to(dtype)
        secondary = (torch.randn(6, D, generator=gen) * 3).to(dtype)
        primary[7] = float("nan")  # garbage behind a dropped slot must not leak
        sel = torch.randint(-1, 2, (T * k,), generator=gen)
        row = torch.where(sel == 1, torch.randint(0, 6, (T * k,), generator=gen),
                          torch.randint(0, 7, (T * k,), generator=gen))
        sel[4], row[4] = -1, 7
        w = torch.where(sel >= 0, torch.rand(T * k, generator=gen), 0).to(wdtype)
        # The sum is compared in its accumulation dtype: the interpreter rounds FP32 -> BF16
        # towards zero where the GPU rounds to nearest even (the GPU test compares BF16 too).
        y_ref, rows_ref = ops.topk_gather_sum(primary, secondary, sel, row, w, k, wdtype, True)
        y, rows = kernels.topk_gather_sum(primary, secondary, sel, row, w, k, wdtype, True)
        assert torch.equal(y, y_ref), dtype
        assert torch.equal(rows, rows_ref), dtype
        y2, none = kernels.topk_gather_sum(primary, secondary, sel, row, w, k, wdtype, False)
        assert none is None and torch.equal(y2, y_ref)


if __name__ == "__main__":
    check_put_rows()
    check_finish_receive()
    check_topk_gather_sum()
    print("kernels ok")
