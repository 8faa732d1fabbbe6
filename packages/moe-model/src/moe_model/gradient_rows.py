"""A layer output's gradient, encoded per row by the kernel that computes it.

A low-precision layer (moe_mxfp8's FP8 layers of a rowwise recipe) quantizes its output
gradient ``dy`` per row before its input-gradient GEMM: one more read of ``dy`` and a
write of its codes. Where this package's own kernel computes that gradient, it can write
the codes in the same pass, having the values in registers: the fused cross-entropy for
the logits (``moe_model.loss``), the local dispatcher's combine backward for the routed
experts' output rows (``moe_model.dispatch``).

The layer sets ``GRADIENT_ROW_ENCODER`` on its output tensor to a ``GradientRowEncoder``.
Where one of those kernels runs on exactly that tensor, it writes the codes and hands them
to the encoder with the gradient; anywhere else (CPU reference paths, a tensor computed
from the output, layouts the kernel does not encode) nothing is received and the layer
encodes the gradient itself, so the attribute never changes a result.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

# The attribute of a layer output that holds its producer's ``GradientRowEncoder``.
GRADIENT_ROW_ENCODER = "gradient_row_encoder"


class GradientRowEncoder(Protocol):
    """A per-row encoding of a gradient ``[N, C]`` that its kernel writes beside it.

    ``row_scale`` and ``row_encode`` are Triton device functions the kernel calls:
    ``row_scale(amax)`` maps a row's largest gradient magnitude (FP32, NaN where the row
    holds a NaN) to its FP32 scale; ``row_encode(values, scale)`` maps FP32 values (the
    gradient as stored, in its dtype) to uint8 codes. ``receive(grad, codes, scales)``
    gets the gradient ``[N, C]``, its codes ``[N, C]`` (uint8) and scales ``[N, 1]``
    (FP32) when the kernel has written them.
    """

    row_scale: Any
    row_encode: Any

    def receive(self, grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None: ...
