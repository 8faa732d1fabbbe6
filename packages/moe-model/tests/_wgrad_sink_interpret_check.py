"""Run by test_grouped_mm.py with TRITON_INTERPRET=1: the weight-gradient kernel's
accumulating epilogue (one batch of rows, and up to four in one launch; operands that are
column slices of wider rows, read in place), and expert weight gradients
delivered into a gradient sink (full backward, a split input/weight backward, the
GroupedExperts module, two microbatches merged into one launch), on CPU."""

import torch
from moe_model import experts
from moe_model._grouped_mm_launch import TileConfig, wgrad_accumulate_
from moe_model.experts import (
    ExpertWeightGradient,
    GroupedExperts,
    grouped_mm_into_sink,
    grouped_mm_reference,
)


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


class DictSink:
    """A sink over FP32 targets keyed by parameter; counts the deliveries."""

    def __init__(self, targets):
        self.targets, self.added = targets, {}

    def accepts(self, param):
        return any(param is p for p in self.targets)

    def add_gradient(self, param, add):
        add(self.targets[param])
        self.added[param] = self.added.get(param, 0) + 1


def reference(x, store, offsets, valid, dy, k_contiguous):
    w = store.transpose(1, 2) if k_contiguous else store
    out = grouped_mm_reference(x, w, offsets)
    return torch.autograd.grad(out[:valid], (x, store), dy[:valid])


