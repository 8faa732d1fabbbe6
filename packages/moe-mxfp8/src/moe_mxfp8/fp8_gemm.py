"""Grouped GEMMs on scaled E4M3 operands: two GEMMs for Hopper, an exact emulation elsewhere.

Shape legend: R rows (expert-major), E experts, K reduction width, N output width,
W the padded token width of a weight-gradient operand.

``gemm`` chooses the implementation (``FP8_GEMMS``):

- ``native``: ``torch._scaled_grouped_mm`` (CUTLASS, sm_90), rowwise FP32 scales only,
  BF16 output, widths multiples of 16.
- ``triton``: this package's kernel (``_fp8_gemm_kernels.fp8_rows_kernel``, CUDA devices
  with FP8 tensor cores, compute capability 8.9 and up, or Triton's CPU interpreter) for
  the row-segmented GEMM ``fp8_grouped_mm``, rowwise or blockwise scales, any widths. It
  is the only grouped GEMM here that reads DeepSeek-V3's 1x128 / 128x128 scales (torch has
  none for sm_90), and it is written for the shapes the expert layers run: a persistent
  grid over (group, m-tile, n-tile) found on the device, TMA loads, K steps of 128, and
  (``FP8TileConfig.tma_store``) the finished tile stored by TMA, kept to its group's rows.
  The weight gradients over tokens (``fp8_grouped_wgrad``) with blockwise scales run on
  this package's second kernel (``_fp8_gemm_kernels.fp8_wgrad_blocks_kernel``); with
  rowwise scales they have no Triton kernel: with ``triton`` they run natively where
  ``fp8_native_available``, emulated elsewhere.
- ``emulated`` (any device; the reference both are checked against): dequantize both
  operands to FP32 (``data * (1 / scale)``, exact for power-of-two scales, rounded once
  otherwise) and multiply in FP32, one matmul per expert (reads the offsets on the host).
  It computes in FP32 whatever ``fast_accum`` says (as torchao's emulation ignores
  ``use_fast_accum``), so the GEMMs equal it up to accumulation order with ``fast_accum=
  False``, and only within the fast accumulator's error with ``True``. Rows past
  ``offsets[-1]`` are zero here and unspecified from the other two.

Accumulation is chosen per call (``fast_accum``): ``False`` promotes the partial sums
to FP32 registers as DeepSeek-V3 prescribes (the Triton kernel every K step of 128);
``True`` keeps them in the tensor cores' own accumulator (about 14 significant bits,
truncating), 1.1-1.3x the GEMM rate on an H200 (``tools/bench_fp8_experts.py``).
Blockwise scales change with every K block, so each block's product is scaled and
promoted whatever ``fast_accum`` says. Which GEMM of a layer takes which:
``FAST_ACCUM_DEFAULT``.

- ``fp8_grouped_mm``: ``out[r] = a[r] @ b[e(r)]^T`` with ``a [R, K]`` and ``b [E, N, K]``
  both scaled along K, per row (rowwise) or in 1x128 tiles and 128x128 blocks
  (blockwise; ``triton`` and ``emulated``); no alignment of the groups is needed.
- ``fp8_grouped_wgrad``: ``dw[e] = dy[seg e]^T @ x[seg e]`` with both operands scaled per
  expert and column (``quantize_group_columns``), transposed with 16-aligned group
  starts (the "2d x 2d" form reduces over tokens and reads each group at an aligned
  address); or, ``blockwise``, per column and 128 tokens of each expert
  (``quantize_group_column_blocks``, 128-aligned group starts), each block's product
  scaled and promoted to FP32 (DeepSeek-V3's weight gradients, torchao's
  ``blockwise_fp8_training``): ``triton`` or ``emulated``. It is
  ``quantize_wgrad_operands`` then ``fp8_wgrad_mm``, which can also add the gradients into
  an FP32 target (a gradient sink's main grad; blockwise on Triton, in the epilogue).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from moe_mxfp8._triton_support import _interpreting, triton_available
from moe_mxfp8.fp8 import (
    TOKEN_BLOCK,
    FP8Tensor,
    group_columns_layout,
    quantize_group_column_blocks,
    quantize_group_columns,
)

if TYPE_CHECKING:
    from triton.tools.tensor_descriptor import TensorDescriptor

FP8_GEMMS = ("emulated", "native", "triton")

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


def check_gemm_runs(owner: str, gemm: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise, naming ``owner``, where ``gemm`` cannot run on ``x``'s device in ``dtype``."""
    if gemm == "triton" and not fp8_triton_available(x.device):
        raise RuntimeError(f"{owner}: gemm='triton' needs Triton and a CUDA device of compute "
                           f"capability 8.9 or up (or CPU tensors under TRITON_INTERPRET=1); the "
                           f"input is on {x.device}")
    if gemm == "native":
        if not fp8_native_available(x.device):
            raise RuntimeError(f"{owner}: gemm='native' needs a CUDA device of compute capability "
                               f"9.x; the input is on {x.device}")
        if dtype != torch.bfloat16:
            raise ValueError(f"{owner}: gemm='native' computes in BF16, got {dtype} inputs")


