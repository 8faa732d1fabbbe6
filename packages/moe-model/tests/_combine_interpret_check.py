"""Run by test_fused_combine.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported, and never in the test process itself): the fused combine kernels on CPU
against the torch reference path of the local dispatcher, forward and all gradients: the
dispatcher's combine and gather run the public ``weighted_gather_sum`` and
``combine_backward`` with ``backend="triton"``, against their ``"auto"`` (on CPU, the
reference) selves."""

import functools

import torch
from moe_model import LocalDispatcher, _combine_kernels, _gather_kernels, dispatch
from moe_model.row_encoding import GRADIENT_ROW_ENCODER, INPUT_ROW_ENCODER
from sign_peak_encoder import SignPeakEncoder, expected_codes

_PUBLIC_OPS = ("weighted_gather_sum", "combine_backward", "gather_rows")
_AUTO = {name: getattr(dispatch, name) for name in _PUBLIC_OPS}


def _ids(T, E, k, g, skew):
    """Distinct experts per token; expert E-1 never chosen (an expert with zero tokens);
    with ``skew`` low expert ids are strongly preferred (capacity drops, and padding rows
    from the underfilled experts)."""
    p = torch.ones(E - 1) if not skew else torch.linspace(4.0, 0.2, E - 1)
    return torch.stack([torch.multinomial(p, k, replacement=False, generator=g) for _ in range(T)])


def _run(disp, x, ids, w, dy, fused):
    for name, op in _AUTO.items():
        setattr(dispatch, name, functools.partial(op, backend="triton") if fused else op)
    try:
        rows, offsets, h = disp.dispatch(x, ids)
        R, D = rows.shape
        g = torch.Generator().manual_seed(1)
        scale = torch.rand(R, 1, generator=g, dtype=x.dtype) + 0.5
        bias = torch.randn(R, D, generator=g, dtype=x.dtype).requires_grad_()
        y = disp.combine(rows * scale + bias, w, h)
        dx, dw, d_rows = torch.autograd.grad(y, (x, w, bias), dy)
    finally:
        for name, op in _AUTO.items():
            setattr(dispatch, name, op)
    return (y, dx, dw, d_rows), h


