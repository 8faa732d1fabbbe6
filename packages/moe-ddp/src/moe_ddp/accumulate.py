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

from moe_ddp._triton_support import Backend, resolve_backend


def _kernel_layout(dst: torch.Tensor, src: torch.Tensor) -> str | None:
    """Why the kernel cannot take these tensors (``None``: it can). Runs once per parameter
    per microbatch: cheap checks only."""
    if dst.dtype != torch.float32 or src.dtype == dst.dtype:
        return f"an FP32 destination and a source of another dtype, got {src.dtype} into {dst.dtype}"
    if not src.is_contiguous():
        return "a contiguous source"
    if dst.dim() not in (1, 2) or dst.stride(-1) != 1:
        return f"a 1-D or 2-D destination with contiguous rows, got shape {tuple(dst.shape)} strides {dst.stride()}"
    return None


def accumulate_(dst: torch.Tensor, src: torch.Tensor, *, backend: Backend = "auto") -> None:
    """``dst += src`` (``src`` read as ``dst``'s shape, row-major); ``dst`` FP32.

    ``backend="auto"`` takes the Triton kernel where ``fused_kernels_enabled`` and the
    tensors suit it (mixed dtypes, contiguous rows), else :func:`accumulate_reference_`;
    ``"triton"`` the kernel (``ValueError`` for tensors it cannot take), ``"reference"``
    the reference. ``use_reference_kernels(True)`` takes the reference whatever
    ``backend`` says (``moe_ddp._triton_support.resolve_backend``).
    """
    if src.numel() != dst.numel():
        raise ValueError(f"accumulate_: {src.numel()} source elements for {dst.numel()} destination")
    fused = resolve_backend(backend, dst.device)
    if fused:
        unsuitable = _kernel_layout(dst, src)
        if unsuitable is not None and backend == "triton":
            raise ValueError(f"accumulate_(backend='triton') needs {unsuitable}")
        fused = unsuitable is None
    if not fused:
        accumulate_reference_(dst, src)
        return
    from moe_ddp._accumulate_kernels import accumulate

    accumulate(dst, src)


def accumulate_reference_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.add_(src)`` with ``src`` reshaped to ``dst``: the eager reference of :func:`accumulate_`."""
    if src.numel() != dst.numel():
        raise ValueError(f"accumulate_reference_: {src.numel()} source elements for {dst.numel()} destination")
    dst.add_(src.reshape(dst.shape))
