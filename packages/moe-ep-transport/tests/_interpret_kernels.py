"""Run the Triton kernels on CPU tensors under TRITON_INTERPRET=1 and compare with PyTorch:
each op through ``ops.<op>(..., backend="triton")`` against ``ops.<op>_reference``.

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
from _oracle import (  # noqa: E402
    assert_passed,
    check_partial_kernels,
    check_plan_kernels,
    check_plan_with_the_count_exchange,
    peer_wait,
)
from moe_ep_transport import _transport_kernels as kernels  # noqa: E402
from moe_ep_transport import ops  # noqa: E402
from moe_ep_transport.peer_memory import inbox_targets  # noqa: E402


def check_put_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    offset, n, slab_rows = 128, 12, 12  # 16 int64 of metadata (one per receive row) before the rows
    dst_rank = torch.tensor([2, 0, 2, 1, 1, -1, 0, 2, 1, 2, 2, 2])
    dst_row = torch.randperm(n, generator=gen)
    meta = torch.arange(n) + 100
    for dtype, width in ((torch.int32, 24), (torch.bfloat16, 1030), (torch.uint8, 7)):
        row_bytes = width * torch.tensor([], dtype=dtype).element_size()
        for per_src, stride in ((1, 0), (3, 0), (3, 4)):
            src = torch.randint(0, 100, (n // per_src, width), generator=gen).to(dtype)
            for me, local, skip in ((1, False, False), (1, True, False), (2, False, True)):
                slabs = [torch.zeros(offset + slab_rows * row_bytes, dtype=torch.uint8) for _ in range(3)]
                local_dst = torch.zeros(slab_rows, width, dtype=dtype) if local else None
                table = torch.tensor([s.data_ptr() for s in slabs])
                kernels.put_rows(src, dst_rank, dst_row, table, per_src=per_src, byte_offset=offset, me=me,
                                 local_dst=local_dst, skip_local=skip, meta_N=meta, inbox_stride=stride)
                want = [torch.zeros(offset + slab_rows * row_bytes, dtype=torch.uint8) for _ in range(3)]
                want_local = torch.zeros(slab_rows, width, dtype=dtype)
                want_rank, want_at = dst_rank.clone(), dst_row.clone()
                for i in range(n):
                    r, t = int(dst_rank[i]), i // per_src
                    if r < 0 or (skip and r == me):
                        continue
                    rows = want[r][offset:].view(dtype).view(slab_rows, width)
                    if local and r == me:
                        want_local[dst_row[i]] = src[t]
                    elif stride and r != me:  # once per (token, rank), into the token inbox
                        want_at[i] = me * stride + t
                        if r in dst_rank[t * per_src : i].tolist():
                            want_rank[i] = -1
                        else:
                            rows[me * stride + t] = src[t]
                    else:
                        rows[dst_row[i]] = src[t]
                    want[r][:offset].view(torch.int64)[dst_row[i]] = meta[i]
                for r in range(3):
                    assert torch.equal(slabs[r], want[r]), (dtype, per_src, stride, me, local, skip, r)
                if local:
                    assert torch.equal(local_dst, want_local), (dtype, me)
                if stride:  # the emulated peer memory's addressing is the kernel's
                    rank_N, at_N = inbox_targets(dst_rank, dst_row, per_src, me, stride)
                    live = (dst_rank >= 0) & ~((dst_rank == me) & skip)
                    assert torch.equal(rank_N[live], want_rank[live]) and torch.equal(at_N[live], want_at[live])


def check_put_rows_clears() -> None:
    # clear_N zeroes this rank's own rows where it is negative, in the put's launch; a put
    # of no rows still clears.
    gen = torch.Generator().manual_seed(8)
    offset, W = 64, 5
    for n_put in (6, 0):
        slabs = [torch.full((offset + 10 * W * 4,), 7, dtype=torch.uint8) for _ in range(2)]
        table = torch.tensor([s.data_ptr() for s in slabs])
        src = torch.randint(0, 99, (n_put, W), generator=gen, dtype=torch.int32)
        dst_rank, dst_row = torch.tensor([0, 1, 1, 0, 1, 1])[:n_put], torch.tensor([9, 2, 3, 8, 0, 1])[:n_put]
        clear = torch.tensor([-1, 0, 1, -1, -1, 1, 1, 1, -1, 1])
        want = [s.clone() for s in slabs]
        for i in range(n_put):
            want[int(dst_rank[i])][offset:].view(torch.int32).view(10, W)[dst_row[i]] = src[i]
        want[1][offset:].view(torch.int32).view(10, W)[clear < 0] = 0
        kernels.put_rows(src, dst_rank, dst_row, table, byte_offset=offset, me=1, clear_N=clear)
        assert all(torch.equal(a, b) for a, b in zip(slabs, want, strict=True)), n_put


def check_receive_grads() -> None:
    # One pass = finish_receive, then combine_grads with one slot per row: the same bits as
    # combine_grads' kernel over the received rows (a -0.0 gradient included), the reference's
    # within rounding; padding rows unset.
    gen = torch.Generator().manual_seed(11)
    C, D, me, T = 9, 33, 1, 3
    row_src = torch.tensor([0, 1, 1, 2, 0, 2, -1, -1, 0])
    origin = torch.randint(0, 2 * T, (C,), generator=gen)
    for stride in (0, T):
        inbox = torch.randn(max(C, 3 * T), D, generator=gen)
        inbox[:, 0] = -0.0
        local = torch.randn(C, D, generator=gen)
        w = torch.rand(C, generator=gen)
        rows = torch.randn(C, D, generator=gen)
        g = local.clone()
        ops.finish_receive_reference(g, inbox, row_src, me, origin, None, 2, stride)
        want_scaled, want_w = kernels.combine_grads(g, w, rows, torch.float32, True)
        ref_scaled, ref_w = ops.combine_grads_reference(g, w, rows, torch.float32, True)
        scaled, grad_w = kernels.receive_grads(local, inbox, row_src, origin, me, w, rows, True, 2, stride)
        valid = row_src >= 0
        assert torch.equal(scaled[valid], want_scaled[valid]), stride
        assert torch.equal(scaled[valid].signbit(), ref_scaled[valid].signbit()), stride
        assert torch.equal(grad_w[valid], want_w[valid]), stride
        assert torch.allclose(grad_w[valid], ref_w[valid], rtol=1e-5, atol=1e-5), stride
        only_w = kernels.receive_grads(local, inbox, row_src, origin, me, w, rows, False, 2, stride)
        assert only_w[0] is None and torch.equal(only_w[1][valid], grad_w[valid])


def check_finish_receive() -> None:
    gen = torch.Generator().manual_seed(1)
    out = torch.randint(0, 9, (9, 33), generator=gen, dtype=torch.int32)
    inbox = torch.randint(10, 99, (9, 33), generator=gen, dtype=torch.int32)
    row_src = torch.tensor([0, 1, 1, 2, 0, 2, -1, -1, -1])
    origin_in = torch.randint(0, 1000, (9,), generator=gen)
    want, want_origin = out.clone(), torch.zeros(9, dtype=torch.int64)
    ops.finish_receive_reference(want, inbox, row_src, 1, origin_in, want_origin)
    origin = torch.zeros(9, dtype=torch.int64)
    ops.finish_receive(out, inbox, row_src, 1, origin_in, origin, backend="triton")
    assert torch.equal(out, want) and torch.equal(origin, want_origin)
    ops.finish_receive(out, inbox, row_src, 1, backend="triton")
    assert torch.equal(out, want)
    # A token inbox of 3 ranks x 3 tokens, slot origins of top-2: row = src * 3 + origin // 2.
    origin_in = torch.randint(0, 6, (9,), generator=gen)
    ops.finish_receive_reference(want, inbox, row_src, 1, origin_in, None, 2, 3)
    ops.finish_receive(out, inbox, row_src, 1, origin_in, None, 2, 3, backend="triton")
    assert torch.equal(out, want)
    remote = (row_src >= 0) & (row_src != 1)
    assert torch.equal(want[remote], inbox[row_src[remote] * 3 + origin_in[remote] // 2])


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
        y, rows = ops.topk_gather_sum(inbox, local, rank, row, me, w, k, wdtype, True, backend="triton")
        assert torch.equal(y, y_ref), dtype
        assert torch.equal(rows, rows_ref), dtype
        assert not y.isnan().any()
        y2, none = ops.topk_gather_sum(inbox, local, rank, row, me, w, k, wdtype, False, backend="triton")
        assert none is None and torch.equal(y2, y_ref)


def check_combine_grads() -> None:
    gen = torch.Generator().manual_seed(3)
    T, k, D = 5, 4, 70
    for rows_dtype, wdtype in ((torch.float32, torch.float32), (torch.float64, torch.float64),
                               (torch.bfloat16, torch.float32)):
        g = torch.randn(T, D, generator=gen).to(wdtype)
        w = torch.rand(T * k, generator=gen).to(wdtype)
        rows = torch.randn(T * k, D, generator=gen).to(rows_dtype)
        want_scaled, want_w = ops.combine_grads_reference(g, w, rows, rows_dtype, True)
        scaled, grad_w = ops.combine_grads(g, w, rows, rows_dtype, True, backend="triton")
        # The interpreter rounds FP32 -> BF16 towards zero (the GPU to nearest even): one BF16 step.
        step = 2.0**-7 if rows_dtype == torch.bfloat16 else 0.0
        assert torch.allclose(scaled.to(wdtype), want_scaled.to(wdtype), rtol=step, atol=0), rows_dtype
        tol = 1e-5 if wdtype == torch.float32 else 1e-12  # sums of D products in another order
        assert torch.allclose(grad_w, want_w, rtol=tol, atol=tol * D), (rows_dtype, (grad_w - want_w).abs().max())
        only_scaled, none = ops.combine_grads(g, w, None, rows_dtype, True, backend="triton")
        assert none is None and torch.equal(only_scaled, scaled)
        none, only_w = ops.combine_grads(g, w, rows, rows_dtype, False, backend="triton")
        assert none is None and torch.equal(only_w, grad_w)
    # A bound: tokens before it as without one (k = 1, as combine's backward at the
    # destination runs it over a receive buffer); tokens past it never touched: their
    # outputs keep a sentinel (the kernel launched on pre-filled outputs).
    g = torch.randn(6, D, generator=gen)
    w, rows = torch.rand(6, generator=gen), torch.randn(6, D, generator=gen)
    scaled, grad_w = torch.full((6, D), 7.0), torch.full((6,), 7.0)
    kernels._combine_grads_kernel[(6,)](
        g, w, rows, scaled, grad_w, D, torch.tensor([4], dtype=torch.int32), g, w, w, 0, 0, w, 0, w, 1,
        K=1, SCALED=True, GRAD_W=True, BLOCK_W=64, HAS_BOUND=True, RECEIVE=False, PER_SRC=1, DEDUP=False,
        WAIT=False, FLAGS_P=2, FENCE=False)
    want_scaled, want_w = ops.combine_grads_reference(g[:4], w[:4], rows[:4], torch.float32, True)
    assert torch.equal(scaled[:4], want_scaled) and torch.allclose(grad_w[:4], want_w, rtol=1e-5, atol=1e-4)
    assert (scaled[4:] == 7.0).all() and (grad_w[4:] == 7.0).all(), "a token past the bound was written"
    bounded, bounded_w = ops.combine_grads(g, w, rows, torch.float32, True, torch.tensor([4], dtype=torch.int32), backend="triton")
    assert torch.equal(bounded[:4], scaled[:4]) and torch.allclose(bounded_w[:4], grad_w[:4], rtol=1e-5, atol=1e-4)
    # The kernel takes a power-of-two top-k: "auto" takes the reference for another, "triton" says so.
    g3, w3, rows3 = torch.randn(4, D, generator=gen), torch.rand(12, generator=gen), torch.randn(12, D, generator=gen)
    try:
        ops.combine_grads(g3, w3, rows3, torch.float32, True, backend="triton")
    except ValueError as e:
        assert "power-of-two top-k, got 3" in str(e), e
    else:
        raise AssertionError("combine_grads(backend='triton') took top-k 3")
    # A rank without tokens: empty results, no launch.
    scaled, grad_w = ops.combine_grads(torch.zeros(0, D), torch.zeros(0), torch.zeros(0, D), torch.float32, True, backend="triton")
    assert scaled.shape == (0, D) and grad_w.shape == (0,)


def check_scan_blocks() -> None:
    # More blocks than one chunk: the carry between chunks (at 256 Ki slots there are 2048
    # blocks of 128, two chunks of 1024; the plan cases below stay within one chunk).
    from moe_ep_transport import _plan_kernels as plan_kernels

    hist = torch.randint(0, 9, (37, 5), generator=torch.Generator().manual_seed(4), dtype=torch.int32)
    for chunk in (8, 64):
        assert torch.equal(plan_kernels.scan_blocks(hist, chunk), hist.cumsum(0, dtype=torch.int32)), chunk
    # Publishing: the totals land in row `me` of an int32 [M, E] table at each rank's address.
    for M, me in ((3, 1), (1, 0)):
        slabs = [torch.full((32 + M * 5 * 4,), 7, dtype=torch.uint8) for _ in range(M)]
        want = [s.clone() for s in slabs]
        for w in want:
            w[32:].view(torch.int32).view(M, 5)[me] = hist.sum(0, dtype=torch.int32)
        table = torch.tensor([s.data_ptr() for s in slabs])
        cum = plan_kernels.scan_blocks(hist, 8, plan_kernels.CountPublish(table, 32, me))
        assert torch.equal(cum, hist.cumsum(0, dtype=torch.int32))
        assert all(torch.equal(a, b) for a, b in zip(slabs, want, strict=True)), (M, me)


def check_signal_barrier() -> None:
    # Rank 1 of 3, the other ranks already announced barrier 1 (and rank 2 barrier 2 too):
    # rank 1 takes number 1 (parity 0), leaves 2 for the next, announces 1 to everyone and
    # returns; then number 2 (parity 1), once rank 0 announced it.
    flags = [torch.zeros(3, dtype=torch.int64) for _ in range(3)]
    flags[1][0], flags[1][2] = 1, 2
    table = torch.tensor([f.data_ptr() for f in flags])
    epochs = torch.tensor([1, 0])
    kernels.signal_barrier(epochs, table, 1, 0)
    assert epochs.tolist() == [1, 2] and [int(f[1]) for f in flags] == [1, 1, 1]
    flags[1][0] = 2
    kernels.signal_barrier(epochs, table, 1, 1)
    assert epochs.tolist() == [3, 2] and [int(f[1]) for f in flags] == [2, 2, 2]


def check_plan_cells_passes_the_barrier() -> None:
    # The cell kernel with a wait: the flag barrier first (rank 1 of 3, the others already
    # announced it), the cells as without; the reference path launches the barrier alone.
    counts_ME = torch.randint(0, 9, (3, 6), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    want = ops.plan_cells_reference(counts_ME, 10, 3, 1)
    for backend in ("triton", "reference"):
        flags = [torch.zeros(3, dtype=torch.int64) for _ in range(3)]
        flags[1][0] = flags[1][2] = 5
        epochs = torch.tensor([4, 5])  # barrier 5 has parity 1
        wait = ops.PeerWait(epochs, torch.tensor([f.data_ptr() for f in flags]), 1, 1)
        cells = ops.plan_cells(counts_ME, 10, 3, 1, wait=wait, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(cells, want, strict=True)), backend
        assert epochs.tolist() == [6, 5] and [int(f[1]) for f in flags] == [5, 5, 5], backend


def check_receive_kernels_pass_the_put_barrier() -> None:
    # Each receive with a wait: the kernels (many programs) and the reference path give the
    # results they give without one and pass the barrier once (program 0 signals, every
    # program waits for the other ranks' flags); a rank without rows passes it alone.
    gen = torch.Generator().manual_seed(12)
    me, C, W, k, T = 1, 37, 20, 2, 11
    row_src = torch.randint(-1, 3, (C,), generator=gen)
    inbox = torch.randint(0, 1000, (C, W), generator=gen, dtype=torch.int32)
    for backend in ("triton", "reference"):
        for rows in (C, 0):
            want = torch.zeros(rows, W, dtype=torch.int32)
            ops.finish_receive(want, inbox[:rows], row_src[:rows], me, backend=backend)
            wait, epochs, flags = peer_wait(me, 7, 1)
            got = torch.zeros(rows, W, dtype=torch.int32)
            ops.finish_receive(got, inbox[:rows], row_src[:rows], me, backend=backend, wait=wait)
            assert torch.equal(got, want), (backend, rows)
            assert_passed(epochs, flags, me, 7, 1, f"finish_receive {backend} {rows}")

    dst_rank = torch.randint(-1, 3, (T * k,), generator=gen)
    dst_row = torch.randint(0, C, (T * k,), generator=gen)
    x = torch.randn(T * k, W, generator=gen)
    local = torch.randn(C, W, generator=gen)
    w = torch.rand(T * k, generator=gen)
    for backend in ("triton", "reference"):
        for tokens in (T, 0):
            n = tokens * k
            want = ops.topk_gather_sum(x[:n], local, dst_rank[:n], dst_row[:n], me, w[:n], k, torch.float32,
                                       True, backend=backend)
            wait, epochs, flags = peer_wait(me, 4, 0)
            got = ops.topk_gather_sum(x[:n], local, dst_rank[:n], dst_row[:n], me, w[:n], k, torch.float32,
                                      True, backend=backend, wait=wait)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (backend, tokens)
            assert_passed(epochs, flags, me, 4, 0, f"topk_gather_sum {backend} {tokens}")

    M, T_max = 3, 6
    partials = torch.randn(M * T_max, W, generator=gen)
    ranks = torch.randint(-1, M, (5 * k,), generator=gen)
    for backend in ("triton", "reference"):
        want = ops.sum_partials(partials, ranks, M, T_max, k, torch.float32, backend=backend)
        wait, epochs, flags = peer_wait(me, 9, 0)
        got = ops.sum_partials(partials, ranks, M, T_max, k, torch.float32, backend=backend, wait=wait)
        assert torch.equal(got, want), backend
        assert_passed(epochs, flags, me, 9, 0, f"sum_partials {backend}")

    for backend in ("triton", "reference"):
        for rows in (C, 0):
            wait, epochs, flags = peer_wait(me, 2, 0)
            copied = ops.copy_rows(inbox[:rows], wait, backend=backend)
            assert torch.equal(copied, inbox[:rows]) and copied.data_ptr() != inbox.data_ptr(), (backend, rows)
            assert_passed(epochs, flags, me, 2, 0, f"copy_rows {backend} {rows}")

    g_local = torch.randn(C, W, generator=gen)
    g_inbox = torch.randn(C, W, generator=gen)
    origin = torch.randint(0, 2 * C, (C,), generator=gen)
    w_C = torch.rand(C, generator=gen)
    rows_CD = torch.randn(C, W, generator=gen)
    want = kernels.receive_grads(g_local, g_inbox, row_src, origin, me, w_C, rows_CD, True)
    wait, epochs, flags = peer_wait(me, 3, 1)
    got = kernels.receive_grads(g_local, g_inbox, row_src, origin, me, w_C, rows_CD, True, wait=wait)
    valid = row_src >= 0  # padding rows' results are unset
    assert torch.equal(got[0][valid], want[0][valid]) and torch.equal(got[1][valid], want[1][valid])
    assert_passed(epochs, flags, me, 3, 1, "receive_grads")


def check_weights_in_metadata() -> None:
    # A slot's weight rides in the high half of its metadata; the receive kernel unpacks
    # the slot index and the weight (zero for padding rows).
    gen = torch.Generator().manual_seed(5)
    n, C = 10, 12
    dst_rank = torch.tensor([0, 1, 1, 0, -1, 1, 0, 1, 0, 1])
    dst_row = torch.randperm(C, generator=gen)[:n]
    w = torch.randn(n, generator=gen)  # negative weights too: the sign bit is the top bit
    slabs = [torch.zeros(C * 8 + 16 * C, dtype=torch.uint8) for _ in range(2)]
    table = torch.tensor([s.data_ptr() for s in slabs])
    src = torch.zeros(n, 4, dtype=torch.int32)
    kernels.put_rows(src, dst_rank, dst_row, table, byte_offset=C * 8, me=1, meta_N=torch.arange(n), meta_w_N=w)
    packed = ops.pack_meta(torch.arange(n), w)
    for r in range(2):
        meta = slabs[r][: C * 8].view(torch.int64)
        mine = dst_rank == r
        assert torch.equal(meta[dst_row[mine]], packed[mine]), r
    index, weight = ops.unpack_meta(packed)
    assert torch.equal(index, torch.arange(n)) and torch.equal(weight, w)
    meta1 = slabs[1][: C * 8].view(torch.int64).clone()
    row_src = torch.full((C,), -1)
    row_src[dst_row[dst_rank == 1]] = 0
    out, inbox = torch.zeros(C, 4, dtype=torch.int32), torch.zeros(C, 4, dtype=torch.int32)
    got_w, got_origin = torch.full((C,), 9.0), torch.zeros(C, dtype=torch.int64)
    ops.finish_receive(out, inbox, row_src, 1, meta1, got_origin, w_out_C=got_w, backend="triton")
    want_w, want_origin = torch.full((C,), 9.0), torch.zeros(C, dtype=torch.int64)
    ops.finish_receive_reference(out.clone(), inbox, row_src, 1, meta1, want_origin, w_out_C=want_w)
    assert torch.equal(got_w, want_w) and torch.equal(got_origin[row_src >= 0], want_origin[row_src >= 0])
    assert torch.equal(got_w[dst_row[dst_rank == 1]], w[dst_rank == 1]) and bool((got_w[row_src < 0] == 0).all())


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous view (each stored twice, the view takes every other).
    Read as if contiguous it gives values of ``t`` in the wrong places: wrong results, never
    wild indices or addresses."""
    return torch.stack([t, t], -1)[..., 0]