def check(T, D, E, k, capacity_factor, dtype, seed=0, expanded_dy=False):
    tag = f"T={T} D={D} E={E} k={k} cf={capacity_factor} {dtype} expanded_dy={expanded_dy}"
    g = torch.Generator().manual_seed(seed)
    ids = _ids(T, E, k, g, skew=capacity_factor is not None)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    w = torch.rand(T, k, generator=g).requires_grad_()  # routing weights stay FP32
    dy = torch.randn(T, D, generator=g).to(dtype)
    if expanded_dy:  # row stride 0, as from y.sum(0) in the loss
        dy = dy[0].expand(T, D)
    disp = LocalDispatcher(E, capacity_factor)
    got, h = _run(disp, x, ids, w, dy, fused=True)
    want, _ = _run(disp, x, ids, w, dy, fused=False)
    if capacity_factor is not None:
        assert (h.kept_of_slot == 0).any(), f"{tag}: no dropped slot"
        assert not h.valid_rows.all(), f"{tag}: no padding row"
        assert (got[3][~h.valid_rows] == 0).all(), f"{tag}: padding rows got a gradient"
    if dtype == torch.float32:
        tols = [(1e-6, 1e-6), (1e-6, 1e-6), (1e-6, 1e-5), (0, 0)]
    else:  # the interpreter rounds FP32 -> BF16 toward zero (a GPU rounds to nearest): 1 ulp
        tols = [(3e-2, 3e-2), (3e-2, 3e-2), (1e-5, 1e-4), (1e-2, 1e-6)]
    for name, a, b, (rtol, atol) in zip(("y", "dx", "dw", "d_rows"), got, want, tols, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{tag} {name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{tag} {n}: {m}")


def check_direct():
    """The kernel entry points on their own: default weights / kept, zero-filled rows."""
    g = torch.Generator().manual_seed(2)
    T, k, R, D = 5, 3, 17, 21
    rows = torch.randn(R, D, generator=g)
    row_of_slot = torch.randperm(R, generator=g)[: T * k]
    kept = (torch.rand(T * k, generator=g) > 0.3).float()
    ref = rows.index_select(0, row_of_slot).view(T, k, D)
    torch.testing.assert_close(_combine_kernels.weighted_gather_sum(rows, row_of_slot, T), ref.sum(1))
    y = _combine_kernels.weighted_gather_sum(rows, row_of_slot, T, kept_S=kept, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, (ref * kept.view(T, k, 1)).sum(1).bfloat16())
    w = torch.rand(T * k, generator=g) * kept
    dy = torch.randn(T, D, generator=g)
    d_rows, d_w, codes, scales = _combine_kernels.combine_backward(dy, rows, row_of_slot, w, kept, R)
    assert codes is None and scales is None
    want = torch.zeros(R, D)
    want[row_of_slot] = torch.where(kept[:, None] > 0, w[:, None] * dy.repeat_interleave(k, 0), 0.0)
    torch.testing.assert_close(d_rows, want, rtol=0, atol=0)
    torch.testing.assert_close(d_w, (ref * dy[:, None]).sum(-1) * kept.view(T, k))


def check_gradient_row_encoder():
    """The combine backward serving an encoder: its scales are the amax of the stored
    ``d_rows`` rows, bit for bit, and its codes mark their signs and peaks, for tokens
    with a NaN, an infinity, zeros only, one huge element, and slots whose weight is zero
    or infinite (NaN rows from ``inf * 0``); ``d_rows`` and ``d_w`` are those of the
    launch without an encoder. Through the dispatcher: received once, for exactly the
    gradient of the tensor that carries the encoder; nothing with a capacity (padding
    rows), nor for a tensor computed from it."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        T, k, D = 9, 3, 37
        R = T * k
        tag = f"{dtype}"
        rows = torch.randn(R, D, generator=g).to(dtype)
        row_of_slot = torch.randperm(R, generator=g)
        w = torch.rand(T * k, generator=g)
        dy = torch.randn(T, D, generator=g).to(dtype)
        dy[1, 5] = float("nan")
        dy[2, 7] = float("inf")
        dy[3] = 0.0
        dy[4, 30] = 3e4
        w[5 * k] = 0.0  # a zero weight: a zero row
        w[6 * k + 1] = float("inf")  # inf * dy: inf rows, NaN where dy is 0
        dy[6, 3] = 0.0
        w[7 * k + 2] = float("inf")
        dy[7] = torch.where(dy[7] == 0, 1.0, dy[7])  # no zero: an all-infinite row
        enc = SignPeakEncoder()
        d_rows, d_w, codes, scales = _combine_kernels.combine_backward(
            dy, rows, row_of_slot, w, None, R, encoder=enc)
        plain_rows, plain_w, none, _ = _combine_kernels.combine_backward(dy, rows, row_of_slot, w, None, R)
        assert none is None and torch.equal(d_rows.view(torch.uint8), plain_rows.view(torch.uint8)), tag
        torch.testing.assert_close(d_w, plain_w, rtol=1e-6, atol=1e-6, equal_nan=True)
        nan_rows = d_rows.float().isnan().any(1)
        assert nan_rows.sum() == 4, f"{tag}: {nan_rows.nonzero().flatten()}"  # dy's NaN, inf * 0
        assert scales[nan_rows].isnan().all(), tag
        amax, code = expected_codes(d_rows)
        ok = ~nan_rows
        assert torch.equal(scales[ok], amax[ok]), f"{tag}: {scales[ok].flatten()} vs {amax[ok].flatten()}"
        assert torch.equal(codes[ok], code[ok]), tag
        assert torch.isinf(scales[row_of_slot[7 * k + 2]]).all(), tag
        assert (scales[row_of_slot[5 * k]] == 0).all() and (scales[row_of_slot[3 * k]] == 0).all(), tag
        try:
            _combine_kernels.combine_backward(dy, rows, row_of_slot, w, torch.ones(T * k), R, encoder=enc)
        except ValueError as e:
            assert "every row written" in str(e), e
        else:
            raise AssertionError("an encoder with a kept mask was accepted")

    fused = functools.partial(_AUTO["combine_backward"], backend="triton")
    dispatch.combine_backward = fused
    try:
        for capacity_factor in (None, 1.0):
            ids = _ids(10, 6, 2, g, skew=capacity_factor is not None)
            x = torch.randn(10, 16, generator=g).bfloat16().requires_grad_()
            w = torch.rand(10, 2, generator=g)
            disp = LocalDispatcher(6, capacity_factor)
            rows, _, h = disp.dispatch(x, ids)
            out = rows * 2
            enc = SignPeakEncoder()
            setattr(out, GRADIENT_ROW_ENCODER, enc)
            (d_out,) = torch.autograd.grad(disp.combine(out, w, h), out, torch.randn(10, 16, generator=g).bfloat16())
            if capacity_factor is not None:
                assert not enc.received, "an encoder was served with padding rows"
                continue
            assert len(enc.received) == 1 and enc.received[0][0].data_ptr() == d_out.data_ptr()
            assert torch.equal(enc.received[0][2], expected_codes(d_out)[0])
            disp.combine(out * 1, w, h).sum().backward()
            assert len(enc.received) == 1, "a tensor computed from the output carries no encoder"
    finally:
        dispatch.combine_backward = _AUTO["combine_backward"]


def check_gather_row_encoder():
    """The gather serving an encoder: rows bit for bit ``index_select``'s (zero padding
    rows), scales the amax of each row (NaN for a row with a NaN, infinite for one with an
    infinity, zero for zero rows and padding), codes marking signs and peaks. Through the
    dispatcher (dropless and with a capacity): ``dispatch_encoded`` gives ``dispatch``'s
    rows, offsets and gradients and hands the encoder exactly its rows, once; and an MoE
    layer hands its experts' ``INPUT_ROW_ENCODER`` to it."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float32):
        T, R, D = 7, 19, 37
        x = torch.randn(T, D, generator=g).to(dtype)
        x[1, 4], x[2, 9], x[3], x[4, 30] = float("nan"), float("-inf"), 0.0, 3e4
        token_of_row = torch.randint(0, T, (R,), generator=g)
        token_of_row[:5] = torch.arange(1, 6)
        valid = torch.rand(R, generator=g) > 0.3
        valid[:5] = True
        for valid_rows in (None, valid):
            rows, codes, scales = _gather_kernels.gather_rows_encoded(x, token_of_row, valid_rows,
                                                                      SignPeakEncoder())
            want = dispatch.gather_rows_reference(x, token_of_row, valid_rows)
            assert torch.equal(rows.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), dtype
            nan_rows = rows.float().isnan().any(1)
            assert scales[nan_rows].isnan().all() and nan_rows.sum() >= 1, dtype
            amax, code = expected_codes(rows)
            assert torch.equal(scales[~nan_rows], amax[~nan_rows]), dtype
            assert torch.equal(codes[~nan_rows], code[~nan_rows]), dtype
            assert scales[1].isinf() and scales[2] == 0, dtype
            if valid_rows is not None:
                assert (scales[~valid_rows] == 0).all() and (rows[~valid_rows] == 0).all(), dtype

    fused = functools.partial(_AUTO["gather_rows"], backend="triton")
    dispatch.gather_rows = fused
    try:
        for capacity_factor in (None, 0.75):
            ids = _ids(10, 6, 2, g, skew=capacity_factor is not None)
            x = torch.randn(10, 16, generator=g).bfloat16()
            disp = LocalDispatcher(6, capacity_factor)
            enc = SignPeakEncoder()
            got, want = [], []
            for out, encoder in ((got, enc), (want, None)):
                xr = x.clone().requires_grad_()
                rows, offsets, h = (disp.dispatch_encoded(xr, ids, None, encoder) if encoder
                                    else disp.dispatch(xr, ids))
                (dx,) = torch.autograd.grad(rows, xr, torch.ones_like(rows))
                out += [rows, offsets, dx]
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), capacity_factor
            assert len(enc.received) == 1 and enc.received[0][0] is got[0], capacity_factor
            assert torch.equal(enc.received[0][2], expected_codes(got[0])[0]), capacity_factor
    finally:
        dispatch.gather_rows = _AUTO["gather_rows"]

    from moe_model import MoEConfig
    from moe_model.moe import MoELayer

    layer = MoELayer(MoEConfig(d_model=16, n_experts=4, top_k=2, expert_hidden=8))
    seen = []

    class Recording:
        row_scale, row_encode = SignPeakEncoder.row_scale, SignPeakEncoder.row_encode

        def receive(self, rows, codes, scales):
            seen.append(rows)

    setattr(layer.experts, INPUT_ROW_ENCODER, Recording())
    dispatch.gather_rows = fused
    try:
        layer(torch.randn(2, 3, 16, generator=g))
    finally:
        dispatch.gather_rows = _AUTO["gather_rows"]
    assert len(seen) == 1 and seen[0].shape == (12, 16)


def main():
    check_direct()
    check_gradient_row_encoder()
    check_gather_row_encoder()
    for dtype in (torch.float32, torch.bfloat16):
        check(13, 40, 6, 1, None, dtype)  # dropless, k=1
        check(13, 40, 10, 8, None, dtype)  # dropless, k=8
        check(3, 5, 4, 2, None, dtype, expanded_dy=True)  # D below the block, dy row stride 0
        check(13, 37, 4, 2, 0.75, dtype)  # capacity: drops and padding rows
        check(11, 24, 10, 8, 1.0, dtype)  # capacity, k=8
    print("ok")


if __name__ == "__main__":
    main()
