"""moe_mxfp8: MXFP8 (OCP microscaling) formats, kernels, layers and weight caches.

- ``quantize`` / ``dequantize``: E4M3 data with one E8M0 scale per 32 elements along
  an axis, bit-identical to torchao's MX reference (floor scale rule); Triton kernels
  (``moe_mxfp8._quantize_kernels``, imported only when used) or the pure-torch
  ``<op>_reference`` beside each op, chosen by ``backend="auto" | "triton" | "reference"``.
- ``MXFP8Linear`` / ``MXFP8GroupedExperts``: drop-in modules holding the original
  parameters, with MXFP8 forward and input-gradient GEMMs (exactly emulated on
  Hopper) and MXFP8 weight caches derived from the weights.
- ``apply_mxfp8`` swaps modules by name pattern (``unmatched_targets`` names the
  patterns that match nothing); ``refresh_weight_caches`` is the optimizer's
  weights-updated hook.
- ``MXFP8RowCodec``: an MXFP8 payload for expert-parallel dispatch (``RowCodec``).
- ``quantize_fp8`` / ``FP8Tensor`` / ``quantize_group_columns`` /
  ``quantize_group_column_blocks``: E4M3 with FP32 scales
  per row, 1x128 tile or 128x128 block (torchao's float8 rowwise and DeepSeek-V3's
  blockwise recipes); ``quantize_weight_rowwise`` / ``quantize_weight_blocks``: a
  weight's two rowwise or 128x128-block copies in one call; ``FP8GroupedExperts`` /
  ``FP8Linear``: routed experts and dense layers on FP8 GEMMs
  (``torch._scaled_grouped_mm`` on Hopper, ``fp8_native_available``, or the package's
  Triton kernel for rowwise and blockwise scales, ``fp8_triton_available``), chosen by
  ``MXFP8Config.recipe`` and ``gemm``; ``FP8RowCodec``: the rowwise FP8 dispatch payload
  (``encode_fp8_rows`` / ``decode_fp8_rows``, one kernel each way).
"""

from moe_mxfp8._triton_support import (
    BACKENDS,
    Backend,
    reference_kernels_enabled,
    triton_available,
    use_reference_kernels,
)
from moe_mxfp8.apply import (
    RECIPES,
    MXFP8Config,
    apply_mxfp8,
    mxfp8_modules,
    name_matches,
    refresh_weight_caches,
    unmatched_targets,
)
from moe_mxfp8.cache import MXFP8WeightCache
from moe_mxfp8.codec import (
    FP8RowCodec,
    MXFP8RowCodec,
    decode_fp8_rows,
    decode_fp8_rows_reference,
    encode_fp8_rows,
    encode_fp8_rows_reference,
)
from moe_mxfp8.experts import MXFP8GroupedExperts
from moe_mxfp8.format import (
    BLOCK_SIZE,
    MXFP8Tensor,
    dequantize,
    dequantize_reference,
    quantize,
    quantize_dequantize,
    quantize_dequantize_reference,
    quantize_reference,
    quantize_rows_and_cols,
    quantize_rows_and_cols_reference,
    scale_to_float,
)
from moe_mxfp8.fp8 import (
    FP8Tensor,
    GroupColumnsLayout,
    dequantize_fp8,
    group_columns_layout,
    quantize_fp8,
    quantize_fp8_reference,
    quantize_group_column_blocks,
    quantize_group_column_blocks_reference,
    quantize_group_columns,
    quantize_group_columns_reference,
    quantize_weight_blocks,
    quantize_weight_rowwise,
)
from moe_mxfp8.fp8_experts import FP8_RECIPES, FP8GroupedExperts
from moe_mxfp8.fp8_gemm import FP8_GEMMS, fp8_native_available, fp8_triton_available
from moe_mxfp8.fp8_linear import FP8Linear
from moe_mxfp8.gemm import native_mx_available
from moe_mxfp8.linear import MXFP8Linear
from moe_mxfp8.swiglu import (
    swiglu,
    swiglu_backward,
    swiglu_backward_quantized,
    swiglu_backward_quantized_reference,
    swiglu_backward_reference,
    swiglu_quantized,
    swiglu_quantized_reference,
    swiglu_reference,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "reference_kernels_enabled",
    "triton_available",
    "use_reference_kernels",
    "BLOCK_SIZE",
    "FP8RowCodec",
    "FP8GroupedExperts",
    "FP8Linear",
    "FP8Tensor",
    "FP8_GEMMS",
    "FP8_RECIPES",
    "RECIPES",
    "decode_fp8_rows",
    "decode_fp8_rows_reference",
    "dequantize_fp8",
    "encode_fp8_rows",
    "encode_fp8_rows_reference",
    "fp8_native_available",
    "fp8_triton_available",
    "GroupColumnsLayout",
    "group_columns_layout",
    "quantize_fp8",
    "quantize_fp8_reference",
    "quantize_group_column_blocks",
    "quantize_group_column_blocks_reference",
    "quantize_group_columns",
    "quantize_group_columns_reference",
    "quantize_weight_blocks",
    "quantize_weight_rowwise",
    "MXFP8Config",
    "MXFP8GroupedExperts",
    "MXFP8Linear",
    "MXFP8RowCodec",
    "MXFP8Tensor",
    "MXFP8WeightCache",
    "apply_mxfp8",
    "dequantize",
    "dequantize_reference",
    "mxfp8_modules",
    "name_matches",
    "native_mx_available",
    "quantize",
    "quantize_dequantize",
    "quantize_dequantize_reference",
    "quantize_reference",
    "quantize_rows_and_cols",
    "quantize_rows_and_cols_reference",
    "refresh_weight_caches",
    "scale_to_float",
    "swiglu",
    "swiglu_backward",
    "swiglu_backward_quantized",
    "swiglu_backward_quantized_reference",
    "swiglu_backward_reference",
    "swiglu_quantized",
    "swiglu_quantized_reference",
    "swiglu_reference",
    "unmatched_targets",
]