def check_native_widths(*widths: int) -> None:
    bad = [w for w in widths if w % 16]
    if bad:
        raise ValueError(f"native FP8 grouped GEMMs need widths divisible by 16, got {list(widths)}")


def fp8_triton_available(device: torch.device) -> bool:
    """True where ``gemm="triton"`` runs: Triton installed and a CUDA device with FP8 tensor
    cores (compute capability 8.9 and up), or CPU tensors under Triton's interpreter. Like
    ``native``, a GEMM chosen by configuration: the reference switch leaves it alone."""
    if not triton_available():
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return _interpreting()


@dataclass(frozen=True)
class FP8TileConfig:
    """Tiles of ``fp8_rows_kernel``: the output tile ``block_m x block_n``, the K step
    ``block_k`` (dividing 128 for blockwise scales), ``group_m`` m-tiles per L2 band,
    warps, pipeline stages, whether operands load through TMA where they allow it, the
    persistent programs per SM (two let one program's FP32 promotion run while the
    other's tensor cores work, where registers and shared memory allow two), and whether
    the finished tile is stored through TMA where the output allows it (rows of 16-byte
    multiples, not ``accumulate_into``), in two column halves."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    use_tma: bool
    programs_per_sm: int = 1
    tma_store: bool = False


# The fastest at the bench-1gpu expert shapes, per accumulation (the tile sweep of
# ``tools/from_source.sh python3 tools/bench_fp8_experts.py --parts gemms --no-blockwise``):
# with the running sum in the tensor cores one wide tile per SM, four stages and the tile
# stored through TMA (one H100: 1,294 TFLOP/s against 1,229 with three stages and the
# pointer store, 1,252 with four stages alone; three stages with the pointer store led on an
# H200 at commit fd4ff16, 1,220 against 1,233 with four); where every K step's product is
# promoted (rowwise) or scaled and promoted (blockwise) in FP32 registers, the program
# waits for its tensor cores before that work, and two programs of narrower tiles per SM
# let one program's FP32 work run under the other's products (H200: 877 and 505 TFLOP/s,
# against 738 and 409 with the wide tile; the TMA store moves them by under 1% on the
# H100). FP32 results take the fast tile at half its width: the wide tile's FP32 epilogue
# (staging, or the layout change of an added result) needs 263-328 KiB of shared memory,
# more than an sm_90 SM has (227 KiB). The interpreter's small tiles keep CPU tests fast.
FP8_TILES_GPU = {"fast": FP8TileConfig(128, 256, 128, 8, 8, 4, True, 1, True),
                 "fast_fp32": FP8TileConfig(128, 128, 128, 8, 8, 4, True, 1, True),
                 "promoted": FP8TileConfig(64, 128, 128, 8, 4, 3, True, 2)}
FP8_TILES_CPU = FP8TileConfig(16, 16, 16, 2, 1, 1, False)
# The blockwise weight-gradient kernel holds two FP32 tiles (the running sum and the
# block's product), so it takes the promoted GEMM's narrower tile. Not yet tuned on a GPU:
# ``tools/bench_fp8_experts.py --parts gemms`` times it at the bench shapes.
FP8_WGRAD_TILES_GPU = FP8TileConfig(64, 128, 128, 1, 4, 3, False)


def default_fp8_tiles(device: torch.device, blockwise: bool, fast_accum: bool,
                      out_dtype: torch.dtype = torch.bfloat16) -> FP8TileConfig:
    """The tiles ``triton_grouped_mm`` takes on ``device`` when given none."""
    if device.type != "cuda":
        return FP8_TILES_CPU
    if not fast_accum or blockwise:
        return FP8_TILES_GPU["promoted"]
    return FP8_TILES_GPU["fast" if out_dtype.itemsize <= 2 else "fast_fp32"]


def _sm_count(index: int) -> int:
    """SMs the persistent grid spreads over: every SM less torch's SM carveout
    (``torch._C._set_sm_carveout_experimental``, which cuBLAS and torch's grouped GEMMs
    leave free too, for kernels of other streams), at least one."""
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    carveout = (get() if get is not None else None) or 0
    return max(1, _device_sms(index) - carveout)


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_pair(a: FP8Tensor, b: FP8Tensor) -> bool:
    """Whether the operands are blockwise (else rowwise); raises for anything else."""
    if a.data.dim() != 2 or b.data.dim() != 3 or a.data.shape[1] != b.data.shape[2]:
        raise ValueError(f"FP8 grouped GEMM: a must be [R, K] and b [E, N, K], got "
                         f"{tuple(a.data.shape)} and {tuple(b.data.shape)}")
    blocks = (tuple(a.block), tuple(b.block))
    if blocks not in (((1, 0), (1, 0)), ((1, 128), (128, 128))):
        raise ValueError(f"FP8 grouped GEMM: scale blocks must be rowwise ((1, 0), (1, 0)) or "
                         f"blockwise ((1, 128), (128, 128)), got {blocks}")
    return blocks[1] == (128, 128)


def triton_grouped_mm(a: FP8Tensor, b: FP8Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                      fast_accum: bool, config: FP8TileConfig | None = None,
                      accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_grouped_mm`` with ``gemm="triton"`` (module notes); ``config`` overrides the
    device's default tiles. Offsets stay on the device; rows past ``offsets[-1]`` are unset
    (``accumulate_into``: left as they were)."""
    blockwise = _check_pair(a, b)
    R, K = a.data.shape
    E, N, _ = b.data.shape
    if offsets.shape != (E,) or offsets.dtype != torch.int32:
        raise ValueError(f"FP8 grouped GEMM: offsets must be int32 [{E}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    on_gpu = a.data.device.type == "cuda"
    cfg = config or default_fp8_tiles(a.data.device, blockwise, fast_accum, out_dtype)
    if blockwise and 128 % cfg.block_k:
        raise ValueError(f"FP8 grouped GEMM: blockwise scales need a K step dividing 128, got {cfg.block_k}")
    if accumulate_into is not None:
        _check_accumulator(accumulate_into, (R, N), out_dtype, a.data.device)
    y = torch.empty(R, N, dtype=out_dtype, device=a.data.device) if accumulate_into is None else accumulate_into
    if R == 0 or N == 0:
        return y
    import triton

    from moe_mxfp8._fp8_gemm_kernels import fp8_rows_kernel

    a_data, b_data = a.data.contiguous(), b.data.contiguous()
    a_scale, b_scale = a.scale.contiguous(), b.scale.contiguous()
    tiles_n = triton.cdiv(N, cfg.block_n)
    max_tiles = (triton.cdiv(R, cfg.block_m) + E) * tiles_n
    grid = (min(max_tiles, cfg.programs_per_sm * _sm_count(a.data.device.index or 0)) if on_gpu
            else max_tiles)
    use_tma = (cfg.use_tma and K % cfg.block_k == 0 and K % 16 == 0
               and a_data.data_ptr() % 16 == 0 and b_data.data_ptr() % 16 == 0)
    a_arg, b_arg = a_data, b_data
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_arg = TensorDescriptor.from_tensor(a_data, [cfg.block_m, cfg.block_k])
        b_arg = TensorDescriptor.from_tensor(b_data.view(E * N, K), [cfg.block_n, cfg.block_k])
    tma_store = (cfg.tma_store and accumulate_into is None and cfg.block_n % 2 == 0
                 and _tma_rows(y, cfg.block_n // 2))
    y_desc = _group_rows_descriptor(y, [cfg.block_m, cfg.block_n // 2]) if tma_store else y
    from triton.runtime.errors import OutOfResources

    try:
        fp8_rows_kernel[(grid,)](
            a_arg, b_arg, y, y_desc, offsets, a_scale, b_scale,
            R, N, K, E, grid,
            a_data.stride(0), b_data.stride(0), b_data.stride(1), y.stride(0),
            a_scale.stride(0), b_scale.stride(0), b_scale.stride(1),
            BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
            E_BLOCK=triton.next_power_of_2(E), BLOCKWISE=blockwise, FAST=fast_accum and not blockwise,
            USE_TMA=use_tma, EVEN_K=K % cfg.block_k == 0, ACCUMULATE=accumulate_into is not None,
            TMA_STORE=tma_store, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    except OutOfResources as e:  # what the compiled tiles need is known only after compiling them
        raise ValueError(f"FP8 grouped GEMM: the tiles {cfg} need {e.name} {e.required}, this GPU "
                         f"allows {e.limit}: pass a smaller FP8TileConfig (block sizes, num_stages)") from e
    return y


def _tma_rows(y: torch.Tensor, box_cols: int) -> bool:
    """Whether TMA can store boxes ``box_cols`` wide into the rows of ``y`` through
    ``_group_rows_descriptor``: a 16-byte aligned start, unit-stride rows a multiple of 16
    bytes apart, boxes of 16-byte rows, fewer than 2^30 rows."""
    size = y.element_size()
    return (y.stride(1) == 1 and y.data_ptr() % 16 == 0 and (y.stride(0) * size) % 16 == 0
            and (box_cols * size) % 16 == 0 and y.shape[0] < 2**30)


def _group_rows_descriptor(y: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``y [R, N]`` for ``_fp8_gemm_kernels._store_group_rows`` (its
    docstring shows how the 4-D shape confines a store to one group's rows)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    stride = y.stride(0)
    return TensorDescriptor(y, [0x7FFF0000, 0x7FFF0000, 0x40000000, y.shape[1]],
                            [2**34 - stride, stride, stride, 1], [1, 1, *block])


def _check_accumulator(y: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> None:
    """``accumulate_into`` must be the GEMM's result as it would allocate it (``[R, N]`` or,
    for the weight gradients, ``[E, N, K]``), unit stride along its last dimension and no
    two elements at one address (any larger strides)."""
    dense = all(y.stride(i) >= y.stride(i + 1) * y.shape[i + 1] for i in range(y.dim() - 1))
    if (tuple(y.shape), y.dtype, y.device) != (shape, dtype, device) or (
            y.numel() and (y.stride(-1) != 1 or not dense)):
        raise ValueError(f"FP8 grouped GEMM: accumulate_into must be {dtype} {shape} on {device} "
                         f"with unit-stride rows, got {y.dtype} {tuple(y.shape)} strides "
                         f"{y.stride()} on {y.device}")


_NATIVE_ROWWISE_ONLY = "gemm='native' (torch._scaled_grouped_mm) takes rowwise scales only"


def fp8_grouped_mm(a: FP8Tensor, b: FP8Tensor, offsets: torch.Tensor, out_dtype: torch.dtype,
                   gemm: str, fast_accum: bool,
                   accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``a [R, K] @ b[e]^T`` per expert segment; ``b`` is ``[E, N, K]``, both scaled along K
    (rowwise, or blockwise with ``gemm`` ``triton`` or ``emulated``).

    ``accumulate_into``: an ``[R, N]`` tensor of ``out_dtype`` the product is added to and
    returned; the Triton GEMM adds it in its epilogue (one rounding, no second result),
    the others add their result to it."""
    if gemm == "triton":  # checks the pair itself
        return triton_grouped_mm(a, b, offsets, out_dtype, fast_accum, accumulate_into=accumulate_into)
    if accumulate_into is not None:
        _check_accumulator(accumulate_into, (a.data.shape[0], b.data.shape[1]), out_dtype,
                           a.data.device)
        return accumulate_into.add_(fp8_grouped_mm(a, b, offsets, out_dtype, gemm, fast_accum))
    _check_gemm(gemm, _check_pair(a, b))
    if gemm == "native":
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


@dataclass(frozen=True)
class FP8WgradOperands:
    """The two operands of a grouped weight-gradient GEMM, ``dw[e] = dy_e^T @ x_e``,
    quantized along their tokens (``quantize_wgrad_operands``): ``dy_t [N, W]`` and
    ``x_t [K, W]`` E4M3, transposed into the groups' aligned slots ending at
    ``padded_ends``; scales ``[E, N]`` / ``[E, K]`` (one per expert and column) or,
    ``blockwise``, ``[W/128, N]`` / ``[W/128, K]`` (one per column and 128 tokens)."""

    dy_t: torch.Tensor
    dy_scale: torch.Tensor
    x_t: torch.Tensor
    x_scale: torch.Tensor
    offsets: torch.Tensor
    padded_ends: torch.Tensor
    blockwise: bool

    def dy_columns(self, start: int, stop: int) -> FP8WgradOperands:
        """The operands of the gradient of ``dy``'s columns ``start:stop`` alone (a weight
        whose output is a slice of the GEMM's, e.g. gate or up of a fused gate/up): every
        scale covers one column, so these are the slice's own codes and scales."""
        return replace(self, dy_t=self.dy_t[start:stop], dy_scale=self.dy_scale[:, start:stop])


def quantize_wgrad_operands(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets: torch.Tensor,
                            pow2: bool, blockwise: bool) -> FP8WgradOperands:
    """Both operands of ``fp8_grouped_wgrad``, quantized once (one layout for both: the
    same groups)."""
    if blockwise:
        dy_t, dy_scale, padded_ends = quantize_group_column_blocks(dy_RN, offsets, pow2)
        x_t, x_scale, _ = quantize_group_column_blocks(x_RK, offsets, pow2, padded_ends=padded_ends)
    else:
        layout = group_columns_layout(offsets)
        dy_t, dy_scale, padded_ends = quantize_group_columns(dy_RN, offsets, pow2, layout=layout)
        x_t, x_scale, _ = quantize_group_columns(x_RK, offsets, pow2, layout=layout)
    return FP8WgradOperands(dy_t, dy_scale, x_t, x_scale, offsets, padded_ends, blockwise)


def fp8_grouped_wgrad(dy_RN: torch.Tensor, x_RK: torch.Tensor, offsets: torch.Tensor,
                      pow2: bool, out_dtype: torch.dtype, gemm: str, fast_accum: bool,
                      blockwise: bool = False) -> torch.Tensor:
    """``[E, N, K]`` weight gradients from E4M3 operands scaled per expert and column, or
    (``blockwise``) per column and 128 tokens of each expert: ``fp8_wgrad_mm`` of
    ``quantize_wgrad_operands``."""
    _check_gemm(gemm, blockwise)
    ops = quantize_wgrad_operands(dy_RN, x_RK, offsets, pow2, blockwise)
    return fp8_wgrad_mm(ops, out_dtype, gemm, fast_accum)


def fp8_wgrad_mm(ops: FP8WgradOperands, out_dtype: torch.dtype, gemm: str, fast_accum: bool,
                 accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``[E, N, K]`` weight gradients of quantized operands; rowwise, ``gemm="triton"``
    runs natively where that is available (module notes). ``fast_accum`` applies to
    rowwise scales only (blockwise promotes every block).

    ``accumulate_into``: an FP32 ``[E, N, K]`` tensor (unit stride along K) the gradients
    are added to and returned. Blockwise, the FP32 sum is added before any rounding (the
    Triton kernel in its epilogue: no gradient tensor is written and read back); rowwise,
    the ``out_dtype`` result is added (torch's GEMM rounds to it)."""
    _check_gemm(gemm, ops.blockwise)
    if accumulate_into is not None:
        _check_accumulator(accumulate_into, (ops.offsets.shape[0], ops.dy_t.shape[0], ops.x_t.shape[0]),
                           torch.float32, ops.dy_t.device)
    if ops.blockwise:
        if gemm == "triton":
            return triton_grouped_wgrad_blocks(ops.dy_t, ops.dy_scale, ops.x_t, ops.x_scale,
                                               ops.padded_ends, out_dtype, accumulate_into=accumulate_into)
        dw = _emulated_wgrad_blocks(ops)
        return dw.to(out_dtype) if accumulate_into is None else accumulate_into.add_(dw)
    if gemm == "native" or (gemm == "triton" and fp8_native_available(ops.dy_t.device)):
        dw = torch._scaled_grouped_mm(
            ops.dy_t, ops.x_t.t(), ops.dy_scale.reciprocal().reshape(-1),
            ops.x_scale.reciprocal().reshape(-1), offs=ops.padded_ends, out_dtype=out_dtype,
            use_fast_accum=fast_accum)
    else:
        dw = _emulated_wgrad_rows(ops).to(out_dtype)
    return dw if accumulate_into is None else accumulate_into.add_(dw)


def _check_gemm(gemm: str, blockwise: bool) -> None:
    if gemm not in FP8_GEMMS:
        raise ValueError(f"gemm must be one of {FP8_GEMMS}, got {gemm!r}")
    if gemm == "native" and blockwise:
        raise ValueError(_NATIVE_ROWWISE_ONLY)


def _emulated_wgrad_rows(ops: FP8WgradOperands) -> torch.Tensor:
    """FP32 ``[E, N, K]`` of per-expert column scales, one matmul per expert."""
    dy_f, x_f = ops.dy_t.float(), ops.x_t.float()
    dy_inv, x_inv = ops.dy_scale.reciprocal(), ops.x_scale.reciprocal()
    out = dy_f.new_zeros(ops.offsets.shape[0], dy_f.shape[0], x_f.shape[0])
    start = padded_start = 0
    for e, (end, padded_end) in enumerate(zip(ops.offsets.tolist(), ops.padded_ends.tolist(), strict=True)):
        slot = slice(padded_start, padded_start + end - start)  # the expert's rows, padding left out
        if end > start:
            out[e] = (dy_f[:, slot] * dy_inv[e, :, None]) @ (x_f[:, slot] * x_inv[e, :, None]).t()
        start, padded_start = end, padded_end
    return out


def _emulated_wgrad_blocks(ops: FP8WgradOperands) -> torch.Tensor:
    """FP32 ``[E, N, K]`` of per-128-token column scales, one matmul per expert."""
    dy_f, x_f = _widened_blocks(ops.dy_t, ops.dy_scale), _widened_blocks(ops.x_t, ops.x_scale)
    out = dy_f.new_zeros(ops.offsets.shape[0], dy_f.shape[0], x_f.shape[0])
    start = 0
    for e, end in enumerate(ops.padded_ends.tolist()):
        if end > start:
            out[e] = dy_f[:, start:end] @ x_f[:, start:end].t()
        start = end
    return out


def _widened_blocks(data_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP32 ``data * (1 / scale)`` of a ``quantize_group_column_blocks`` operand, scaled in
    place (one FP32 copy of the operand, no broadcast scale tensor)."""
    f = data_t.float()
    f.view(f.shape[0], -1, TOKEN_BLOCK).mul_(scale.reciprocal().t()[:, :, None])
    return f


def triton_grouped_wgrad_blocks(a_t: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor,
                                b_scale: torch.Tensor, padded_ends: torch.Tensor,
                                out_dtype: torch.dtype, config: FP8TileConfig | None = None,
                                accumulate_into: torch.Tensor | None = None) -> torch.Tensor:
    """``[E, N, K]``: ``a_t [N, W]`` against ``b_t [K, W]`` over each group's 128-aligned
    columns, as ``quantize_group_column_blocks`` lays them out (``fp8_wgrad_blocks_kernel``);
    ``config``: its tiles (``block_m`` x ``block_n`` output tiles, ``block_k`` dividing 128,
    warps and stages; the others unused), by default ``default_wgrad_tiles``.
    ``accumulate_into``: an FP32 ``[E, N, K]`` tensor (unit stride along K) the kernel adds
    its sums to in the epilogue and that is returned (``out_dtype`` then unused)."""
    (N, W), (K, W_b) = a_t.shape, b_t.shape
    E = padded_ends.shape[0]
    if W != W_b or W % TOKEN_BLOCK or a_scale.shape != (W // TOKEN_BLOCK, N) or (
            b_scale.shape != (W // TOKEN_BLOCK, K)):
        raise ValueError(f"FP8 blockwise weight gradient: operands [N, W] and [K, W] with W a "
                         f"multiple of {TOKEN_BLOCK} and scales [W/{TOKEN_BLOCK}, N] and "
                         f"[W/{TOKEN_BLOCK}, K], got {tuple(a_t.shape)}, {tuple(b_t.shape)}, "
                         f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
    cfg = config or default_wgrad_tiles(a_t.device)
    if TOKEN_BLOCK % cfg.block_k:
        raise ValueError(f"FP8 blockwise weight gradient: the K step must divide {TOKEN_BLOCK}, "
                         f"got {cfg.block_k}")
    if accumulate_into is None:
        y = torch.empty(E, N, K, dtype=out_dtype, device=a_t.device)
    else:
        _check_accumulator(accumulate_into, (E, N, K), torch.float32, a_t.device)
        y = accumulate_into
    if y.numel() == 0:
        return y
    import triton

    from moe_mxfp8._fp8_gemm_kernels import fp8_wgrad_blocks_kernel

    # unit stride within a row is all the kernel needs (a gate or up half: rows of dy's copy
    # and a column slice of its scales)
    a_t, b_t, a_scale, b_scale = (t if t.stride(-1) == 1 else t.contiguous()
                                  for t in (a_t, b_t, a_scale, b_scale))
    grid = (triton.cdiv(N, cfg.block_m) * triton.cdiv(K, cfg.block_n), E)
    fp8_wgrad_blocks_kernel[grid](
        a_t, b_t, y, padded_ends, a_scale, b_scale, N, K,
        a_t.stride(0), b_t.stride(0), y.stride(0), y.stride(1), a_scale.stride(0), b_scale.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, ACCUMULATE=accumulate_into is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def default_wgrad_tiles(device: torch.device) -> FP8TileConfig:
    """The tiles ``triton_grouped_wgrad_blocks`` takes on ``device`` when given none."""
    return FP8_WGRAD_TILES_GPU if device.type == "cuda" else FP8_TILES_CPU
