"""``main_grad += grad`` across dtypes (BF16 gradient into an FP32 bucket view) at copy speed.

Every microbatch's backward adds each parameter's BF16 gradient into its FP32 main
grad: 10 bytes per parameter per microbatch, the largest memory-bound cost of a
step with many microbatches. PyTorch's ``add_`` with mixed dtypes takes its
non-vectorised (dynamic-cast) elementwise path, measured at ~2.75 TB/s on an H200;
this Triton kernel does the same sum with wide vector loads. The result is bit for
bit the same (one FP32 rounding of ``main + float(grad)``), so the CPU path, which
keeps ``add_``, is an exact reference.

The destination may be a strided ``[rows, cols]`` view with contiguous rows (a
reduce-scatter bucket's owner-major layout); the source is any tensor of
``rows * cols`` elements, read in row-major order. The kernel lives in
``_accumulate_kernels``, imported only when it runs.
"""

from __future__ import annotations

import torch

from moe_ddp._triton_support import fused_kernels_enabled, reference_kernels_enabled


def _fused_applies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Runs once per parameter per microbatch: cheap checks only (the spec lookup is cached)."""
    return (dst.dtype == torch.float32 and src.dtype != dst.dtype
            and src.is_contiguous() and dst.dim() in (1, 2) and dst.stride(-1) == 1
            and fused_kernels_enabled(dst.device))


def accumulate_(dst: torch.Tensor, src: torch.Tensor, *, fused: bool | None = None) -> None:
    """``dst += src`` (``src`` read as ``dst``'s shape, row-major); ``dst`` FP32.

    ``fused=None`` picks the Triton kernel where it applies (CUDA, mixed dtypes,
    contiguous rows); ``True``/``False`` force a path (tests). ``use_reference_kernels``
    takes ``add_`` whatever ``fused`` says.
    """
    if src.numel() != dst.numel():
        raise ValueError(f"accumulate_: {src.numel()} source elements for {dst.numel()} destination")
    if fused is None:
        fused = _fused_applies(dst, src)
    if not fused or reference_kernels_enabled():
        dst.add_(src.reshape(dst.shape))
        return
    from moe_ddp._accumulate_kernels import accumulate

    accumulate(dst, src)
