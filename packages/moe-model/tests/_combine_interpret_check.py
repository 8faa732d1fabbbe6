"""Run by test_fused_combine.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported, and never in the test process itself): the fused combine kernels on CPU
against the torch reference path of the local dispatcher, forward and all gradients: the
dispatcher's combine and gather run the public ``weighted_gather_sum`` and
``combine_backward`` with ``backend="triton"``, against their ``"auto"`` (on CPU, the
reference) selves."""

import functools

import torch
from _cross_entropy_interpret_check import _Encoder, expected_codes
from moe_model import GRADIENT_ROW_ENCODER, LocalDispatcher, _combine_kernels, dispatch

_PUBLIC_OPS = ("weighted_gather_sum", "combine_backward")
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


def _amax_bits(rows):
    """Each row's largest magnitude, NaN where the row holds one (a max over bit patterns)."""
    bits = rows.float().abs().view(torch.int32).amax(1, keepdim=True)
    return bits.view(torch.float32)


def check_gradient_row_encoder():
    """With an encoder, the backward also writes each ``d_rows`` row's scale, the amax of
    the stored row bit for bit (from ``|w| * max|dy[t]|``: a token's NaN or infinity, a
    zero weight times an infinity, a zero token, FP32 subnormals), and its codes; ``d_rows``
    and ``d_w`` are the bits written without one (here; a GPU's ``d_w`` may differ in the
    last bits, the GPU test at the workspace root). The dispatcher's combine serves the
    expert output's ``GRADIENT_ROW_ENCODER``, only on exactly that tensor and only where
    every row is written (not with capacity drops or padding rows)."""
    g = torch.Generator().manual_seed(3)
    T, D, E, k = 13, 40, 6, 3
    for dtype in (torch.bfloat16, torch.float32):
        tag = str(dtype)
        ids = _ids(T, E, k, g, skew=False)
        x = torch.randn(T, D, generator=g).to(dtype)
        disp = LocalDispatcher(E, None)
        rows, _, h = disp.dispatch(x, ids)
        rows_out = torch.randn(rows.shape, generator=g).to(dtype)
        w = torch.rand(T * k, generator=g)
        w[5 * k] = 0.0
        w[2 * k + 1] = 0.0  # times the infinity of token 2: a NaN row
        dy = torch.randn(T, D, generator=g).to(dtype)
        dy[1, 7] = float("nan")
        dy[2, 3] = float("inf")
        dy[3] = 0.0
        if dtype == torch.float32:  # the interpreter's FP32 -> BF16 conversion of subnormals is
            dy[4] = torch.randn(D, generator=g) * 1e-39  # not monotone (the GPU's is: its test)
        dy[6, 9] = -1e30
        enc = _Encoder()
        d_rows, d_w = dispatch.combine_backward(dy, rows_out, w, h, backend="triton", encoder=enc)
        plain_rows, plain_w = dispatch.combine_backward(dy, rows_out, w, h, backend="triton")
        assert torch.equal(d_rows.view(torch.uint8), plain_rows.view(torch.uint8)), tag
        assert torch.equal(d_w.nan_to_num(7.0), plain_w.nan_to_num(7.0)), tag
        assert len(enc.received) == 1, tag
        got_rows, codes, scales = enc.received[0]
        assert got_rows is d_rows and codes.shape == d_rows.shape and scales.shape == (rows.shape[0], 1), tag
        amax = _amax_bits(d_rows)
        nan = amax.isnan()
        # token 1's rows, and token 2's row of weight zero (0 * inf); its others are infinite
        assert nan.sum() == k + 1 and amax.isinf().sum() == k - 1, f"{tag}: {nan.sum()} NaN rows"
        assert torch.equal(scales.isnan(), nan), tag
        assert torch.equal(scales[~nan], amax[~nan]), f"{tag}: {scales.flatten()} vs {amax.flatten()}"
        some = (~nan & (amax > 0)).flatten()  # (the test encoder's codes of a zero row are 3s)
        assert torch.equal(codes[some], expected_codes(d_rows[some])[1]), tag
        assert (scales[~nan] == 0).sum() == k + 1 and (scales > 0).sum() > 0, tag  # token 3, w = 0

        # through the dispatcher: the attribute of the expert output it combines
        combine_bwd = dispatch.combine_backward
        dispatch.combine_backward = functools.partial(combine_bwd, backend="triton")
        try:
            for capacity_factor, feeds, got in ((None, "it", 1), (None, "a copy", 0), (0.75, "it", 0)):
                disp = LocalDispatcher(E, capacity_factor)
                rows, _, h = disp.dispatch(x, _ids(T, E, k, g, skew=capacity_factor is not None))
                out = rows_out[: rows.shape[0]].clone().requires_grad_()
                enc = _Encoder()
                setattr(out, GRADIENT_ROW_ENCODER, enc)
                wk = torch.rand(T, k, generator=g)
                y = disp.combine(out if feeds == "it" else out * 1, wk, h)
                (d_out,) = torch.autograd.grad(y, out, dy.nan_to_num(0.0, 0.0, 0.0))
                assert len(enc.received) == got, f"{tag} cf={capacity_factor} {feeds}"
                if got:
                    assert enc.received[0][0].data_ptr() == d_out.data_ptr(), tag
                    assert torch.equal(enc.received[0][2], _amax_bits(d_out)), tag
        finally:
            dispatch.combine_backward = combine_bwd
    try:
        _combine_kernels.combine_backward(dy, rows_out, h.row_of_slot, w, None, rows.shape[0], zero_fill=True,
                                          encoder=_Encoder())
    except ValueError as e:
        assert "every row written" in str(e)
    else:
        raise AssertionError("an encoder with zero-filled rows was accepted")


def main():
    check_direct()
    check_gradient_row_encoder()
    for dtype in (torch.float32, torch.bfloat16):
        check(13, 40, 6, 1, None, dtype)  # dropless, k=1
        check(13, 40, 10, 8, None, dtype)  # dropless, k=8
        check(3, 5, 4, 2, None, dtype, expanded_dy=True)  # D below the block, dy row stride 0
        check(13, 37, 4, 2, 0.75, dtype)  # capacity: drops and padding rows
        check(11, 24, 10, 8, 1.0, dtype)  # capacity, k=8
    print("ok")


if __name__ == "__main__":
    main()
