"""The MXFP8 format: E4M3 elements in blocks that share one E8M0 power-of-two scale.

Scale rule (OCP MX v1.0, the "floor" rule of torchao's MX reference): for a block
with largest magnitude ``amax``, the scale is ``2**(floor(log2(amax)) - 8)`` (8 is
the exponent of E4M3's largest power of two, 256). Elements are divided by the
scale, saturated to +-448 and rounded to nearest-even E4M3. Special blocks:

- all zero (or ``amax`` an FP32 denormal): biased scale 0 (2**-127); elements are
  divided by 2**-126, the smallest normal, as the reference does;
- ``amax`` infinite: scale 2**120, infinities saturate to +-448;
- any NaN: scale NaN (biased 255); the whole block dequantizes to NaN.

Partial blocks: when the blocked axis is not a multiple of ``block_size`` the last
block is quantized as if zero-padded (zeros never change ``amax``); ``scales`` has
``ceil(n / block_size)`` entries along the axis and ``data`` keeps the input's shape.

Layout: ``data`` has the input's shape (contiguous); ``scales`` has it too, with the
blocked axis shortened to the block count. Nothing is transposed: "column"
orientation is ``axis=-2``.

Two implementations with identical bits: a pure-torch reference (``<op>_reference``,
any device) and Triton kernels (``moe_mxfp8._quantize_kernels``; CUDA, or CPU under
``TRITON_INTERPRET=1``). ``backend="auto"`` picks Triton for CUDA tensors when Triton is
installed, ``"triton"`` / ``"reference"`` force one, and ``use_reference_kernels(True)``
takes the reference whatever ``backend`` says (``_triton_support.resolve_backend``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_mxfp8._triton_support import Backend, resolve_backend

BLOCK_SIZE = 32  # elements sharing one scale (OCP MX)
E4M3_MAX = 448.0  # largest finite E4M3 magnitude
E4M3_MAX_POW2 = 8  # exponent of the largest power of two in E4M3 (256)
E8M0_NAN = 255  # biased E8M0 code for NaN
_F32_SIGN = -(2**31)  # 0x80000000 as int32
_F32_ABS = 0x7FFFFFFF
_F32_INF_BITS = 0x7F800000
_F32_NAN_BITS = 0x7FC00000
_F32_2POW_M127_BITS = 0x00400000  # 2**-127, an FP32 denormal

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFP8Tensor:
    """Quantized data plus scales, with the axis they were blocked along.

    ``data``: float8_e4m3fn, the original shape. ``scales``: float8_e8m0fnu, the
    original shape with ``axis`` shortened to ``ceil(n / block_size)``.
    """

    data: torch.Tensor
    scales: torch.Tensor
    axis: int
    block_size: int = BLOCK_SIZE

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel()

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, backend: Backend = "auto") -> torch.Tensor:
        return dequantize(self.data, self.scales, self.axis, self.block_size, dtype, backend)


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _norm_axis(axis: int, ndim: int, name: str) -> int:
    if ndim == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for {name} with {ndim} dims")
    return axis % ndim


def n_blocks(n: int, block_size: int = BLOCK_SIZE) -> int:
    """Scales along an axis of ``n`` elements (the last block may be partial)."""
    return -(-n // block_size)


def scales_shape(shape: tuple[int, ...], axis: int, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    axis = _norm_axis(axis, len(shape), "shape")
    out = list(shape)
    out[axis] = n_blocks(shape[axis], block_size)
    return tuple(out)


# --- pure-torch reference -------------------------------------------------------------


def _scale_from_amax_bits(amax_bits: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 scale (int32) from the bits of a block's FP32 ``|x|`` maximum."""
    scale = ((amax_bits >> 23) - E4M3_MAX_POW2).clamp_min(0)
    return torch.where(amax_bits > _F32_INF_BITS, E8M0_NAN, scale)