def check_kernel(g):
    E, N = 5, 40
    offsets = torch.tensor([7, 7, 20, 41, 41], dtype=torch.int32)  # experts 1 and 4 empty
    valid, R = 41, 45  # rows 41..44 are padding: never part of a gradient
    for K, k_contiguous in ((32, True), (24, False)):
        x = torch.randn(R, K, generator=g, requires_grad=True)
        store = torch.randn(*((E, N, K) if k_contiguous else (E, K, N)), generator=g, requires_grad=True)
        dy = torch.randn(R, N, generator=g)
        _, ref_dw = reference(x, store, offsets, valid, dy, k_contiguous)
        like = store.transpose(1, 2) if k_contiguous else store
        with torch.no_grad():
            flat = torch.randn(store.numel(), generator=g)
            expect = flat + ref_dw.reshape(-1)
            for cfg in (None, TileConfig(32, 16, 16, 1, 1, 1, False, False)):
                got = flat.clone()
                wgrad_accumulate_(got, x, dy, offsets, like, cfg)
                close(got, expect, f"flat K={K} k_contiguous={k_contiguous} {cfg}")
            # an owner-major bucket: [4 owners, piece] rows inside a wider buffer
            piece = store.numel() // 4
            bucket = torch.randn(4, piece + 7, generator=g)
            before = bucket.clone()
            rows = bucket[:, :piece]
            expect_rows = rows.reshape(-1) + ref_dw.reshape(-1)
            wgrad_accumulate_(rows, x, dy, offsets, like)
            close(rows.reshape(-1), expect_rows, f"bucket rows K={K}")
            assert torch.equal(bucket[:, piece:], before[:, piece:]), "wrote outside the rows"
            # owner rows that split the weight's rows (400 elements for rows of 32, 150 for 40)
            owners = 16 if k_contiguous else 32
            odd = torch.randn(owners, store.numel() // owners, generator=g)
            assert odd.shape[1] % (K if k_contiguous else N)
            expect_odd = odd.reshape(-1) + ref_dw.reshape(-1)
            wgrad_accumulate_(odd, x, dy, offsets, like)
            close(odd.reshape(-1), expect_odd, f"rows splitting weight rows K={K}")
            # owner rows of two output rows each: pieces shorter than a tile, so a tile
            # crosses several piece boundaries (the per-row mapping, not the one-cut one)
            row_len = K if k_contiguous else N  # the kernel's output row: the weight's contiguous dim
            short = torch.randn(store.numel() // (2 * row_len), 2 * row_len + 4, generator=g)
            short_rows = short[:, : 2 * row_len]
            expect_short = short_rows.reshape(-1) + ref_dw.reshape(-1)
            wgrad_accumulate_(short_rows, x, dy, offsets, like, TileConfig(32, 16, 16, 1, 1, 1, False, False))
            close(short_rows.reshape(-1), expect_short, f"pieces shorter than a tile K={K}")
    try:
        wgrad_accumulate_(torch.zeros(3), x, dy, offsets, like)
    except ValueError as e:
        assert "elements" in str(e)
    else:
        raise AssertionError("a target of the wrong size must be refused")


def check_merged_sources(g):
    """Up to four batches of rows (microbatches) reduced in one launch: the sum of their
    gradients, whatever groups are empty where (in the first batches: the kernel starts on
    a later one; in the middle: two jumps at once; in the last; in all), with padding rows
    past each batch's end."""
    E, N = 5, 40
    batches = [(torch.tensor(o, dtype=torch.int32), valid, rows) for o, valid, rows in (
        ([7, 7, 20, 41, 41], 41, 45), ([0, 9, 9, 30, 30], 30, 33), ([0, 0, 5, 5, 12], 12, 16),
        ([3, 3, 3, 3, 20], 20, 20), ([0, 0, 0, 0, 0], 0, 4))]
    orders = ((0, 1), (1, 2), (2, 0), (2, 1, 0), (4, 2, 3), (1, 4, 4, 0), (2, 4, 0, 3), (4, 4, 4, 4), (3, 1, 0, 2))
    for K, k_contiguous in ((32, True), (24, False)):
        data = [(torch.randn(rows, K, generator=g), torch.randn(rows, N, generator=g), o, valid)
                for o, valid, rows in batches]
        shape = (E, N, K) if k_contiguous else (E, K, N)
        store = torch.zeros(shape)
        like = store.transpose(1, 2) if k_contiguous else store
        grads = [reference(x.clone().requires_grad_(), store.clone().requires_grad_(), o, valid, dy,
                           k_contiguous)[1] for x, dy, o, valid in data]
        for order in orders:
            (x1, dy1, o1, _), *rest = (data[i] for i in order)
            more = [(x, dy, o) for x, dy, o, _ in rest]
            want = sum(grads[i] for i in order).reshape(-1)
            for cfg in (None, TileConfig(32, 16, 16, 1, 1, 1, False, False)):
                flat = torch.randn(store.numel(), generator=g)
                expect = flat + want
                wgrad_accumulate_(flat, x1, dy1, o1, like, cfg, more=more)
                close(flat, expect, f"sources {order} K={K} k_contiguous={k_contiguous} {cfg}")
            rows = torch.randn(4, store.numel() // 4, generator=g)  # owner-major bucket rows
            expect_rows = rows.reshape(-1) + want
            wgrad_accumulate_(rows, x1, dy1, o1, like, more=more)
            close(rows.reshape(-1), expect_rows, f"sources {order} into bucket rows K={K}")
    x, dy, o, _ = data[0]
    for bad, what in (([(x[:, :-1], dy, o)], "match"), ([(x, dy, o)] * 4, "one launch")):
        try:
            wgrad_accumulate_(flat, x1, dy1, o1, like, more=bad)
        except ValueError as e:
            assert what in str(e), e
        else:
            raise AssertionError(f"refusal expected: {what}")


def check_row_strided_operands(g):
    """Operands that are column slices of wider rows (the gate and up halves of an FP8
    layer's ``[R, 2F]`` dh13; x a slice too) are read in place, not copied, alone and merged
    with sources of other row strides (then every source is made contiguous first)."""
    from moe_model._grouped_mm_launch import _same_row_strides, _wgrad_operands

    E, N, K = 5, 40, 32
    offsets = torch.tensor([7, 7, 20, 41, 41], dtype=torch.int32)
    valid, R = 41, 45
    store = torch.zeros(E, N, K)
    like = store.transpose(1, 2)
    wide_x, wide_dy = torch.randn(R, K + 8, generator=g), torch.randn(R, 2 * N, generator=g)
    x, dy = wide_x[:, 8:], wide_dy[:, N:]  # row strides K + 8 and 2N
    a, b, _ = _wgrad_operands(x, dy, like)
    assert (a.data_ptr(), b.data_ptr()) == (dy.data_ptr(), x.data_ptr()), "a column slice was copied"
    assert _wgrad_operands(x.t().contiguous().t(), dy, like)[1].is_contiguous()  # column-major: copied
    want = reference(x.clone().requires_grad_(), store.clone().requires_grad_(), offsets, valid, dy,
                     True)[1].reshape(-1)
    for cfg in (None, TileConfig(32, 16, 16, 1, 1, 1, False, False)):
        flat = torch.randn(store.numel(), generator=g)
        expect = flat + want
        wgrad_accumulate_(flat, x, dy, offsets, like, cfg)
        close(flat, expect, f"column slices {cfg}")
    # merged: the same slices twice (one row stride), then with a contiguous pair
    x2, dy2 = x.contiguous(), dy.contiguous()
    same = [_wgrad_operands(x, dy, like) for _ in range(2)]
    assert _same_row_strides([(a, b, offsets) for a, b, _ in same])[1][0].data_ptr() == dy.data_ptr()
    mixed = _same_row_strides([(*_wgrad_operands(x, dy, like)[:2], offsets),
                               (*_wgrad_operands(x2, dy2, like)[:2], offsets)])
    assert len({(a.stride(0), b.stride(0)) for a, b, _ in mixed}) == 1
    for more in ([(x, dy, offsets)], [(x2, dy2, offsets)], [(x2, dy2, offsets), (x, dy, offsets)]):
        flat = torch.randn(store.numel(), generator=g)
        expect = flat + want * (1 + len(more))
        wgrad_accumulate_(flat, x, dy, offsets, like, more=more)
        close(flat, expect, f"column slices merged with {len(more)} more")


class MergingSink(DictSink):
    """Holds each parameter's first gradient and adds it merged with the next (as moe_ddp
    does under no_sync with merge_microbatch_gradients)."""

    def __init__(self, targets):
        super().__init__(targets)
        self.held, self.sources = {}, []

    def add_gradient(self, param, add):
        held = self.held.pop(param, None)
        if held is None:
            self.held[param] = add
            return
        merged = held.merged(add)
        self.sources.append(len(merged.sources))
        super().add_gradient(param, merged)


def check_merged_microbatches(g):
    """The GroupedExperts module over two microbatches with their weight gradients merged:
    each weight gets one launch with both sources and the sum of plain autograd's."""
    E, D, F = 4, 16, 24
    experts.sink_adds_in_kernel = lambda rows: True
    mod = GroupedExperts(E, D, F, backend="loop")
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=g)
    batches = [(torch.randn(20, D, generator=g), torch.tensor(o, dtype=torch.int32), torch.randn(20, D, generator=g))
               for o in ([5, 5, 12, 17], [0, 8, 8, 20])]
    for rows, offsets, dout in batches:
        dout[int(offsets[-1]):] = 0
        mod(rows, offsets).backward(dout)
    plain = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    mod.grad_sink = sink = MergingSink({p: torch.zeros(p.numel()) for p in mod.parameters()})
    for rows, offsets, dout in batches:
        mod(rows, offsets).backward(dout)
    assert sink.held == {} and sink.sources == [2, 2, 2], sink.sources
    for name, p in mod.named_parameters():
        assert p.grad is None and sink.added[p] == 1, name
        close(sink.targets[p].view(p.shape), plain[name], f"merged experts {name}")

    # operands changed in place while held: refused, not silently wrong
    x, offsets, _ = batches[0]
    rows = x.clone().requires_grad_()
    w = mod.w1  # [E, F, D]: rows of width D in, F out
    dout = torch.randn(rows.shape[0], F, generator=g)
    held = {}
    grouped_mm_into_sink(rows, w, offsets, "loop", type("S", (), {
        "accepts": lambda self, p: True, "add_gradient": lambda self, p, add: held.setdefault("add", add)})()
    ).backward(dout)
    add = held["add"]
    assert isinstance(add, ExpertWeightGradient)
    with torch.no_grad():
        rows.mul_(2)
    try:
        add(torch.zeros(w.numel()))
    except RuntimeError as e:
        assert "modified in place" in str(e), e
    else:
        raise AssertionError("a held gradient whose operands changed must not be added")


def check_sink(g):
    E, N, K = 4, 24, 16
    offsets = torch.tensor([5, 5, 12, 17], dtype=torch.int32)
    valid, R = 17, 20
    x = torch.randn(R, K, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(E, N, K, generator=g))
    dy = torch.randn(R, N, generator=g)
    dy[valid:] = 0  # padding rows carry no gradient
    ref_dx, ref_dw = reference(x, w, offsets, valid, dy, True)

    # a full backward: the gradient lands in the target once, param.grad stays None
    sink = DictSink({w: torch.zeros(w.numel())})
    y = grouped_mm_into_sink(x, w, offsets, "loop", sink)
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)  # input pass: no weight gradient
    assert sink.added == {}, "an input-gradient pass must not deliver the weight gradient"
    close(dx[:valid], ref_dx[:valid], "dx")
    torch.autograd.backward(y, dy, inputs=[w])  # the weight pass
    assert sink.added[w] == 1 and w.grad is None
    close(sink.targets[w], ref_dw.reshape(-1), "dw into the sink")
    y = grouped_mm_into_sink(x, w, offsets, "loop", sink)
    y.backward(dy)  # an ordinary backward accumulates on top
    assert sink.added[w] == 2
    close(sink.targets[w], 2 * ref_dw.reshape(-1), "dw accumulated twice")

    # a sink that does not take the parameter: autograd delivers it
    other = DictSink({})
    x.grad = None
    grouped_mm_into_sink(x, w, offsets, "loop", other).backward(dy)
    close(w.grad, ref_dw, "dw through autograd")
    w.grad = None

    # the experts module, sink on (as on CUDA) vs off
    experts.sink_adds_in_kernel = lambda rows: True
    D, F = 16, 24
    mod = GroupedExperts(E, D, F, backend="loop")
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=g)
    rows = torch.randn(R, D, generator=g)
    dout = torch.randn(R, D, generator=g)
    dout[valid:] = 0
    mod(rows, offsets).backward(dout)
    plain = {n: p.grad.clone() for n, p in mod.named_parameters()}
    mod.zero_grad(set_to_none=True)
    mod.grad_sink = DictSink({p: torch.zeros(p.numel()) for p in mod.parameters()})
    mod(rows, offsets).backward(dout)
    for name, p in mod.named_parameters():
        assert p.grad is None and mod.grad_sink.added[p] == 1, name
        close(mod.grad_sink.targets[p].view(p.shape), plain[name], f"experts {name}")


def main():
    g = torch.Generator().manual_seed(0)
    check_kernel(g)
    check_merged_sources(g)
    check_row_strided_operands(g)
    check_sink(g)
    check_merged_microbatches(g)
    print("ok")


if __name__ == "__main__":
    main()
