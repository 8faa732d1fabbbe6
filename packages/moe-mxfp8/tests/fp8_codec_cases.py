"""Adversarial inputs of the FP8 row codec (``encode_fp8_rows`` / ``decode_fp8_rows``),
shared by the interpreter cases (fp8_triton_cases.py) and the GPU tests (test_fp8_gpu.py)."""

from __future__ import annotations

import torch

CODEC_WIDTHS = (77, 64, 1)  # odd, a power of two, one column


def adversarial_rows(dtype: torch.dtype) -> torch.Tensor:
    """Rows to encode: all zeros, the dtype's largest magnitudes, subnormals only, a row
    whose amax is E4M3's largest code exactly, one with an infinity, one with a NaN."""
    info = torch.finfo(dtype)
    x = torch.zeros(7, 40)
    x[1, ::2], x[1, 1::2] = info.max, -info.max / 3
    x[2] = torch.linspace(-1, 1, 40) * info.smallest_normal / 2  # the dtype's subnormals
    x[3] = torch.linspace(-448, 448, 40)
    x[4] = torch.linspace(-3, 5, 40)
    x[4, 7] = float("inf")
    x[5] = torch.linspace(-3, 5, 40)
    x[5, 9] = float("nan")
    x[6] = torch.linspace(-1, 1, 40) * 1e-20
    return x.to(dtype)


def adversarial_packed(width: int = 64) -> torch.Tensor:
    """Packed rows whose codes run through all 256 bytes (zeros, +-448, the NaN codes,
    subnormal codes; row 0 all zero) under scales that are zero, subnormal, tiny, huge,
    infinite, NaN, negative, not powers of two, and the encoder's scale of a zero row."""
    scales = torch.tensor([0.0, -0.0, 1e-45, 1e-40, 2.0**-126, 2.0**-100, 3.0, 0.1, 1.0, -2.0,
                           448e12, 2.0**127, 3.4e38, float("inf"), float("nan"), 2.0**-149 * 3])
    rows = scales.shape[0]
    codes = (torch.arange(rows * width) % 256).to(torch.uint8).reshape(rows, width)
    codes[0] = 0
    return torch.cat([codes, scales[:, None].view(torch.uint8).reshape(rows, 4)], dim=1)