def _reciprocal_from_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / max(2**(s-127), 2**-126)`` exactly; 0 for the NaN scale (x*0 == x/inf)."""
    bits = torch.where(scale == E8M0_NAN, 0, (254 - scale.clamp_min(1)) << 23)
    return bits.to(torch.int32).view(torch.float32)


def scale_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> FP32 ``2**(s-127)`` (2**-127 for 0, NaN for 255), exactly."""
    s = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(s == 0, _F32_2POW_M127_BITS, s << 23)
    bits = torch.where(s == E8M0_NAN, _F32_NAN_BITS, bits)
    return bits.view(torch.float32)


def _check_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def _check_pair(data: torch.Tensor, scales: torch.Tensor, axis: int, block_size: int) -> int:
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"data must be float8_e4m3fn, got {data.dtype}")
    if scales.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"scales must be float8_e8m0fnu, got {scales.dtype}")
    _check_block_size(block_size)
    axis = _norm_axis(axis, data.dim(), "data")
    expected = scales_shape(tuple(data.shape), axis, block_size)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}; data {tuple(data.shape)} blocked along "
            f"axis {axis} by {block_size} needs {expected}"
        )
    if scales.device != data.device:
        raise ValueError(f"scales are on {scales.device} but data on {data.device}")
    return axis


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _INPUT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")


def _check_matrix(x: torch.Tensor, block_size: int) -> None:
    _check_input(x, "x")
    _check_block_size(block_size)
    if x.dim() < 2:
        raise ValueError(f"x must have at least 2 dims for two orientations, got {x.dim()}")


