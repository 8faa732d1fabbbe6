"""Rowwise FP8 codes of a layer's GEMM operand, written by the kernel that makes the operand.

An FP8 layer of a rowwise recipe (one scale per row) quantizes its input before the
forward GEMM and its output gradient ``dy`` before the input-gradient GEMM: each one more
read of the tensor and a write of its codes. Where another package's kernel writes that
tensor anyway, it can write the codes in the same pass (``moe_model.row_encoding``, whose
``RowEncoder`` protocol ``RowCodes`` meets):

- ``dy``: a layer sets a ``RowCodes`` as ``GRADIENT_ROW_ENCODER`` on its output
  (``FP8Linear``, ``FP8GroupedExperts``): moe_model's fused cross-entropy serves an LM
  head's logits, moe_model's local dispatcher's combine backward the routed experts'
  output rows;
- the input: ``FP8GroupedExperts`` holds a ``RowCodes`` as ``INPUT_ROW_ENCODER``:
  moe_model's local dispatcher's gather serves it with the rows it dispatches.

The layer takes the codes where they arrived for exactly the tensor it got, and quantizes
the tensor itself otherwise. They are the ones ``quantize_fp8`` gives for that tensor, bit
for bit (tests check it with adversarial rows), so the attributes never change a result.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_mxfp8.fp8 import FP8Tensor

# The attribute of a layer output that a consumer computing its gradient may serve, and of
# an experts module whose input rows a dispatcher may serve: the names moe_model's kernels
# read (``moe_model.row_encoding``).
GRADIENT_ROW_ENCODER = "gradient_row_encoder"
INPUT_ROW_ENCODER = "input_row_encoder"


class RowCodes:
    """Receives a tensor with its rowwise E4M3 codes and scales from the kernel that writes
    it (module notes), for the one use that follows: a backward (``dy``) or a forward
    (the input).

    ``row_scale`` / ``row_encode`` are the Triton device functions that kernel calls
    (``_fp8_kernels``: the scale of a row from its amax, power-of-two where ``pow2``, and
    the E4M3 encoding), loaded when read, so that building this object needs no Triton.
    The encoding is ``quantize_blocks``' bit-level one, checked bit for bit on the GPU,
    not the GPU's conversion instruction: only 3% faster inside moe_model's
    cross-entropy backward, and compiled into other kernels it wrote wrong bytes in some
    layouts (``_fp8_kernels``' notes).
    """

    def __init__(self, pow2: bool) -> None:
        self.pow2 = pow2
        self._received: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    @property
    def row_scale(self) -> Any:
        from moe_mxfp8._fp8_kernels import row_scale_fp32, row_scale_pow2

        return row_scale_pow2 if self.pow2 else row_scale_fp32

    @property
    def row_encode(self) -> Any:
        from moe_mxfp8._fp8_kernels import encode_e4m3

        return encode_e4m3

    def receive(self, tensor: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold ``tensor [R, N]`` with its codes ``[R, N]`` (uint8) and scales ``[R, 1]``;
        holding a gradient also keeps autograd from adding another gradient into it in
        place. Its version counter is recorded: a change in place after this (a gradient
        hook that edits its argument) makes the codes stale, and ``take`` refuses them."""
        self._received = (tensor, codes, scales, tensor._version)

    def take(self, t_MN: torch.Tensor) -> FP8Tensor | None:
        """The rowwise FP8 ``t_MN`` received, if ``t_MN`` is the received tensor itself (same
        memory, dtype and size, contiguous) and unchanged since (its version counter); else
        ``None``. Forgets it either way."""
        received, self._received = self._received, None
        if received is None:
            return None
        tensor, codes, scales, version = received
        if (t_MN.data_ptr() != tensor.data_ptr() or t_MN.dtype != tensor.dtype
                or t_MN.numel() != tensor.numel() or not t_MN.is_contiguous()
                or t_MN._version != version):
            return None
        M = t_MN.shape[0]
        return FP8Tensor(codes.view(torch.float8_e4m3fn).view(t_MN.shape), scales.view(M, 1), (1, 0))
