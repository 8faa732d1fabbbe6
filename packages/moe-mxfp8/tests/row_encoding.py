"""``RowCodes``' device functions called from another kernel with each row's
amax given, as moe_model's cross-entropy calls them, against ``quantize_fp8_reference``:
run under the interpreter (fp8_triton_cases.py) and on a GPU (test_fp8_gpu.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from case_helpers import mismatches, sample
from fp8_codec_cases import adversarial_rows
from moe_mxfp8.fp8 import quantize_fp8_reference
from moe_mxfp8.row_codes import RowCodes


@triton.jit
def _encode_rows(x_ptr, amax_ptr, codes_ptr, scales_ptr, N, ROW_SCALE: tl.constexpr,
                 ROW_ENCODE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    scale = ROW_SCALE(tl.load(amax_ptr + row))
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N).to(tl.float32)
    tl.store(codes_ptr + row * N + cols, ROW_ENCODE(x, scale), mask=cols < N)
    tl.store(scales_ptr + row, scale)


def row_encoding_mismatches(dtype: torch.dtype, pow2: bool, device: str = "cpu") -> int:
    """Mismatching codes and scales over random rows and adversarial ones (zeros, the
    dtype's extremes, subnormals, E4M3's largest code, an infinity, a NaN)."""
    x = torch.cat([sample((9, 40), dtype, seed=5), adversarial_rows(dtype)]).to(device)
    wide = x.float()
    amax = torch.where(wide.isnan().any(1), float("nan"), wide.abs().amax(1))
    enc = RowCodes(pow2)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=device)
    scales = torch.empty(x.shape[0], 1, device=device)
    _encode_rows[(x.shape[0],)](x, amax, codes, scales, x.shape[1], enc.row_scale, enc.row_encode,
                                BLOCK=64, enable_fp_fusion=False)
    ref = quantize_fp8_reference(x.cpu(), (1, 0), pow2)
    return (mismatches(codes.cpu().view(torch.float8_e4m3fn), ref.data)
            + mismatches(scales.cpu(), ref.scale))