def quantize_reference(
    x: torch.Tensor, axis: int = -1, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager reference of :func:`quantize` (any device): the same contract and bits."""
    _check_input(x, "x")
    _check_block_size(block_size)
    axis = _norm_axis(axis, x.dim(), "x")
    x_last = x.movedim(axis, -1).to(torch.float32)
    n = x_last.shape[-1]
    nb = n_blocks(n, block_size)
    x_last = F.pad(x_last, (0, nb * block_size - n))
    blocks = x_last.reshape(*x_last.shape[:-1], nb, block_size)
    # On non-negative FP32 bit patterns integer order is float order, with NaN above
    # inf: one integer max finds amax and detects NaN without float comparisons.
    amax_bits = (blocks.view(torch.int32) & _F32_ABS).amax(-1)
    scale = _scale_from_amax_bits(amax_bits)
    scaled = blocks * _reciprocal_from_scale(scale).unsqueeze(-1)
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # clamp keeps NaN
    data = data.reshape(*x_last.shape[:-1], nb * block_size)[..., :n]
    data = data.movedim(-1, axis).contiguous()
    scales = scale.to(torch.uint8).view(torch.float8_e8m0fnu).movedim(-1, axis).contiguous()
    return data, scales


def dequantize_reference(
    data: torch.Tensor,
    scales: torch.Tensor,
    axis: int = -1,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The eager reference of :func:`dequantize` (any device): the same contract and bits."""
    axis = _check_pair(data, scales, axis, block_size)
    _check_dtype(dtype)
    n = data.shape[axis]
    scale_full = scale_to_float(scales).repeat_interleave(block_size, dim=axis).narrow(axis, 0, n)
    return (data.to(torch.float32) * scale_full).to(dtype)


def quantize_rows_and_cols_reference(
    x: torch.Tensor, block_size: int = BLOCK_SIZE
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """The eager reference of :func:`quantize_rows_and_cols`: two :func:`quantize_reference` calls."""
    _check_matrix(x, block_size)
    rows, cols = x.dim() - 1, x.dim() - 2
    return (MXFP8Tensor(*quantize_reference(x, rows, block_size), rows, block_size),
            MXFP8Tensor(*quantize_reference(x, cols, block_size), cols, block_size))


def quantize_dequantize_reference(
    x: torch.Tensor, dtype: torch.dtype, keep_mxfp8: bool = False, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, MXFP8Tensor | None]:
    """The eager reference of :func:`quantize_dequantize`: quantize, then dequantize, along -1."""
    _check_input(x, "x")
    _check_block_size(block_size)
    axis = x.dim() - 1
    data, scales = quantize_reference(x, axis, block_size)
    deq = dequantize_reference(data, scales, axis, block_size, dtype)
    return deq, (MXFP8Tensor(data, scales, axis, block_size) if keep_mxfp8 else None)


# --- public API -----------------------------------------------------------------------


def quantize(
    x: torch.Tensor, axis: int = -1, block_size: int = BLOCK_SIZE, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize ``x`` with blocks along ``axis``.

    Returns ``(data float8_e4m3fn, scales float8_e8m0fnu)``; see the module notes for
    the scale rule, special values and partial blocks, and for ``backend``.
    """
    _check_input(x, "x")
    _check_block_size(block_size)
    axis = _norm_axis(axis, x.dim(), "x")
    if resolve_backend(backend, x.device):
        from moe_mxfp8._quantize_kernels import quantize_along

        return quantize_along(x, axis, block_size)
    return quantize_reference(x, axis, block_size)


def dequantize(
    data: torch.Tensor,
    scales: torch.Tensor,
    axis: int = -1,
    block_size: int = BLOCK_SIZE,
    dtype: torch.dtype = torch.bfloat16,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``data * 2**(scale-127)`` computed exactly in FP32, then rounded once to ``dtype``."""
    axis = _check_pair(data, scales, axis, block_size)
    _check_dtype(dtype)
    if resolve_backend(backend, data.device):
        from moe_mxfp8._quantize_kernels import dequantize_along

        return dequantize_along(data, scales, axis, block_size, dtype)
    return dequantize_reference(data, scales, axis, block_size, dtype)


def quantize_rows_and_cols(
    x: torch.Tensor, block_size: int = BLOCK_SIZE, backend: Backend = "auto"
) -> tuple[MXFP8Tensor, MXFP8Tensor]:
    """Both orientations of a matrix (or a stack of them): blocks along -1 and along -2.

    The Triton path reads ``x`` once for both; weight caches need both because the
    forward GEMM reduces over the last dim and the input-gradient GEMM over dim -2.
    """
    _check_matrix(x, block_size)
    if not resolve_backend(backend, x.device):
        return quantize_rows_and_cols_reference(x, block_size)
    from moe_mxfp8._quantize_kernels import quantize_both

    (rd, rs), (cd, cs) = quantize_both(x, block_size)
    return (
        MXFP8Tensor(rd, rs, x.dim() - 1, block_size),
        MXFP8Tensor(cd, cs, x.dim() - 2, block_size),
    )


def quantize_dequantize(
    x: torch.Tensor,
    dtype: torch.dtype,
    keep_mxfp8: bool = False,
    block_size: int = BLOCK_SIZE,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, MXFP8Tensor | None]:
    """Quantize along the last dim and return the dequantized values (one pass on GPU).

    This is the GEMM operand of the emulated MXFP8 GEMM. With ``keep_mxfp8`` the
    quantized form comes back too (to be saved for backward instead of ``x``).
    """
    _check_input(x, "x")
    _check_block_size(block_size)
    if not resolve_backend(backend, x.device):
        return quantize_dequantize_reference(x, dtype, keep_mxfp8, block_size)
    from moe_mxfp8._quantize_kernels import quantize_dequantize_rows

    axis = x.dim() - 1
    deq, pair = quantize_dequantize_rows(x, dtype, keep_mxfp8, block_size)
    mx = MXFP8Tensor(pair[0], pair[1], axis, block_size) if pair is not None else None
    return deq, mx


def mxfp8_nbytes(shape: tuple[int, ...], axis: int = -1, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of data plus scales for a tensor of ``shape``."""
    return math.prod(shape) + math.prod(scales_shape(shape, axis, block_size))
