"""FP8 kernel cases (moe_mxfp8._fp8_kernels, _fp8_codec_kernels, _swiglu_kernels), run by
test_fp8_triton_interpret.py through ``moe_testing.run_under_triton_interpreter`` (a child
process with ``TRITON_INTERPRET=1`` set before Triton is imported). Prints one line of
JSON (case name -> number of mismatching elements, or an error string), then ``ok``."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run by moe_testing.run_under_triton_interpreter"

import torch  # noqa: E402
from case_helpers import mismatches, report, sample  # noqa: E402
from fp8_codec_cases import CODEC_WIDTHS, adversarial_packed, adversarial_rows  # noqa: E402
from moe_mxfp8 import (  # noqa: E402
    decode_fp8_rows,
    decode_fp8_rows_reference,
    encode_fp8_rows,
    encode_fp8_rows_reference,
    group_columns_layout,
    quantize_fp8,
    quantize_fp8_reference,
    quantize_group_column_blocks,
    quantize_group_columns,
    quantize_weight_blocks,
    quantize_weight_rowwise,
    swiglu,
    swiglu_backward,
    swiglu_backward_quantized,
    swiglu_backward_reference,
    swiglu_quantized,
    swiglu_reference,
)
from row_encoding import row_encoding_mismatches  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# (name, shape, block): whole rows of odd and power-of-two widths, a stack, 1x128 tiles with
# a partial last tile, 128x128 blocks cut in both dims.
BLOCK_CASES = [
    ("rows/37x77", (37, 77), (1, 0)),
    ("rows/3x20x64", (3, 20, 64), (1, 0)),
    ("tiles/40x300", (40, 300), (1, 128)),
    ("blocks/2x130x200", (2, 130, 200), (128, 128)),
]
OFFSETS = [9, 9, 40, 41, 64]  # an empty expert, a one-row expert, rows 64.. are padding


def cases():
    for name, shape, block in BLOCK_CASES:
        for dname, dtype in DTYPES.items():
            for pow2 in (True, False):
                def run(shape=shape, dtype=dtype, block=block, pow2=pow2):
                    x = sample(shape, dtype)
                    got, ref = (quantize_fp8(x, block, pow2, backend=b) for b in ("triton", "reference"))
                    return mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)

                yield f"quantize/{name}/{dname}/pow2={pow2}", run
    for dname, dtype in DTYPES.items():
        for pow2 in (True, False):
            for kind, quantize in (("group_columns", quantize_group_columns),
                                   ("group_column_blocks", quantize_group_column_blocks)):
                def group(dtype=dtype, pow2=pow2, quantize=quantize):
                    x = sample((70, 100), dtype, seed=1)
                    offsets = torch.tensor(OFFSETS, dtype=torch.int32)
                    (dt, st, et), (dr, sr, er) = (quantize(x, offsets, pow2, backend=b)
                                                  for b in ("triton", "reference"))
                    # per expert: columns past the last padded end are unspecified
                    used = dt.shape[1] if quantize is quantize_group_column_blocks else int(er[-1])
                    return (mismatches(dt[:, :used], dr[:, :used]) + mismatches(st, sr)
                            + int(not torch.equal(et, er)))

                yield f"{kind}/{dname}/pow2={pow2}", group

    def group_columns_many_experts():
        """Leading and inner empty experts, tiles that meet several experts, a large one
        spread over several tiles, rows past the last offset; launch shapes with the
        encoding pass forward and reversed, experts in order and longest first."""
        from moe_mxfp8 import _fp8_kernels as k

        x = sample((230, 70), torch.bfloat16, seed=11)
        offsets = torch.tensor([0, 0, 3, 20, 20, 21, 50, 90, 90, 130, 131, 200], dtype=torch.int32)
        saved = dict(k._TILES)
        total = 0
        try:
            for tile in (saved["group_columns"], k.ColumnTile(16, 32, 1),
                         k.ColumnTile(32, 16, 1, True), k.ColumnTile(16, 32, 1, False, True)):
                k._TILES["group_columns"] = tile
                layout = group_columns_layout(offsets, "triton")  # as two operands share one
                dr, sr, er = quantize_group_columns(x, offsets, False, backend="reference")
                used = int(er[-1])
                for dt, st, et in (quantize_group_columns(x, offsets, False, backend="triton"),
                                   quantize_group_columns(x, offsets, False, backend="triton", layout=layout)):
                    total += (mismatches(dt[:, :used], dr[:, :used]) + mismatches(st, sr)
                              + int(not torch.equal(et, er)))
        finally:
            k._TILES.update(saved)
        return total

    yield "group_columns/many_experts", group_columns_many_experts

    def column_blocks_many_experts():
        """Leading and inner empty experts, experts of one row, of exactly 128 and of more
        than two blocks, rows past the last offset; column strips that cut the width."""
        from moe_mxfp8 import _fp8_kernels as k

        x = sample((560, 70), torch.bfloat16, seed=12)
        offsets = torch.tensor([0, 0, 3, 131, 131, 132, 260, 520, 520, 521], dtype=torch.int32)
        saved = dict(k._TILES)
        total = 0
        try:
            for tile in (saved["column_blocks"], k.ColumnTile(128, 16, 1), k.ColumnTile(128, 128, 2)):
                k._TILES["column_blocks"] = tile
                (dt, st, et), (dr, sr, er) = (quantize_group_column_blocks(x, offsets, False, backend=b)
                                              for b in ("triton", "reference"))
                total += mismatches(dt, dr) + mismatches(st, sr) + int(not torch.equal(et, er))
        finally:
            k._TILES.update(saved)
        return total

    yield "group_column_blocks/many_experts", column_blocks_many_experts

    def wide_rows():
        """Rowwise scales of rows past ``ROW_WIDTH_MAX`` (two passes in chunks, the last one
        cut): at the real limit, and with the limit lowered for every dtype, a stack and a
        chunk that does not divide the width."""
        from moe_mxfp8 import _fp8_kernels as k

        total = 0
        x = sample((2, k.ROW_WIDTH_MAX + 300), torch.bfloat16, seed=13)
        got, ref = (quantize_fp8(x, (1, 0), True, backend=b) for b in ("triton", "reference"))
        total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
        saved = k.ROW_WIDTH_MAX, k._TILES["wide_rows"]
        k.ROW_WIDTH_MAX, k._TILES["wide_rows"] = 64, k.BlockTile(32, 1)
        try:
            for shape in ((5, 300), (2, 3, 77)):
                for dtype in DTYPES.values():
                    for pow2 in (True, False):
                        x = sample(shape, dtype, seed=14)
                        got, ref = (quantize_fp8(x, (1, 0), pow2, backend=b)
                                    for b in ("triton", "reference"))
                        total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
        finally:
            k.ROW_WIDTH_MAX, k._TILES["wide_rows"] = saved
        return total

    yield "wide_rows", wide_rows
    def weight_copies(quantize, block, parts):
        """Mismatches of ``quantize``'s two copies of ``cat(parts)`` (fresh, and written into
        given copies) against quantizing the concatenation and its transpose."""
        total = 0
        weight = torch.cat(parts, dim=-2)
        for pow2 in (True, False):
            want = (quantize_fp8_reference(weight, block, pow2),
                    quantize_fp8_reference(weight.mT.contiguous(), block, pow2))
            fresh = quantize(parts, pow2, backend="triton")
            into = quantize(parts, not pow2, backend="triton")
            got = quantize(parts, pow2, out=into, backend="triton")
            total += int(not (got[0] is into[0] and got[1] is into[1]))
            for g, w in [*zip(fresh, want, strict=True), *zip(got, want, strict=True)]:
                total += mismatches(g.data, w.data) + mismatches(g.scale, w.scale)
        return total

    for dname, dtype in DTYPES.items():
        def weight_rowwise(dtype=dtype):
            """Both copies of one weight or of gate and up: the column kernel with word stores
            (M a multiple of 4) and byte stores, tiles cut by the rows and both walking orders,
            the transposed-copy fallback (too few column strips)."""
            from moe_mxfp8 import _fp8_kernels as k

            total = 0
            saved = k._TILES["group_columns"], k.WEIGHT_COLUMNS_MIN_PROGRAMS
            cases = [((3, 8, 64), (3, 12, 64)), ((37, 77),), ((2, 5, 40), (2, 6, 40))]
            try:
                for tile, min_programs in ((saved[0], 1), (k.ColumnTile(16, 32, 1), 1),
                                           (k.ColumnTile(8, 16, 2, True), 1), (saved[0], saved[1])):
                    k._TILES["group_columns"], k.WEIGHT_COLUMNS_MIN_PROGRAMS = tile, min_programs
                    for i, shapes in enumerate(cases):
                        parts = [sample(shape, dtype, seed=20 + i + j) for j, shape in enumerate(shapes)]
                        total += weight_copies(quantize_weight_rowwise, (1, 0), parts)
            finally:
                k._TILES["group_columns"], k.WEIGHT_COLUMNS_MIN_PROGRAMS = saved
            return total

        yield f"weight_rowwise/{dname}", weight_rowwise

        def weight_blocks(dtype=dtype):
            """Both 128x128-block copies, written in one pass per part: gate and up of whole
            blocks (one launch each), parts that end inside a block (concatenated first), cut
            blocks along both axes; whole blocks in two passes of row chunks (the GPU's
            launch shape), in registers, and two per program."""
            from moe_mxfp8 import _fp8_kernels as k

            total = 0
            saved = k._TILES["blocks"]
            cases = [((2, 128, 160), (2, 128, 160)), ((2, 100, 144), (2, 60, 144)), ((200, 136),)]
            try:
                for tile in (saved, k.BlockTile(128 * 128, 2), k.BlockTile(128 * 128, 2, 2)):
                    k._TILES["blocks"] = tile
                    for i, shapes in enumerate(cases):
                        parts = [sample(shape, dtype, seed=40 + i + j) for j, shape in enumerate(shapes)]
                        total += weight_copies(quantize_weight_blocks, (128, 128), parts)
            finally:
                k._TILES["blocks"] = saved
            return total

        yield f"weight_blocks/{dname}", weight_blocks
    for dname, dtype in DTYPES.items():
        def codec_encode(dtype=dtype):
            total = 0
            for x in [sample((37, 77), dtype, seed=9), sample((33, 64), dtype, seed=10),
                      torch.randn(5, 1).to(dtype), adversarial_rows(dtype)]:
                D = x.shape[1]
                got, ref = encode_fp8_rows(x, backend="triton"), encode_fp8_rows_reference(x)
                total += mismatches(got[:, :D].view(torch.float8_e4m3fn), ref[:, :D].view(torch.float8_e4m3fn))
                total += mismatches(got[:, D:].contiguous().view(torch.float32),
                                    ref[:, D:].contiguous().view(torch.float32))
            return total

        def codec_decode(dtype=dtype):
            total = 0
            packs = [encode_fp8_rows_reference(sample((37, D), dtype, seed=D)) if D > 1
                     else encode_fp8_rows_reference(torch.randn(5, 1).to(dtype)) for D in CODEC_WIDTHS]
            wide = torch.zeros(16, 100, dtype=torch.uint8)
            wide[:, :68] = adversarial_packed()
            packs += [adversarial_packed(), adversarial_packed(5), wide[:, :68]]  # the last: row stride 100
            for packed in packs:
                for out in DTYPES.values():
                    total += mismatches(decode_fp8_rows(packed, out, backend="triton"),
                                        decode_fp8_rows_reference(packed, out))
            return total

        yield f"codec/encode/{dname}", codec_encode
        yield f"codec/decode/{dname}", codec_decode

    def small_tiles():
        """Launch shapes other than the defaults: several rows per program cut by M, column
        tiles cut by N and groups longer than one row tile."""
        from moe_mxfp8 import _fp8_kernels as k

        saved = dict(k._TILES)
        k._TILES.update(rows=k.BlockTile(256, 1), tiles=k.BlockTile(512, 2),
                        blocks=k.BlockTile(128 * 128, 4), group_columns=k.ColumnTile(16, 32, 1))
        try:
            total = 0
            for shape, block in (((37, 77), (1, 0)), ((40, 300), (1, 128)),
                                 ((130, 200), (128, 128))):
                x = sample(shape, torch.bfloat16, seed=5)
                got, ref = (quantize_fp8(x, block, True, backend=b) for b in ("triton", "reference"))
                total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
            # two scale blocks per program: the last program's second group lies past N
            k._TILES.update(tiles=k.BlockTile(1024, 2, 2), blocks=k.BlockTile(128 * 128, 4, 2))
            for shape, block in (((40, 300), (1, 128)), ((2, 130, 300), (128, 128))):
                for pow2 in (True, False):
                    x = sample(shape, torch.float32, seed=7)
                    got, ref = (quantize_fp8(x, block, pow2, backend=b) for b in ("triton", "reference"))
                    total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
            # 128x128 blocks in two passes of 32-row chunks, one and two blocks per program
            for tile in (k.BlockTile(128 * 128, 4, 1, 32), k.BlockTile(128 * 128, 4, 2, 32)):
                k._TILES.update(blocks=tile)
                for dtype in (torch.bfloat16, torch.float32):
                    x = sample((2, 130, 300), dtype, seed=9)
                    got, ref = (quantize_fp8(x, (128, 128), False, backend=b) for b in ("triton", "reference"))
                    total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
            x = sample((70, 100), torch.float32, seed=6)
            offsets = torch.tensor(OFFSETS, dtype=torch.int32)
            (dt, st, _), (dr, sr, er) = (quantize_group_columns(x, offsets, True, backend=b)
                                         for b in ("triton", "reference"))
            used = int(er[-1])
            total += mismatches(dt[:, :used], dr[:, :used]) + mismatches(st, sr)
            from moe_mxfp8 import _fp8_codec_kernels as c

            saved_codec = dict(c._TILES)
            c._TILES.update(encode=c.RowTile(256, 1), decode=c.RowTile(512, 2))
            try:  # several rows per program, the last program cut by R
                x = sample((37, 77), torch.bfloat16, seed=8)
                got, ref = encode_fp8_rows(x, backend="triton"), encode_fp8_rows_reference(x)
                total += mismatches(got[:, :77].view(torch.float8_e4m3fn), ref[:, :77].view(torch.float8_e4m3fn))
                total += mismatches(got[:, 77:].contiguous().view(torch.float32),
                                    ref[:, 77:].contiguous().view(torch.float32))
                total += mismatches(decode_fp8_rows(ref, torch.bfloat16, backend="triton"),
                                    decode_fp8_rows_reference(ref, torch.bfloat16))
            finally:
                c._TILES.clear()
                c._TILES.update(saved_codec)
            return total
        finally:
            k._TILES.clear()
            k._TILES.update(saved)

    yield "small_tiles", small_tiles
    for dname, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        def fused_swiglu(dtype=dtype):
            """Elements beyond FP32 rounding of exp (plus one output rounding) apart."""
            g = torch.Generator().manual_seed(2)
            h13 = (torch.randn(37, 2 * 150, generator=g) * 4).to(dtype)
            dh = torch.randn(37, 150, generator=g).to(dtype)
            tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
            bad = 0
            for got, want in ((swiglu(h13, backend="triton"), swiglu_reference(h13)),
                              (swiglu_backward(h13, dh, dtype, backend="triton"),
                               swiglu_backward_reference(h13, dh, dtype))):
                close = torch.isclose(got.float(), want.float(), **tol)
                bad += int((~close).sum()) + int(got.dtype != want.dtype or got.shape != want.shape)
            return bad

        yield f"swiglu/{dname}", fused_swiglu

        def quantized_swiglu(dtype=dtype):
            """The quantizing kernels equal the plain kernels' output quantized, bit for bit;
            blocks the quantizing kernels do not take go through the plain kernels."""
            g = torch.Generator().manual_seed(3)
            h13 = (torch.randn(37, 2 * 150, generator=g) * 4).to(dtype)
            h13[0] = 0.0  # a zero row
            h13[1, 5] = float("inf")
            dh = torch.randn(37, 150, generator=g).to(dtype)
            total = 0
            for pow2, block in ((True, (1, 0)), (False, (1, 0)), (False, (1, 128))):
                got = swiglu_quantized(h13, block, pow2, backend="triton")
                ref = quantize_fp8(swiglu(h13, backend="triton"), block, pow2, backend="triton")
                total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
                dh13, got = swiglu_backward_quantized(h13, dh, dtype, block, pow2, backend="triton")
                plain = swiglu_backward(h13, dh, dtype, backend="triton")
                ref = quantize_fp8(plain, block, pow2, backend="triton")
                total += mismatches(dh13.view(torch.int16 if dtype == torch.bfloat16 else torch.float32),
                                    plain.view(torch.int16 if dtype == torch.bfloat16 else torch.float32))
                total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
            # both backward kernels also write the forward's value, bit for bit, into a
            # strided view, and leave their own outputs as they were
            bits = torch.int16 if dtype == torch.bfloat16 else torch.float32
            want_h = swiglu(h13, backend="triton").view(bits)
            for block in ((1, 0), (1, 128)):
                h_out = torch.full((37, 160), 7.0, dtype=dtype)[:, 3:153]
                dh13, got = swiglu_backward_quantized(h13, dh, dtype, block, True, backend="triton",
                                                      h_out=h_out)
                ref_dh13, ref = swiglu_backward_quantized(h13, dh, dtype, block, True, backend="triton")
                total += mismatches(h_out.view(bits), want_h) + mismatches(dh13.view(bits), ref_dh13.view(bits))
                total += mismatches(got.data, ref.data) + mismatches(got.scale, ref.scale)
            h_out = torch.empty(37, 150, dtype=dtype)
            plain = swiglu_backward(h13, dh, dtype, backend="triton", h_out=h_out)
            total += mismatches(h_out.view(bits), want_h)
            total += mismatches(plain.view(bits), swiglu_backward(h13, dh, dtype, backend="triton").view(bits))
            return total

        yield f"swiglu_quantized/{dname}", quantized_swiglu

    def quantized_swiglu_launch_shapes():
        """The quantizing SwiGLU kernels at other launch shapes (one row per program, several
        with a cut last program) equal the plain kernels' output quantized, bit for bit."""
        from moe_mxfp8 import _swiglu_kernels as k

        g = torch.Generator().manual_seed(4)
        h13 = (torch.randn(37, 2 * 150, generator=g) * 4).to(torch.bfloat16)
        dh = torch.randn(37, 150, generator=g).to(torch.bfloat16)
        plain = swiglu_backward(h13, dh, torch.bfloat16, backend="triton")
        want_fwd = quantize_fp8(swiglu(h13, backend="triton"), (1, 0), True, backend="triton")
        want_bwd = quantize_fp8(plain, (1, 0), True, backend="triton")
        saved = dict(k._TILES)
        total = 0
        try:
            for tile in (k.BlockTile(256, 1), k.BlockTile(1024, 2), k.BlockTile(4096, 8)):
                k._TILES.update(swiglu=tile, swiglu_backward=tile)
                got = swiglu_quantized(h13, (1, 0), True, backend="triton")
                total += mismatches(got.data, want_fwd.data) + mismatches(got.scale, want_fwd.scale)
                dh13, got = swiglu_backward_quantized(h13, dh, torch.bfloat16, (1, 0), True, backend="triton")
                total += mismatches(dh13.view(torch.int16), plain.view(torch.int16))
                total += mismatches(got.data, want_bwd.data) + mismatches(got.scale, want_bwd.scale)
        finally:
            k._TILES.update(saved)
        return total

    yield "swiglu_quantized/launch_shapes", quantized_swiglu_launch_shapes

    for dname in ("f32", "bf16"):
        for pow2 in (True, False):
            yield (f"row_encoding/{dname}/pow2={pow2}",
                   lambda d=DTYPES[dname], p=pow2: row_encoding_mismatches(d, p))


def main() -> None:
    report(cases())


if __name__ == "__main__":
    main()
