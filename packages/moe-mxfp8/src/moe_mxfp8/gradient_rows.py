"""A rowwise FP8 layer's output gradient, quantized by the kernel that computes it.

An FP8 layer of a rowwise recipe (one scale per row of ``dy``: ``FP8Linear``,
``FP8GroupedExperts``) quantizes its output gradient before its input-gradient GEMM: one
more read of ``dy`` and a write of its codes. Where another package's kernel computes
that gradient, it can write the codes in the same pass: moe_model's fused cross-entropy
for an LM head's logits, moe_model's local dispatcher's combine backward for the routed
experts' output rows (``moe_model.gradient_rows``, whose protocol ``OutputGradientRows``
meets). The layer sets an ``OutputGradientRows`` as ``GRADIENT_ROW_ENCODER`` on its
output; its backward takes the codes where they arrived for exactly the gradient it got,
and quantizes ``dy`` itself otherwise. The codes are the ones ``quantize_fp8`` gives for
that ``dy``, bit for bit (tests check it with adversarial rows), so the attribute never
changes a result.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_mxfp8.fp8 import FP8Tensor

# The attribute of a layer output that a consumer computing its gradient may serve: the
# name moe_model's kernels read (``moe_model.gradient_rows.GRADIENT_ROW_ENCODER``).
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
