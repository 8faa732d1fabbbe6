"""Tensors encoded per row by the kernel that writes them, for a low-precision consumer.

moe_mxfp8's FP8 layers of a rowwise recipe quantize a GEMM operand per row (one scale per
row): their input before the forward GEMM, their output gradient ``dy`` before the
input-gradient GEMM. Each quantisation is one more read of the tensor. Where a kernel of
this package writes that tensor anyway, it can write the codes in the same pass, having
the values in registers:

- the fused cross-entropy's backward, the logits' gradient (``moe_model.loss``), and the
  local dispatcher's combine backward, the routed experts' output gradient
  (``moe_model.dispatch``): for a layer output that carries a ``GRADIENT_ROW_ENCODER``
  attribute;
- the local dispatcher's gather, the routed experts' input rows: for an experts module
  that carries an ``INPUT_ROW_ENCODER`` attribute (``moe_model.moe.MoELayer`` hands it to
  a dispatcher that ``EncodesRows``).

The kernel hands the tensor with its codes to the ``RowEncoder``'s ``receive``; the layer
uses them only for exactly that tensor. Anywhere else (CPU reference paths, a tensor
computed from the output, layouts or dispatchers that do not encode) nothing is received
and the layer encodes the tensor itself, so the attributes never change a result.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

# The attribute of a layer output that holds the ``RowEncoder`` of its gradient.
GRADIENT_ROW_ENCODER = "gradient_row_encoder"
# The attribute of an experts module that holds the ``RowEncoder`` of its input rows.
INPUT_ROW_ENCODER = "input_row_encoder"


class RowEncoder(Protocol):
    """A per-row encoding of a tensor ``[N, C]`` that the kernel writing it writes beside it.

    ``row_scale`` and ``row_encode`` are Triton device functions the kernel calls:
    ``row_scale(amax)`` maps a row's largest magnitude (FP32, NaN where the row holds a NaN)
    to its FP32 scale; ``row_encode(values, scale)`` maps FP32 values (the tensor as
    stored, in its dtype) to uint8 codes. ``receive(tensor, codes, scales)`` gets the tensor
    ``[N, C]``, its codes ``[N, C]`` (uint8) and scales ``[N, 1]`` (FP32) when the kernel
    has written them.
    """

    row_scale: Any
    row_encode: Any

    def receive(self, tensor: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None: ...
