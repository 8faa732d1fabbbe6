"""A layer output's gradient, encoded rowwise by the kernel that computes it.

A layer of a rowwise FP8 recipe (one scale per row of ``dy``: ``FP8Linear``,
``FP8GroupedExperts``) quantizes its output gradient for its input-gradient GEMM. Where
that gradient is computed by a kernel that writes every row whole (moe_model's fused
cross-entropy for an LM head's logits, its fused combine for the expert output rows),
that kernel can write the codes in the same pass, saving the quantisation's read of
``dy``. The layer sets an ``OutputGradientRows`` as ``GRADIENT_ROW_ENCODER`` on its
output; the consumer hands it the gradient with its codes and scales; the layer's
backward uses them only for that very gradient, unchanged (``take``), and quantizes as
always otherwise. The codes are ``quantize_fp8``'s, bit for bit (tests check it).
This package does not import moe_model: both name the attribute, and a workspace test
asserts that the two names agree.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_mxfp8.fp8 import FP8Tensor

# The attribute of a layer output that a consumer computing its gradient may serve: the
# name moe_model's fused cross-entropy and combine read (``moe_model.loss.GRADIENT_ROW_ENCODER``).
GRADIENT_ROW_ENCODER = "gradient_row_encoder"


class OutputGradientRows:
    """Receives a layer's output gradient with its rowwise E4M3 codes and scales from the
    kernel that computes that gradient (module notes), for one backward.

    ``row_scale`` / ``row_encode`` are the Triton device functions that kernel calls
    (``_fp8_kernels``: the scale of a row from its amax, power-of-two where ``pow2``, and
    the E4M3 encoding), loaded when read, so that building this object needs no Triton.
    The encoding is ``quantize_blocks``' bit-level one, checked bit for bit on the GPU,
    not the GPU's conversion instruction, which was only 3% faster inside moe_model's
    cross-entropy backward and whose bytes on adversarial rows were never compared.
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

    def receive(self, grad: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Hold ``grad [R, N]`` with its codes ``[R, N]`` (uint8) and scales ``[R, 1]``;
        holding ``grad`` also keeps autograd from adding another gradient into it in place.
        Its version counter is recorded: a change in place after this (a gradient hook that
        edits its argument) makes the codes stale, and ``take`` refuses them."""
        self._received = (grad, codes, scales, grad._version)

    def take(self, dy_MN: torch.Tensor) -> FP8Tensor | None:
        """The rowwise FP8 ``dy_MN`` received, if ``dy_MN`` is the received gradient itself
        (same memory, dtype and size, contiguous) and unchanged since (its version counter);
        else ``None``. Forgets it either way."""
        received, self._received = self._received, None
        if received is None:
            return None
        grad, codes, scales, version = received
        if (dy_MN.data_ptr() != grad.data_ptr() or dy_MN.dtype != grad.dtype
                or dy_MN.numel() != grad.numel() or not dy_MN.is_contiguous()
                or dy_MN._version != version):
            return None
        M = dy_MN.shape[0]
        return FP8Tensor(codes.view(torch.float8_e4m3fn).view(dy_MN.shape), scales.view(M, 1), (1, 0))