def _raises_naming(what: str, call) -> None:
    try:
        call()
    except ValueError as e:
        assert what in str(e), e
    else:
        raise AssertionError(f"a non-contiguous {what} was accepted")


def check_any_strides() -> None:
    # The kernels address rows as ptr + i * width: the wrappers make what they read contiguous
    # (a column slice of a wider expert output, weights w[:, ::2]) and refuse a non-contiguous
    # tensor written in place. Each wrapper: the strided inputs give what the contiguous ones give.
    gen = torch.Generator().manual_seed(6)
    same = (lambda t: t, _strided)
    n, C, W = 10, 12, 4
    dst_rank = torch.tensor([0, 1, 1, 0, -1, 1, 0, 1, 0, 1])
    dst_row = torch.randperm(C, generator=gen)[:n]
    src = torch.randint(0, 99, (n, W), generator=gen, dtype=torch.int32)
    w = torch.randn(n, generator=gen)
    slabs = {}
    for f in same:
        slabs[f] = [torch.zeros(C * 8 + C * W * 4, dtype=torch.uint8) for _ in range(2)]
        table = torch.tensor([s.data_ptr() for s in slabs[f]])
        kernels.put_rows(f(src), f(dst_rank), f(dst_row), f(table), byte_offset=C * 8, me=1,
                         meta_N=f(torch.arange(n)), meta_w_N=f(w))
    assert all(torch.equal(a, b) for a, b in zip(*slabs.values(), strict=True)), "put_rows"
    local = _strided(torch.zeros(C, W, dtype=torch.int32))
    _raises_naming("local_dst", lambda: kernels.put_rows(src, dst_rank, dst_row, table, local_dst=local))

    row_src = torch.tensor([0, 1, 1, 2, 0, 2, -1, -1, -1])
    inbox = torch.randint(10, 99, (9, 33), generator=gen, dtype=torch.int32)
    origin_in = torch.randint(0, 1000, (9,), generator=gen)
    got = {}
    for f in same:
        out, origin = torch.zeros(9, 33, dtype=torch.int32), torch.zeros(9, dtype=torch.int64)
        kernels.finish_receive(out, f(inbox), f(row_src), 1, f(origin_in), origin)
        got[f] = (out, origin)
    assert all(torch.equal(a, b) for a, b in zip(*got.values(), strict=True)), "finish_receive"
    _raises_naming("out_CW", lambda: kernels.finish_receive(_strided(out), inbox, row_src, 1))
    _raises_naming("origin_out_C",
                   lambda: kernels.finish_receive(out, inbox, row_src, 1, origin_in, _strided(origin)))

    T, k, D = 5, 2, 70
    g = torch.randn(T, D, generator=gen)
    w_N = torch.rand(T * k, generator=gen)
    rows = torch.randn(T * k, D, generator=gen)
    local = torch.randn(6, D, generator=gen)
    rank = torch.randint(-1, 3, (T * k,), generator=gen)
    row = torch.randint(0, 6, (T * k,), generator=gen)
    sums = {f: kernels.topk_gather_sum(f(rows), f(local), f(rank), f(row), 1, f(w_N), k, torch.float32,
                                       True) for f in same}
    grads = {f: kernels.combine_grads(f(g), f(w_N), f(rows), torch.float32, True) for f in same}
    for name, results in (("topk_gather_sum", sums), ("combine_grads", grads)):
        assert all(torch.equal(a, b) for a, b in zip(*results.values(), strict=True)), name

    M, T_max, C = 2, 3, 6
    row_src = torch.tensor([0, 1, 1, 0, -1, 0])
    origin = torch.tensor([0, 3, 1, 5, 0, 2])
    rows, w_C = torch.randn(C, D, generator=gen), torch.rand(C, generator=gen)
    table_S = ops.slot_table(row_src, origin, M, T_max * k).rows_S
    partials = {}
    for f in same:
        partials[f] = [torch.zeros(M * T_max, D) for _ in range(M)]
        addresses = torch.tensor([s.data_ptr() for s in partials[f]])
        slots = ops.SlotTable(f(table_S), f(row_src), f(origin), T_max * k)
        kernels.put_partial_sums(f(rows), f(w_C), slots, f(addresses), top_k=k, max_tokens=T_max,
                                 byte_offset=0, me=1)
    assert all(torch.equal(a, b) for a, b in zip(*partials.values(), strict=True)), "put_partial_sums"
    partials_QD = torch.randn(M * T_max, D, generator=gen)
    dst = torch.tensor([0, 1, -1, 1, 0, 0])
    y = {f: kernels.sum_partials(f(partials_QD), f(dst), M, T_max, k, torch.float32) for f in same}
    assert torch.equal(*y.values()), "sum_partials"


if __name__ == "__main__":
    check_put_rows()
    check_put_rows_clears()
    check_receive_grads()
    check_weights_in_metadata()
    check_finish_receive()
    check_topk_gather_sum()
    check_combine_grads()
    check_any_strides()
    check_scan_blocks()
    check_plan_with_the_count_exchange("cpu")
    check_signal_barrier()
    check_plan_cells_passes_the_barrier()
    check_receive_kernels_pass_the_put_barrier()
    check_plan_kernels("cpu")
    check_partial_kernels("cpu", torch.float32)
    print("kernels ok")
