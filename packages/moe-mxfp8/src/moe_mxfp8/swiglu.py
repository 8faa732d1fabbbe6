"""SwiGLU between the experts' GEMMs: ``h = silu(h1) * h3`` of ``h13 = [h1, h3]`` and its
gradient, computed in FP32 and rounded once to the output dtype.

On CUDA (with Triton) one fused kernel each way (``moe_mxfp8._swiglu_kernels``): the
unfused torch ops made several passes over ``[R, 2F]`` FP32 temporaries, a few
milliseconds per layer at the bench shapes, comparable to the FP8 GEMMs themselves.
Elsewhere the same formulas in torch (``<op>_reference``). The two agree to FP32
rounding of ``exp``. ``backend`` as everywhere in the package: ``"auto"`` (the kernels
where ``fused_kernels_enabled``), ``"triton"``, ``"reference"``; the reference switch
takes the reference whatever it says.

``swiglu_quantized`` / ``swiglu_backward_quantized``: the result also quantized to E4M3
(``quantize_fp8``); for rowwise blocks on CUDA in the same kernel (whole rows per
program), equal bit for bit to quantizing the unfused kernels' output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_mxfp8._triton_support import Backend, resolve_backend
from moe_mxfp8.fp8 import FP8Tensor, quantize_fp8, quantize_fp8_reference


def swiglu(h13_R2F: torch.Tensor, backend: Backend = "auto") -> torch.Tensor:
    """``silu(h1) * h3`` in FP32, returned in ``h13``'s dtype."""
    if resolve_backend(backend, h13_R2F.device):
        from moe_mxfp8._swiglu_kernels import swiglu_forward

        return swiglu_forward(h13_R2F)
    return swiglu_reference(h13_R2F)


def swiglu_reference(h13_R2F: torch.Tensor) -> torch.Tensor:
    """The eager reference of :func:`swiglu`."""
    h1, h3 = h13_R2F.float().chunk(2, dim=-1)
    return (F.silu(h1) * h3).to(h13_R2F.dtype)


def _check_h_out(h_out: torch.Tensor | None, h13_R2F: torch.Tensor) -> None:
    if h_out is None:
        return
    want = (h13_R2F.shape[0], h13_R2F.shape[1] // 2)
    if (tuple(h_out.shape) != want or h_out.dtype != h13_R2F.dtype or h_out.device != h13_R2F.device
            or (h_out.numel() and h_out.stride(-1) != 1)):
        raise ValueError(f"h_out must be {h13_R2F.dtype} {list(want)} on {h13_R2F.device} with unit "
                         f"column stride, got {h_out.dtype} {list(h_out.shape)} on {h_out.device}")


def swiglu_backward(h13_R2F: torch.Tensor, dh_RF: torch.Tensor, dtype: torch.dtype,
                    backend: Backend = "auto", h_out: torch.Tensor | None = None) -> torch.Tensor:
    """Gradients of ``silu(h1) * h3`` w.r.t. ``[h1, h3]``, computed in FP32, in ``dtype``.

    ``h_out``: an ``[R, F]`` tensor in ``h13``'s dtype that also receives ``swiglu(h13)``,
    bit for bit (on CUDA from the same kernel, which holds ``h1`` and ``h3`` already: what
    the down projection's weight gradient reads, without a second pass over ``h13``)."""
    _check_h_out(h_out, h13_R2F)
    if resolve_backend(backend, h13_R2F.device):
        from moe_mxfp8._swiglu_kernels import swiglu_backward as fused

        return fused(h13_R2F, dh_RF, dtype, h_out)
    return swiglu_backward_reference(h13_R2F, dh_RF, dtype, h_out)


def swiglu_backward_reference(h13_R2F: torch.Tensor, dh_RF: torch.Tensor, dtype: torch.dtype,
                              h_out: torch.Tensor | None = None) -> torch.Tensor:
    """The eager reference of :func:`swiglu_backward`."""
    _check_h_out(h_out, h13_R2F)
    if h_out is not None:
        h_out.copy_(swiglu_reference(h13_R2F))
    h1, h3 = h13_R2F.float().chunk(2, dim=-1)
    dh = dh_RF.float()
    sig = torch.sigmoid(h1)
    dh1 = dh * h3 * sig * (1 + h1 * (1 - sig))
    dh3 = dh * h1 * sig
    return torch.cat([dh1, dh3], dim=-1).to(dtype)


def _rows_kernel_applies(h13: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the quantizing kernels take this call (else the unfused kernels, then ``quantize_fp8``)."""
    return tuple(block) == (1, 0) and dtype == h13.dtype and dtype in (torch.bfloat16, torch.float32)


def swiglu_quantized(h13_R2F: torch.Tensor, block: tuple[int, int], pow2: bool,
                     backend: Backend = "auto") -> FP8Tensor:
    """``quantize_fp8(swiglu(h13), block, pow2)``."""
    if not resolve_backend(backend, h13_R2F.device):
        return swiglu_quantized_reference(h13_R2F, block, pow2)
    if _rows_kernel_applies(h13_R2F, block, h13_R2F.dtype):
        from moe_mxfp8._swiglu_kernels import swiglu_quantize_rows

        return FP8Tensor(*swiglu_quantize_rows(h13_R2F, pow2), (1, 0))
    return quantize_fp8(swiglu(h13_R2F, backend), block, pow2, backend)


def swiglu_quantized_reference(h13_R2F: torch.Tensor, block: tuple[int, int], pow2: bool) -> FP8Tensor:
    """The eager reference of :func:`swiglu_quantized`."""
    return quantize_fp8_reference(swiglu_reference(h13_R2F), block, pow2)


def swiglu_backward_quantized(h13_R2F: torch.Tensor, dh_RF: torch.Tensor, dtype: torch.dtype,
                              block: tuple[int, int], pow2: bool, backend: Backend = "auto",
                              h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, FP8Tensor]:
    """``dh13 = swiglu_backward(h13, dh, dtype)`` and ``quantize_fp8(dh13, block, pow2)``;
    ``h_out`` as :func:`swiglu_backward`'s."""
    _check_h_out(h_out, h13_R2F)
    if not resolve_backend(backend, h13_R2F.device):
        return swiglu_backward_quantized_reference(h13_R2F, dh_RF, dtype, block, pow2, h_out)
    if _rows_kernel_applies(h13_R2F, block, dtype):
        from moe_mxfp8._swiglu_kernels import swiglu_backward_quantize_rows

        dh13, data, scale = swiglu_backward_quantize_rows(h13_R2F, dh_RF, pow2, h_out)
        return dh13, FP8Tensor(data, scale, (1, 0))
    dh13 = swiglu_backward(h13_R2F, dh_RF, dtype, backend, h_out)
    return dh13, quantize_fp8(dh13, block, pow2, backend)


def swiglu_backward_quantized_reference(h13_R2F: torch.Tensor, dh_RF: torch.Tensor, dtype: torch.dtype,
                                        block: tuple[int, int], pow2: bool,
                                        h_out: torch.Tensor | None = None) -> tuple[torch.Tensor, FP8Tensor]:
    """The eager reference of :func:`swiglu_backward_quantized`."""
    dh13 = swiglu_backward_reference(h13_R2F, dh_RF, dtype, h_out)
    return dh13, quantize_fp8_reference(dh13, block, pow2)
