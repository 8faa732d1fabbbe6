"""Low-precision payloads for expert-parallel dispatch: rows travel as E4M3 bytes plus scales.

``MXFP8RowCodec``: E8M0 scales per 32 elements.

Packed row layout (``uint8[W]``, ``W = D + ceil(D / 32)``): the D data bytes, then
the ``ceil(D / 32)`` scale bytes. No padding: ``W`` is strictly increasing in ``D``,
so ``decode`` recovers ``D`` from ``W`` alone (``D = W - ceil(W / 33)``), as the
transport's ``RowCodec`` protocol (``packed_width``, ``encode``, ``decode``) needs.
For D = 2048: 2112 bytes a row, 51.6% of BF16's 4096.

Values: the same quantization as ``moe_mxfp8.quantize`` along the row, so a decoded
row equals ``dequantize(quantize(row))`` exactly. Not differentiable (a transport
passes gradients straight through).

``FP8RowCodec``: the ``fp8_rowwise`` recipe's rows (E4M3 data, one power-of-two FP32
scale per row): ``W = D + 4`` bytes, the data then the scale's bytes (little-endian; 2052
for D = 2048: 50.1% of BF16); the ops ``encode_fp8_rows`` / ``decode_fp8_rows`` run one
Triton kernel each (``moe_mxfp8._fp8_codec_kernels``) beside their ``_reference``. Decoded rows are exact in BF16, and re-quantizing them gives the
sender's FP8 values again (the row's largest code is in [224, 448], so the power-of-two
scale comes back unchanged or doubled, with the codes doubled: both exact), so the
receiving FP8 experts compute on what was sent.

Each codec's ``exact_recipes`` names the ``MXFP8Config.recipe`` values whose activation
quantization maps its decoded rows to themselves: experts of those recipes compute on
the sent values. Any other recipe rounds them a second time: MXFP8's floor rule
saturates a 32-block whose largest rowwise code has mantissa 1.875 (e.g. 240 -> 480 >
448), the rowwise recipes push an MXFP8 row's small blocks into subnormals, and
``fp8_blockwise``'s non-power-of-two tile scales round both.
"""

from __future__ import annotations

import torch

from moe_mxfp8._triton_support import Backend, resolve_backend
from moe_mxfp8.format import BLOCK_SIZE, dequantize_reference, n_blocks, quantize_reference
from moe_mxfp8.fp8 import FP8Tensor, dequantize_fp8, quantize_fp8_reference


class MXFP8RowCodec:
    """Encodes ``[R, D]`` rows into ``uint8[R, D + ceil(D/32)]`` and back."""

    block_size = BLOCK_SIZE
    exact_recipes = ("mxfp8",)

    def __init__(self, backend: Backend = "auto") -> None:
        self.backend = backend

    def packed_width(self, d: int) -> int:
        """Bytes per encoded row of width ``d`` (data, then scales)."""
        if d <= 0:
            raise ValueError(f"row width must be positive, got {d}")
        return d + n_blocks(d, self.block_size)

    def row_width(self, packed_width: int) -> int:
        """Inverse of ``packed_width``; raises for a width no row produces."""
        d = packed_width - n_blocks(packed_width, self.block_size + 1)
        if d <= 0 or self.packed_width(d) != packed_width:
            raise ValueError(f"{packed_width} bytes is not the packed width of any row")
        return d

    def bytes_ratio(self, d: int, dtype: torch.dtype = torch.bfloat16) -> float:
        """Encoded bytes per row relative to the row in ``dtype``."""
        return self.packed_width(d) / (d * dtype.itemsize)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2:
            raise ValueError(f"rows must be [R, D], got {tuple(rows.shape)}")
        R, D = rows.shape
        packed = torch.empty(R, self.packed_width(D), dtype=torch.uint8, device=rows.device)
        if resolve_backend(self.backend, rows.device):
            from moe_mxfp8._quantize_kernels import quantize_rows_into

            quantize_rows_into(rows, packed[:, :D], packed[:, D:], self.block_size)
        else:
            data, scales = quantize_reference(rows, -1, self.block_size)
            packed[:, :D] = data.view(torch.uint8)
            packed[:, D:] = scales.view(torch.uint8)
        return packed

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if packed.dim() != 2 or packed.dtype != torch.uint8:
            raise ValueError(f"packed must be uint8 [R, W], got {packed.dtype} {tuple(packed.shape)}")
        D = self.row_width(packed.shape[1])
        if resolve_backend(self.backend, packed.device):
            from moe_mxfp8._quantize_kernels import dequantize_rows_from

            return dequantize_rows_from(packed[:, :D], packed[:, D:], dtype, self.block_size)
        data = packed[:, :D].contiguous().view(torch.float8_e4m3fn)
        scales = packed[:, D:].contiguous().view(torch.float8_e8m0fnu)
        return dequantize_reference(data, scales, -1, self.block_size, dtype)


_ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FP8_SCALE_BYTES = 4


