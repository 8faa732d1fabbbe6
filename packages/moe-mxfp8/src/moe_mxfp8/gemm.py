"""GEMMs on MXFP8 operands: the exact emulation everywhere, a native path on sm_100.

Shape legend: R rows, E experts, K reduction width, N output width, M rows (dense).

Emulation (every device): dequantize both operands, then multiply with FP32
accumulation. A dequantized MXFP8 value (4 significant bits times a power of two)
is exact in BF16 whenever the block's scale code is in [3, 246], i.e. for every
finite block whose largest magnitude is at least 2**-116; so with BF16 activations
the operands are dequantized to BF16 and a BF16 tensor-core GEMM (FP32 accumulate)
is bit-for-bit the "dequantize, multiply in FP32" product, up to accumulation order.
With FP32 (or FP16) activations the operands are dequantized to FP32 (exact for all
finite blocks) and the GEMM runs in FP32. ``carrier_dtype`` encodes that rule.

Native (``native_mx_available``): ``torch._scaled_mm`` with E8M0 block scales in
cuBLAS's swizzled layout, on compute capability 10.x. Opt-in, dense only, and not
yet run on such hardware here: see the package README.
"""

from __future__ import annotations

import torch

from moe_mxfp8._triton_support import reference_kernels_enabled
from moe_mxfp8.format import MXFP8Tensor


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes in: autocast's when it is on for ``x``'s device, else ``x``'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def carrier_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """Dtype the emulated GEMM dequantizes into: BF16 for BF16 compute, else FP32."""
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float32


def _fits_grouped_mm(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch._grouped_mm`` on CUDA: BF16 with 16-byte aligned row strides.

    On CPU it has no tuned kernel (about 30x slower than a per-expert loop on small
    MoE shapes), and there reading the offsets on the host costs nothing. Under
    ``use_reference_kernels`` the per-expert loop everywhere.
    """
    size = a.element_size()
    aligned = (a.shape[-1] * size) % 16 == 0 and (b.shape[-1] * size) % 16 == 0
    return a.is_cuda and a.dtype == torch.bfloat16 and aligned and not reference_kernels_enabled()


def grouped_mm(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``out[r] = x[r] @ w[e(r)]``, expert segments by cumulative int32 ``offsets_E``.

    ``torch._grouped_mm`` where it applies; otherwise one matmul per expert (reads
    the offsets on the host). Rows past ``offsets_E[-1]`` are padding (zero here,
    unspecified from ``torch._grouped_mm``).
    """
    if _fits_grouped_mm(x_RK, w_EKN):
        return torch._grouped_mm(x_RK, w_EKN, offs=offsets_E)
    out = x_RK.new_zeros(x_RK.shape[0], w_EKN.shape[-1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            out[start:end] = x_RK[start:end] @ w_EKN[e]
        start = end
    return out


def grouped_weight_grad(
    dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets_E: torch.Tensor
) -> torch.Tensor:
    """``dw[e] = dy[seg e]^T @ x[seg e]`` -> [E, N, K]; experts without rows get zeros."""
    dy_NR = dy_RN.t()
    if _fits_grouped_mm(dy_NR, x_RK) and (dy_RN.shape[0] * dy_RN.element_size()) % 16 == 0:
        return torch._grouped_mm(dy_NR, x_RK, offs=offsets_E)
    n_experts = offsets_E.shape[0]
    out = dy_RN.new_zeros(n_experts, dy_RN.shape[1], x_RK.shape[1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        if end > start:
            out[e] = dy_NR[:, start:end] @ x_RK[start:end]
        start = end
    return out


# --- native block-scaled GEMM (sm_100) ------------------------------------------------


def native_mx_available(device: torch.device) -> bool:
    """True on CUDA devices of compute capability 10.x with a torch that has E8M0 scales."""
    if device.type != "cuda" or not hasattr(torch, "float8_e8m0fnu"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def swizzle_scales(scales_MG: torch.Tensor) -> torch.Tensor:
    """E8M0 scales [M, K/32] -> cuBLAS's block-scaling layout (flattened).

    The matrix is zero-padded to 128-row x 4-column tiles, tiles are laid out
    row-major, and inside a tile element (r, c) sits at ``(r % 32) * 16 + (r // 32) * 4 + c``
    (the layout of NVIDIA's cuBLAS documentation, "1D block scaling factors layout").
    """
    rows, cols = scales_MG.shape
    tiles_r, tiles_c = -(-rows // 128), -(-cols // 4)
    padded = scales_MG.new_zeros(tiles_r * 128, tiles_c * 4)
    padded[:rows, :cols] = scales_MG
    tiles = padded.view(tiles_r, 4, 32, tiles_c, 4)  # r = 32 * r_hi + r_lo
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)  # [tile_r, tile_c, r_lo, r_hi, c]


def native_mx_mm(a: MXFP8Tensor, b: MXFP8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` on block-scaled tensor cores; both blocked along K."""
    if a.axis != 1 or b.axis != 1 or a.data.dim() != 2 or b.data.dim() != 2:
        raise ValueError("native_mx_mm takes 2-D operands blocked along their last dim (K)")
    if a.block_size != 32 or b.block_size != 32:
        raise ValueError("the native MX GEMM needs block_size 32")
    if a.data.shape[1] % 32 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(
            f"native_mx_mm needs matching K divisible by 32, got {tuple(a.data.shape)} and "
            f"{tuple(b.data.shape)}"
        )
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        swizzle_scales(a.scales.view(torch.uint8)).view(torch.float8_e8m0fnu),
        swizzle_scales(b.scales.view(torch.uint8)).view(torch.float8_e8m0fnu),
        out_dtype=out_dtype,
    )
