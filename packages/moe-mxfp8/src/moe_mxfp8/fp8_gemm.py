"""Grouped GEMMs on scaled E4M3 operands: native on Hopper, an exact emulation elsewhere.

Shape legend: R rows (expert-major), E experts, K reduction width, N output width,
W the padded token width of a weight-gradient operand.

Native (``fp8_native_available``): ``torch._scaled_grouped_mm`` (CUTLASS, sm_90) with
rowwise FP32 scales and BF16 output; offsets are read on the device. Accumulation is
chosen per call (``fast_accum``): ``False`` promotes the partial sums to FP32 registers
as DeepSeek-V3 prescribes; ``True`` (``use_fast_accum``) keeps them in the tensor cores'
own accumulator (about 14 significant bits, truncating), 1.15-1.3x the GEMM rate on an
H200 (``tools/bench_fp8_experts.py``). Which GEMM of a layer takes which:
``FAST_ACCUM_DEFAULT``.

- ``fp8_grouped_mm``: ``out[r] = a[r] @ b[e(r)]^T`` with ``a [R, K]`` scaled per row and
  ``b [E, N, K]`` per row of each expert (the "2d x 3d" form: no alignment of the groups
  is needed, K and N must be multiples of 16).
- ``fp8_grouped_wgrad``: ``dw[e] = dy[seg e]^T @ x[seg e]`` with both operands scaled per
  expert and column (``quantize_group_columns``), transposed with 16-aligned group
  starts (the "2d x 2d" form reduces over tokens and reads each group at an aligned
  address).

Emulation (any device; the reference the native path is checked against): dequantize
both operands to FP32 (``data / scale`` is exact for power-of-two scales and rounded
once otherwise, as the GEMM's own scaling) and multiply in FP32, one matmul per expert
(reads the offsets on the host). It computes in FP32 whatever ``fast_accum`` says (as
torchao's emulation ignores ``use_fast_accum``), so it equals the native GEMM up to
accumulation order with ``fast_accum=False``, and only within the fast accumulator's
error with ``True``. Rows past ``offsets[-1]`` are zero here and unspecified from the
native GEMM.
"""

from __future__ import annotations

import torch

from moe_mxfp8.fp8 import FP8Tensor, quantize_group_columns

FP8_GEMM_ROLES = ("output", "grad_input", "grad_weight")
# torchao's float8 rowwise recipes (``torchao.float8.config.Float8LinearConfig``, whose
# ``from_recipe_name("rowwise")`` and ``("rowwise_with_gw_hp")`` keep its defaults):
# ``gemm_config_output = Float8GemmConfig(use_fast_accum=True)``, ``gemm_config_grad_input``
# and ``gemm_config_grad_weight`` with ``use_fast_accum=False``. (torchao's grouped MoE
# function, ``torchao.prototype.moe_training.fp8_grouped_mm._Float8GroupedMM``, passes
# ``use_fast_accum=True`` to all three; ``fast_accum=FP8_GEMM_ROLES`` is that choice.)
FAST_ACCUM_DEFAULT = ("output",)


def fp8_native_available(device: torch.device) -> bool:
    """True on CUDA devices of compute capability 9.x with ``torch._scaled_grouped_mm``."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def check_native_widths(*widths: int) -> None:
    bad = [w for w in widths if w % 16]
    if bad:
        raise ValueError(f"native FP8 grouped GEMMs need widths divisible by 16, got {list(widths)}")


def fp8_grouped_mm(a: FP8Tensor, b: FP8Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                   native: bool, fast_accum: bool) -> torch.Tensor:
    """``a [R, K] @ b[e]^T`` per expert segment; ``b`` is ``[E, N, K]``, both scaled along K."""
    if native:
        return torch._scaled_grouped_mm(
            a.data, b.data.transpose(-2, -1), a.scale.reciprocal().view(-1),
            b.scale.reciprocal().squeeze(-1), offs=offsets, out_dtype=out_dtype,
            use_fast_accum=fast_accum)
    a_f, b_f = a.dequantize(), b.dequantize()
    out = a_f.new_zeros(a_f.shape[0], b_f.shape[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = a_f[start:end] @ b_f[e].t()
        start = end
    return out.to(out_dtype)


def fp8_grouped_wgrad(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets: torch.Tensor,
                      pow2: bool, out_dtype: torch.dtype, native: bool, fast_accum: bool
                      ) -> torch.Tensor:
    """``[E, N, K]`` weight gradients from E4M3 operands scaled per expert and column."""
    dy_t, dy_scale, padded_ends = quantize_group_columns(dy_RN, offsets, pow2)
    x_t, x_scale, _ = quantize_group_columns(x_RK, offsets, pow2)
    if native:
        return torch._scaled_grouped_mm(
            dy_t, x_t.t(), dy_scale.reciprocal().view(-1), x_scale.reciprocal().view(-1),
            offs=padded_ends, out_dtype=out_dtype, use_fast_accum=fast_accum)
    dy_f, x_f = dy_t.float(), x_t.float()
    dy_inv, x_inv = dy_scale.reciprocal(), x_scale.reciprocal()
    out = dy_f.new_zeros(offsets.shape[0], dy_RN.shape[1], x_RK.shape[1])
    start = padded_start = 0
    for e, (end, padded_end) in enumerate(zip(offsets.tolist(), padded_ends.tolist(), strict=True)):
        slot = slice(padded_start, padded_start + end - start)  # the expert's rows, padding left out
        if end > start:
            out[e] = (dy_f[:, slot] * dy_inv[e, :, None]) @ (x_f[:, slot] * x_inv[e, :, None]).t()
        start, padded_start = end, padded_end
    return out.to(out_dtype)
