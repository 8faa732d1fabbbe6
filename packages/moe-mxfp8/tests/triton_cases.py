"""Triton kernel cases, run by test_triton_interpret.py in a child process.

``moe_testing.run_under_triton_interpreter`` runs it with ``TRITON_INTERPRET=1`` set
before Triton is imported, so the kernels run on CPU tensors; the parent's Triton (and
any GPU test in it) never sees the variable. Prints one line of JSON (case name ->
number of mismatching elements, or an error string), then ``ok``.
"""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run by moe_testing.run_under_triton_interpreter"

import torch  # noqa: E402
from case_helpers import mismatches, report, sample  # noqa: E402
from moe_mxfp8 import (  # noqa: E402
    MXFP8RowCodec,
    dequantize,
    quantize,
    quantize_dequantize,
    quantize_rows_and_cols,
)

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
SHAPES = {"37x77": (37, 77), "5x3x45": (5, 3, 45), "3x33x65": (3, 33, 65), "64x96": (64, 96)}


def cases():
    for sname, shape in SHAPES.items():
        for dname, dtype in DTYPES.items():
            x = sample(shape, dtype)
            for axis in range(len(shape)):
                def q(x=x, axis=axis):
                    (d, s), (rd, rs) = quantize(x, axis, backend="triton"), quantize(x, axis, backend="reference")
                    return mismatches(d, rd) + mismatches(s, rs)

                def dq(x=x, axis=axis, dtype=dtype):
                    d, s = quantize(x, axis, backend="reference")
                    return sum(mismatches(dequantize(d, s, axis, dtype=o, backend="triton"),
                                          dequantize(d, s, axis, dtype=o, backend="reference"))
                               for o in DTYPES.values())

                yield f"quantize/{sname}/{dname}/axis{axis}", q
                yield f"dequantize/{sname}/{dname}/axis{axis}", dq

            def both(x=x):
                got, ref = quantize_rows_and_cols(x, backend="triton"), quantize_rows_and_cols(x, backend="reference")
                return sum(mismatches(getattr(g, f), getattr(r, f))
                           for g, r in zip(got, ref, strict=True) for f in ("data", "scales"))

            def qdq(x=x):
                total = 0
                for o in DTYPES.values():
                    (dg, mg), (dr, mr) = (quantize_dequantize(x, o, keep_mxfp8=True, backend=b)
                                          for b in ("triton", "reference"))
                    total += mismatches(dg, dr) + mismatches(mg.data, mr.data) + mismatches(mg.scales, mr.scales)
                return total

            yield f"both/{sname}/{dname}", both
            yield f"quantize_dequantize/{sname}/{dname}", qdq

    def block16():
        x = sample((9, 50), torch.bfloat16, seed=1)
        total = 0
        for axis in (0, 1):
            (d, s), (rd, rs) = (quantize(x, axis, 16, backend=b) for b in ("triton", "reference"))
            total += mismatches(d, rd) + mismatches(s, rs)
            total += mismatches(dequantize(d, s, axis, 16, backend="triton"),
                                dequantize(d, s, axis, 16, backend="reference"))
        return total

    def codec():
        total = 0
        for D in (64, 70, 2):
            x = sample((13, D), torch.bfloat16, seed=D) if D >= 64 else torch.randn(13, D).bfloat16()
            packed_t = MXFP8RowCodec(backend="triton").encode(x)
            packed_r = MXFP8RowCodec(backend="reference").encode(x)
            # The data bytes compare as E4M3 (NaN is NaN whatever its sign), scales as bytes.
            total += mismatches(packed_t[:, :D].view(torch.float8_e4m3fn),
                                packed_r[:, :D].view(torch.float8_e4m3fn))
            total += mismatches(packed_t[:, D:], packed_r[:, D:])
            for o in DTYPES.values():
                total += mismatches(MXFP8RowCodec(backend="triton").decode(packed_r, o),
                                    MXFP8RowCodec(backend="reference").decode(packed_r, o))
        return total

    def empty():
        x = torch.zeros(0, 40)
        d, s = quantize(x, backend="triton")
        return int(d.shape != (0, 40) or s.shape != (0, 2))

    yield "block_size_16", block16
    yield "codec", codec
    yield "empty", empty
    yield from tile_cases()


# Launch shapes other than the defaults (small, so several programs, loop steps, partial
# chunks and cut tiles occur): (kind, Tile args) as in moe_mxfp8._quantize_kernels._TILES; the
# rows/cols shapes also drive that orientation's dequantize kernel (and rows the qdq one).
TILE_CASES = [
    ("rows", (64, 1, 3, 2)), ("rows", (32, 2, 2, 1)),
    ("cols", (32, 1, 3, 2)), ("cols", (64, 2, 2, 1)),
    ("both", (32, 1, 3, 2)), ("both", (64, 2, 2, 1)),
]
# [M, N] with 3 block-rows and N cut by every tile; batched with whole tiles (no masks)
# and block-rows not a multiple of the steps; batched with odd M.
TILE_SHAPES = [((70, 200), torch.bfloat16), ((2, 96, 128), torch.bfloat16),
               ((5, 33, 64), torch.float32), ((3, 40, 96), torch.float16)]


def tile_cases():
    from moe_mxfp8 import _quantize_kernels

    for i, (kind, args) in enumerate(TILE_CASES):
        def run(kind=kind, args=args):
            saved = dict(_quantize_kernels._TILES)
            extra = {"rows": ("qdq", "dequant_rows"), "cols": ("dequant_cols",), "both": ()}[kind]
            for key in (kind, *extra):
                _quantize_kernels._TILES[key] = _quantize_kernels.Tile(*args)
            try:
                total = 0
                for j, (shape, dtype) in enumerate(TILE_SHAPES):
                    x = sample(shape, dtype, seed=j)
                    if kind == "both":
                        got = quantize_rows_and_cols(x, backend="triton")
                        ref = quantize_rows_and_cols(x, backend="reference")
                        total += sum(mismatches(getattr(g, f), getattr(r, f))
                                     for g, r in zip(got, ref, strict=True)
                                     for f in ("data", "scales"))
                        continue
                    axis = -1 if kind == "rows" else -2
                    (d, s), (rd, rs) = (quantize(x, axis, backend=b) for b in ("triton", "reference"))
                    total += mismatches(d, rd) + mismatches(s, rs)
                    for o in (torch.bfloat16, torch.float32):
                        total += mismatches(dequantize(rd, rs, axis, dtype=o, backend="triton"),
                                            dequantize(rd, rs, axis, dtype=o, backend="reference"))
                    if kind == "rows":
                        (dg, mg), (dr, mr) = (quantize_dequantize(x, torch.bfloat16, keep_mxfp8=True,
                                                                  backend=b) for b in ("triton", "reference"))
                        total += mismatches(dg, dr) + mismatches(mg.data, mr.data)
                return total
            finally:
                _quantize_kernels._TILES.clear()
                _quantize_kernels._TILES.update(saved)

        yield f"tiles/{kind}/{i}", run


def main() -> None:
    report(cases())


if __name__ == "__main__":
    main()