def _check_fp8_rows(rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.dtype not in _ROW_DTYPES:
        raise ValueError(f"rows must be float32, bfloat16 or float16 [R, D], got "
                         f"{getattr(rows, 'dtype', type(rows).__name__)} {tuple(getattr(rows, 'shape', ()))}")
    if rows.shape[1] == 0:
        raise ValueError("rows must have a positive width D, got 0")


def _check_fp8_packed(packed: torch.Tensor, dtype: torch.dtype) -> int:
    """``D`` of valid packed FP8 rows; raises naming ``packed`` or ``dtype``."""
    if not isinstance(packed, torch.Tensor) or packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [R, W], got {getattr(packed, 'dtype', type(packed).__name__)} "
                         f"{tuple(getattr(packed, 'shape', ()))}")
    if packed.shape[1] <= _FP8_SCALE_BYTES:
        raise ValueError(f"packed: {packed.shape[1]} bytes is not the packed width of any row")
    if dtype not in _ROW_DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    return packed.shape[1] - _FP8_SCALE_BYTES


def encode_fp8_rows_reference(rows: torch.Tensor) -> torch.Tensor:
    """The eager reference of :func:`encode_fp8_rows` (any device): the same bytes."""
    _check_fp8_rows(rows)
    R, D = rows.shape
    q = quantize_fp8_reference(rows, (1, 0), pow2=True)
    packed = torch.empty(R, D + _FP8_SCALE_BYTES, dtype=torch.uint8, device=rows.device)
    packed[:, :D] = q.data.view(torch.uint8)
    packed[:, D:] = q.scale.view(torch.uint8)
    return packed


def encode_fp8_rows(rows: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """``rows [R, D]`` -> uint8 ``[R, D + 4]``: each row's E4M3 codes, then its FP32 scale's
    bytes, as ``quantize_fp8(rows, (1, 0), pow2=True)`` quantizes them (torchao's float8
    rowwise). ``backend``: ``"auto"`` (one Triton kernel where ``fused_kernels_enabled``),
    ``"triton"`` or ``"reference"`` (:func:`encode_fp8_rows_reference`)."""
    _check_fp8_rows(rows)
    if not resolve_backend(backend, rows.device):
        return encode_fp8_rows_reference(rows)
    from moe_mxfp8._fp8_codec_kernels import encode_rows_into

    R, D = rows.shape
    packed = torch.empty(R, D + _FP8_SCALE_BYTES, dtype=torch.uint8, device=rows.device)
    encode_rows_into(rows, packed)
    return packed


def decode_fp8_rows_reference(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The eager reference of :func:`decode_fp8_rows` (any device): the same bits."""
    D = _check_fp8_packed(packed, dtype)
    data = packed[:, :D].contiguous().view(torch.float8_e4m3fn)
    scale = packed[:, D:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    return dequantize_fp8(FP8Tensor(data, scale, (1, 0)), dtype)


def decode_fp8_rows(packed: torch.Tensor, dtype: torch.dtype, backend: Backend = "auto") -> torch.Tensor:
    """uint8 ``packed [R, D + 4]`` (as :func:`encode_fp8_rows` writes; any bytes are
    decoded) -> ``[R, D]`` of ``dtype`` (FP32, BF16 or FP16): ``fp32(code) * (1 / scale)``
    with the FP32 reciprocal, rounded once to ``dtype`` (``dequantize_fp8``). ``backend``
    as :func:`encode_fp8_rows`'s (the kernel reads each row once and writes it once)."""
    _check_fp8_packed(packed, dtype)
    if not resolve_backend(backend, packed.device):
        return decode_fp8_rows_reference(packed, dtype)
    from moe_mxfp8._fp8_codec_kernels import decode_rows

    return decode_rows(packed, dtype)


class FP8RowCodec:
    """Encodes ``[R, D]`` rows into ``uint8[R, D + 4]`` (E4M3 data, FP32 row scale) and back
    (:func:`encode_fp8_rows`, :func:`decode_fp8_rows`, one kernel each on CUDA)."""

    scale_bytes = _FP8_SCALE_BYTES
    exact_recipes = ("fp8_rowwise", "fp8_rowwise_gw_hp")

    def __init__(self, backend: Backend = "auto") -> None:
        self.backend = backend

    def packed_width(self, d: int) -> int:
        """Bytes per encoded row of width ``d`` (data, then the scale)."""
        if d <= 0:
            raise ValueError(f"row width must be positive, got {d}")
        return d + self.scale_bytes

    def row_width(self, packed_width: int) -> int:
        """Inverse of ``packed_width``; raises for a width no row produces."""
        if packed_width <= self.scale_bytes:
            raise ValueError(f"{packed_width} bytes is not the packed width of any row")
        return packed_width - self.scale_bytes

    def bytes_ratio(self, d: int, dtype: torch.dtype = torch.bfloat16) -> float:
        """Encoded bytes per row relative to the row in ``dtype``."""
        return self.packed_width(d) / (d * dtype.itemsize)

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return encode_fp8_rows(rows, self.backend)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return decode_fp8_rows(packed, dtype, self.backend)
