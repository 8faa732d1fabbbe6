"""The local dispatcher's gather writing a ``RowEncoder``'s codes of the rows it gathers
(``moe_model.row_encoding``), in Triton. Importing this module requires Triton.

``rows[r] = x[token_of_row[r]]`` (zero where ``valid_rows[r]`` is false), and beside them
``scales[r] = ROW_SCALE(amax)`` and ``codes[r] = ROW_ENCODE(rows[r], scales[r])``, ``amax``
the row's largest magnitude (NaN where it holds a NaN). A program takes a block of rows and
walks D twice: the first walk finds each row's amax, the second (its reads mostly from L2:
a program's rows are a few KiB each) copies the rows and writes their codes. Against a
gather followed by a rowwise quantisation this saves the quantisation's read of the
``[R, D]`` rows. Without an encoder the dispatcher gathers with ``index_select``, which
already runs at the device's copy rate.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from moe_model._combine_kernels import LaunchShape


@triton.jit
def gather_rows_encoded_kernel(
    x_ptr, token_ptr, valid_ptr, rows_ptr, codes_ptr, scales_ptr,
    R, D, stride_x, stride_rows, stride_codes,
    HAS_VALID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_SCALE: tl.constexpr, ROW_ENCODE: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    t = tl.load(token_ptr + r, mask=r_ok, other=0).to(tl.int64)
    live = r_ok
    if HAS_VALID:
        live = live & (tl.load(valid_ptr + r, mask=r_ok, other=0) != 0)
    r64 = r.to(tl.int64)
    src = (x_ptr + t * stride_x)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    nan = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        v = tl.abs(tl.load(src + d, mask=live[:, None] & (d < D), other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.max(v, axis=1))
        nan = tl.maximum(nan, tl.max((v != v).to(tl.int32), axis=1))
    scale = ROW_SCALE(tl.where(nan != 0, float("nan"), amax))
    tl.store(scales_ptr + r64, scale, mask=r_ok)
    scale = scale[:, None]
    dst = (rows_ptr + r64 * stride_rows)[:, None]
    code_dst = (codes_ptr + r64 * stride_codes)[:, None]
    for d0 in range(0, D, BLOCK_D):
        d = d0 + cols
        out = r_ok[:, None] & (d < D)
        v = tl.load(src + d, mask=live[:, None] & (d < D), other=0.0)
        tl.store(dst + d, v, mask=out)
        tl.store(code_dst + d, ROW_ENCODE(v.to(tl.float32), scale), mask=out)


# Within 2.5% of the fastest shape of `tools/from_source.sh python3 tools/sweep_dispatch_kernels.py
# --out $OUT/sweep.json` at bench-1gpu's layer shapes (65,536 rows of D 2048; one H100, commit
# eb56bdc, tools/results/sweep_dispatch_kernels_h100.json: 0.220 ms against 0.215). CPU runs
# are the Triton interpreter (tests), where small blocks exercise the tails.
GPU_LAUNCH = LaunchShape(block_d=2048, tile=2048, num_warps=4)
_CPU_BLOCK_R, _CPU_BLOCK_D = 4, 16


def gather_rows_encoded(
    x_TD: torch.Tensor, token_of_row_R: torch.Tensor, valid_rows_R: torch.Tensor | None, encoder: Any,
    launch: LaunchShape | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows [R, D], codes [R, D] uint8, scales [R, 1] FP32)``: ``rows[r] =
    x[token_of_row[r]]``, zero where ``valid_rows`` (``[R]`` bool) is false, and the
    ``encoder``'s codes and scales of those rows (module notes). ``x`` keeps its dtype.
    ``launch``: the GPU launch shape (``block_d``: D columns per walk step; default ``GPU_LAUNCH``)."""
    R, D = token_of_row_R.shape[0], x_TD.shape[1]
    dev = x_TD.device
    rows = torch.empty(R, D, dtype=x_TD.dtype, device=dev)
    codes = torch.empty(R, D, dtype=torch.uint8, device=dev)
    scales = torch.empty(R, 1, dtype=torch.float32, device=dev)
    if R == 0 or D == 0:
        return rows, codes, scales
    if x_TD.stride(-1) != 1:
        x_TD = x_TD.contiguous()
    launch = launch or GPU_LAUNCH
    if dev.type == "cuda":
        block_d = min(launch.block_d, triton.next_power_of_2(D))
        block_r = max(1, launch.tile // block_d)
    else:
        block_r, block_d = _CPU_BLOCK_R, _CPU_BLOCK_D
    token_of_row_R = token_of_row_R.contiguous()
    valid = valid_rows_R.contiguous() if valid_rows_R is not None else None
    gather_rows_encoded_kernel[(triton.cdiv(R, block_r),)](
        x_TD, token_of_row_R, valid if valid is not None else token_of_row_R, rows, codes, scales,
        R, D, x_TD.stride(0), rows.stride(0), codes.stride(0),
        HAS_VALID=valid is not None, BLOCK_R=block_r, BLOCK_D=block_d,
        ROW_SCALE=encoder.row_scale, ROW_ENCODE=encoder.row_encode,
        # an encoder's rounding steps are exact only without FMA contraction
        num_warps=launch.num_warps, enable_fp_fusion=False,
    )
    return rows, codes, scales
