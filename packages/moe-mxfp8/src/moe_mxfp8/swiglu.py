"""SwiGLU between the experts' GEMMs: ``h = silu(h1) * h3`` of ``h13 = [h1, h3]`` and its
gradient, computed in FP32 and rounded once to the output dtype.

On CUDA (with Triton) one fused kernel each way (``moe_mxfp8._triton_swiglu``): the
unfused torch ops made several passes over ``[R, 2F]`` FP32 temporaries, a few
milliseconds per layer at the bench shapes, comparable to the FP8 GEMMs themselves.
Elsewhere the same formulas in torch. The two agree to FP32 rounding of ``exp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_mxfp8.format import uses_triton


def swiglu(h13_R2F: torch.Tensor) -> torch.Tensor:
    """``silu(h1) * h3`` in FP32, returned in ``h13``'s dtype."""
    if uses_triton(h13_R2F, "auto"):
        from moe_mxfp8._triton_swiglu import swiglu_forward

        return swiglu_forward(h13_R2F)
    h1, h3 = h13_R2F.float().chunk(2, dim=-1)
    return (F.silu(h1) * h3).to(h13_R2F.dtype)


def swiglu_backward(h13_R2F: torch.Tensor, dh_RF: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gradients of ``silu(h1) * h3`` w.r.t. ``[h1, h3]``, computed in FP32, in ``dtype``."""
    if uses_triton(h13_R2F, "auto"):
        from moe_mxfp8._triton_swiglu import swiglu_backward as fused

        return fused(h13_R2F, dh_RF, dtype)
    h1, h3 = h13_R2F.float().chunk(2, dim=-1)
    dh = dh_RF.float()
    sig = torch.sigmoid(h1)
    dh1 = dh * h3 * sig * (1 + h1 * (1 - sig))
    dh3 = dh * h1 * sig
    return torch.cat([dh1, dh3], dim=-1).to(dtype)
