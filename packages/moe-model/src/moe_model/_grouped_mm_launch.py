"""Grouped GEMM in Triton over expert segments given by device-side offsets.

Shape legend: R rows (tokens dispatched to experts, expert-major), E experts,
K reduction width, N output width; a group is one expert's run of rows,
``offsets[e]`` its cumulative end (int32, on the device, never read by the host).

Two kernels (``_grouped_mm_kernels``) cover the forward and both backward GEMMs of
``y = x @ w[e(r)]``:

- rows kernel, segmented M: ``y[r] = x[r] @ w[g(r)]``. Used for the forward and
  for ``dx = dy @ w[g]^T`` (the same kernel on the transposed weight view). The
  (group, m-tile, n-tile) work list is derived on the device: each program loads
  the offsets, counts each group's m-tiles, prefix-sums them and finds a tile's
  group with one vector comparison (no per-group loop, no host sync). Tiles inside
  a group go in GROUP_M swizzled order so neighbouring programs share weight
  columns and input rows in L2. Persistent mode runs one program per SM over a
  flat (tile, k-step) loop, so the software pipeline prefetches the next tile's
  first K blocks while the current tile finishes; operands come through TMA
  tensor descriptors when the widths allow (the tuned default on H100/H200).
  Rows past a group's end are read (they are the next group's, or zero-filled
  past R) but never stored, so loads need no row masks.
- wgrad kernel, segmented K: ``c[g] = a_g^T @ b_g`` with the reduction over group
  ``g``'s rows; gives ``dw[g] = x_g^T @ dy_g`` (or its transpose, whichever matches
  the weight's memory layout). One program per output tile; empty groups store zeros.
  ``wgrad_accumulate_`` runs it with an FP32 atomic-add epilogue instead (done in
  L2, so no program waits on the old values): the gradient lands in a data-parallel
  wrapper's FP32 main grad directly, and can reduce two batches of rows (two
  microbatches) in one launch, so the accumulator is read and written once for both.

Both accumulate in FP32 and read/write 2-byte or 4-byte floats; FP32 inputs use
IEEE products (no TF32) so they can serve as an exact reference. The entry point
is registered as a ``torch.library`` custom op, so selective activation recompute
(which works at the operator level) can keep its outputs. Triton is imported
lazily: importing this module never needs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from moe_model._triton_support import num_sms
from moe_model.backward_needs import grads_needed
from moe_model.sink import accumulator_layout


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of the output tile
    block_n: int  # columns of the output tile
    block_k: int  # reduction step
    group_m: int  # m-tiles per swizzle group (L2 reuse)
    num_warps: int
    num_stages: int  # software pipeline depth of the K loop
    persistent: bool  # one program per SM walking the tile list (rows kernel only)
    use_tma: bool  # load the rows kernel's operands through tensor descriptors (TMA) where possible


# The fastest of tools/bench_expert_gemms.py layer --sweep on H200 (triton 3.6) at the
# bench-1gpu MoE shapes; CPU runs are the Triton interpreter, where small tiles keep
# tests fast. The weight gradient has two: its reduction runs over a group's rows, ~1024
# per expert for one bench-1gpu microbatch, where a short K step with a deep pipeline won;
# a launch merging microbatches (or an EP rank's larger groups) reduces over several times
# as many, where K steps of 64 win by ~10% (tools/bench_expert_gemms.py gemms --merge 1 / --merge 4).
_GPU_ROWS = TileConfig(128, 256, 64, 8, 8, 3, True, True)
_GPU_WGRAD = TileConfig(128, 256, 32, 8, 8, 6, False, False)
_GPU_WGRAD_LONG = TileConfig(128, 256, 64, 8, 8, 4, False, False)
_CPU = TileConfig(16, 16, 16, 2, 1, 1, False, False)
_GPU = {"rows": _GPU_ROWS, "wgrad": _GPU_WGRAD, "wgrad_long": _GPU_WGRAD_LONG}
# rows per group (all of a launch's rows over its groups) from which "wgrad_long" applies
LONG_REDUCTION_ROWS = 2048


# Hopper's opt-in shared memory per block is 227 KiB; leave room for the epilogue.
_SHARED_MEMORY_BUDGET = 200 * 1024


def _fit_shared_memory(cfg: TileConfig, element_size: int) -> TileConfig:
    """Shrink the pipeline depth (then the N tile) until the K-loop buffers fit.

    The tuned configurations are for 2-byte operands; FP32 operands need twice the
    shared memory per stage, which overflowed the H200's limit at the tuned depth.
    """
    while True:
        stage_bytes = (cfg.block_m + cfg.block_n) * cfg.block_k * element_size
        if cfg.num_stages * stage_bytes <= _SHARED_MEMORY_BUDGET:
            return cfg
        if cfg.num_stages > 2:
            cfg = replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 64:
            cfg = replace(cfg, block_n=cfg.block_n // 2)
        else:
            return cfg


def default_config(
    kind: str, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> TileConfig:
    """Tile configuration of kernel ``kind`` (``rows``, ``wgrad``, or ``wgrad_long``: a
    weight gradient reducing over ``LONG_REDUCTION_ROWS`` rows per group or more) on
    ``device`` for operands of ``dtype``."""
    if device.type != "cuda":
        return _CPU
    return _fit_shared_memory(_GPU[kind], torch.empty((), dtype=dtype).element_size())


def set_default_config(kind: str, config: TileConfig) -> None:
    """Replace the GPU tile configuration of ``kind`` (e.g. with a tuned one)."""
    if kind not in _GPU:
        raise ValueError(f"kernel kind must be one of {sorted(_GPU)}, got {kind!r}")
    _GPU[kind] = config


def _kernels():  # noqa: ANN202 - the Triton module and its jitted kernels
    import triton

    from moe_model import _grouped_mm_kernels as k

    return triton, k.rows_kernel, k.wgrad_kernel


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _tma_ok(x_RK: torch.Tensor, w_EKN: torch.Tensor, cfg: TileConfig) -> bool:
    """TMA needs 16-byte aligned bases and row strides, and whole K blocks (a K block
    must not run into the next expert's weights)."""
    K, N = x_RK.shape[1], w_EKN.shape[2]
    size = x_RK.element_size()
    return (K % cfg.block_k == 0 and (K * size) % 16 == 0 and (N * size) % 16 == 0
            and x_RK.data_ptr() % 16 == 0 and w_EKN.data_ptr() % 16 == 0
            and (w_EKN.is_contiguous() or w_EKN.transpose(1, 2).is_contiguous()))


def _check(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"grouped GEMM: {name} must be {dim}-D, got shape {tuple(t.shape)}")


def _check_rows_operands(x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor) -> None:
    _check("x", x_RK, 2)
    _check("w", w_EKN, 3)
    E, Kw, _ = w_EKN.shape
    if Kw != x_RK.shape[1] or offsets_E.shape != (E,):
        raise ValueError(
            f"grouped GEMM: x {tuple(x_RK.shape)}, w {tuple(w_EKN.shape)} and offsets "
            f"{tuple(offsets_E.shape)} do not match"
        )


def _weight_2d(w_EKN: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(w, k_contiguous)``: the weight in a layout the kernel reads in place (a
    transposed view of an ``[E, N, K]`` weight stays as it is)."""
    k_contiguous = w_EKN.stride(1) == 1
    if not k_contiguous and w_EKN.stride(2) != 1:
        w_EKN = w_EKN.contiguous()
    return w_EKN, k_contiguous


def _weight_rows(w_EKN: torch.Tensor, k_contiguous: bool, cfg: TileConfig) -> tuple[torch.Tensor, list[int]]:
    """The 2-D view of a weight the TMA descriptor covers, and its block shape."""
    E, K, N = w_EKN.shape
    if k_contiguous:  # [E, N, K] in memory
        return w_EKN.transpose(1, 2).reshape(E * N, K), [cfg.block_n, cfg.block_k]
    return w_EKN.reshape(E * K, N), [cfg.block_k, cfg.block_n]  # [E, K, N] in memory


def _pair_descriptor(t0: torch.Tensor, t1: torch.Tensor, block: list[int]) -> tuple[object, int] | None:
    """One 3-D TMA descriptor ``[2, rows, cols]`` over two equally shaped 2-D tensors with
    contiguous rows, based at the lower address, and the index ``t0`` has in it; ``None``
    where the distance between them is no valid stride (same storage, not 16-byte aligned)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    lo, hi = (t0, t1) if t0.data_ptr() < t1.data_ptr() else (t1, t0)
    gap = hi.data_ptr() - lo.data_ptr()
    if gap == 0 or gap % 16 or gap >= 2**40 or lo.stride() != hi.stride():
        return None
    desc = TensorDescriptor(lo, [2, *lo.shape], [gap // lo.element_size(), lo.stride(0), 1], [1, *block])
    return desc, int(hi is t0)


def _launch_rows(
    xs: tuple[torch.Tensor, ...], ws: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...],
    offsets_E: torch.Tensor, config: TileConfig | None, pair: int,
) -> None:
    """Run the rows kernel: ``pair`` 0 (one GEMM), 1 (``ys[0] = sum_i xs[i] @ ws[i]``)
    or 2 (``ys[i] = xs[0] @ ws[i]``); see ``_grouped_mm_kernels.rows_kernel``."""
    x_RK, y_RN = xs[0], ys[0]
    R, K = x_RK.shape
    E, _, N = ws[0].shape
    if R == 0 or N == 0:
        return
    cfg = config or default_config("rows", x_RK.device, x_RK.dtype)
    triton, rows_kernel, _ = _kernels()
    tiles_n = triton.cdiv(N, cfg.block_n) * (2 if pair == 2 else 1)
    max_tiles = (triton.cdiv(R, cfg.block_m) + E) * tiles_n
    grid = min(max_tiles, num_sms(x_RK.device)) if cfg.persistent else max_tiles
    weights = [_weight_2d(w) for w in ws]
    k_contiguous = weights[0][1]
    if any(kc != k_contiguous or w.stride() != weights[0][0].stride() for w, kc in weights):
        weights = [(w.contiguous(), False) for w, _ in weights]  # one layout for both
        k_contiguous = False
    w_args = [w for w, _ in weights]
    x_args = list(xs)
    flips = [0, 0]
    use_tma = cfg.use_tma and all(_tma_ok(x, w, cfg) for x in xs for w in w_args)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        w_views = [_weight_rows(w, k_contiguous, cfg) for w in w_args]
        x_block = [cfg.block_m, cfg.block_k]
        paired_x = _pair_descriptor(xs[0], xs[1], x_block) if pair == 1 else None
        paired_w = _pair_descriptor(w_views[0][0], w_views[1][0], w_views[0][1]) if pair else None
        if pair and (paired_w is None or (pair == 1 and paired_x is None)):
            use_tma = False  # no common descriptor: the pointer path reads them
        else:
            x_args[0] = paired_x[0] if pair == 1 else TensorDescriptor.from_tensor(xs[0], x_block)
            w_args[0] = paired_w[0] if pair else TensorDescriptor.from_tensor(*w_views[0])
            flips = [paired_x[1] if pair == 1 else 0, paired_w[1] if pair else 0]
    w0 = weights[0][0]
    rows_kernel[(grid,)](
        x_args[0], w_args[0], y_RN, offsets_E,
        x_args[-1] if pair == 1 else x_args[0], w_args[-1], ys[-1],
        R, N, K, E, grid, *flips,
        x_RK.stride(0), w0.stride(0), w0.stride(1), w0.stride(2), y_RN.stride(0),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        E_BLOCK=triton.next_power_of_2(E), W_K_CONTIGUOUS=k_contiguous,
        EVEN_K=K % cfg.block_k == 0, USE_TMA=use_tma, PRECISION=_precision(x_RK.dtype), PAIR=pair,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def rows_mm(
    x_RK: torch.Tensor, w_EKN: torch.Tensor, offsets_E: torch.Tensor,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``y[r] = x[r] @ w[g(r)]`` for rows below ``offsets[-1]``; later rows are left unset.

    ``w_EKN`` may be contiguous in K or in N (a transposed view of a ``[E, N, K]``
    weight is read in place).
    """
    _check_rows_operands(x_RK, w_EKN, offsets_E)
    x_RK = x_RK.contiguous()
    y_RN = torch.empty(x_RK.shape[0], w_EKN.shape[2], dtype=x_RK.dtype, device=x_RK.device)
    _launch_rows((x_RK,), (w_EKN,), (y_RN,), offsets_E, config, pair=0)
    return y_RN


def rows_mm_sum2(
    x0_RK: torch.Tensor, w0_EKN: torch.Tensor, x1_RK: torch.Tensor, w1_EKN: torch.Tensor,
    offsets_E: torch.Tensor, config: TileConfig | None = None,
) -> torch.Tensor:
    """``y[r] = x0[r] @ w0[g(r)] + x1[r] @ w1[g(r)]`` in one GEMM over the joint reduction
    (FP32 accumulator, one rounding); rows past ``offsets[-1]`` are left unset."""
    for x, w in ((x0_RK, w0_EKN), (x1_RK, w1_EKN)):
        _check_rows_operands(x, w, offsets_E)
    if x0_RK.shape != x1_RK.shape or w0_EKN.shape != w1_EKN.shape or x0_RK.dtype != x1_RK.dtype:
        raise ValueError(
            f"grouped GEMM pair: x {tuple(x0_RK.shape)} / {tuple(x1_RK.shape)} and w "
            f"{tuple(w0_EKN.shape)} / {tuple(w1_EKN.shape)} must match"
        )
    xs = (x0_RK.contiguous(), x1_RK.contiguous())
    y_RN = torch.empty(x0_RK.shape[0], w0_EKN.shape[2], dtype=x0_RK.dtype, device=x0_RK.device)
    _launch_rows(xs, (w0_EKN, w1_EKN), (y_RN,), offsets_E, config, pair=1)
    return y_RN


def rows_mm_split2(
    x_RK: torch.Tensor, w0_EKN: torch.Tensor, w1_EKN: torch.Tensor, offsets_E: torch.Tensor,
    config: TileConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w0[g], x @ w1[g])`` per row in one launch (one work list over both outputs);
    rows past ``offsets[-1]`` are left unset."""
    for w in (w0_EKN, w1_EKN):
        _check_rows_operands(x_RK, w, offsets_E)
    if w0_EKN.shape != w1_EKN.shape:
        raise ValueError(f"grouped GEMM pair: w {tuple(w0_EKN.shape)} / {tuple(w1_EKN.shape)} must match")
    x_RK = x_RK.contiguous()
    ys = tuple(torch.empty(x_RK.shape[0], w0_EKN.shape[2], dtype=x_RK.dtype, device=x_RK.device)
               for _ in range(2))
    _launch_rows((x_RK,), (w0_EKN, w1_EKN), ys, offsets_E, config, pair=2)
    return ys


def _wgrad_operands(
    x_RK: torch.Tensor, dy_RN: torch.Tensor, like_EKN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(a, b, transposed)``: the kernel computes ``a_g^T @ b_g`` row-major, so for a
    weight stored ``[E, N, K]`` (K contiguous) it takes ``dy_g^T @ x_g``, the transpose."""
    _check("x", x_RK, 2)
    _check("dy", dy_RN, 2)
    _check("like", like_EKN, 3)
    E, K, N = like_EKN.shape
    if x_RK.shape[1] != K or dy_RN.shape != (x_RK.shape[0], N):
        raise ValueError(
            f"grouped weight gradient: x {tuple(x_RK.shape)}, dy {tuple(dy_RN.shape)} and weight "
            f"{tuple(like_EKN.shape)} do not match"
        )
    x_RK, dy_RN = _row_major(x_RK), _row_major(dy_RN)
    transposed = like_EKN.stride(1) == 1 and like_EKN.stride(2) != 1
    return (dy_RN, x_RK, True) if transposed else (x_RK, dy_RN, False)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the weight-gradient kernel can read it in place (rows of unit-stride
    elements, any row stride at least the width: e.g. the gate half of ``[R, 2F]``
    gate/up gradients), else a contiguous copy. Reading a column slice in place saves a
    copy of it per microbatch (two of ``[R, F]`` per FP8 expert layer)."""
    ok = t.shape[1] <= 1 or t.stride(1) == 1
    return t if ok and t.stride(0) >= t.shape[1] else t.contiguous()


def _same_row_strides(sources: list[WgradOperands]) -> list[WgradOperands]:
    """The sources with one row stride for all ``a`` and one for all ``b`` (the kernel takes
    the first source's): the others as they are where they match, else all contiguous."""
    a0, b0, _ = sources[0]
    if all(a.stride(0) == a0.stride(0) and b.stride(0) == b0.stride(0) for a, b, _ in sources):
        return sources
    return [(a.contiguous(), b.contiguous(), offsets) for a, b, offsets in sources]


def _element_offset(base: torch.Tensor, other: torch.Tensor) -> int:
    """Where ``other`` starts, in elements from ``base``'s start (same device and dtype)."""
    gap = other.data_ptr() - base.data_ptr()
    if gap % base.element_size():
        raise ValueError("grouped weight gradient: operands are not element-aligned with each other")
    return gap // base.element_size()


WgradOperands = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (a, b, offsets) of one source
MAX_WGRAD_SOURCES = 4  # batches of rows one weight-gradient launch reduces over


def _launch_wgrad(
    sources: list[WgradOperands], c: torch.Tensor, E: int,
    config: TileConfig | None, accumulate: tuple[int, int] | None,
) -> None:
    """``c[g] = sum_s a_(s,g)^T @ b_(s,g)`` (``c`` [E, M, N]) over up to
    ``MAX_WGRAD_SOURCES`` sources, or, with ``accumulate=(piece, stride)``, ``+=`` into the
    FP32 accumulator ``c`` laid out as ``_grouped_mm_kernels.wgrad_kernel`` says. The
    sources come from ``_wgrad_operands`` for one weight: rows of unit-stride elements, of
    the same widths and (``_same_row_strides``) the same row strides."""
    a, b, offsets_E = sources[0]
    M, Nc = a.shape[1], b.shape[1]
    long = sum(src[0].shape[0] for src in sources) >= LONG_REDUCTION_ROWS * E
    cfg = config or default_config("wgrad_long" if long else "wgrad", a.device, a.dtype)
    triton, _, wgrad_kernel = _kernels()
    grid = E * triton.cdiv(M, cfg.block_m) * triton.cdiv(Nc, cfg.block_n)
    if not grid:
        return
    strides = (0, 0, 0) if accumulate else (c.stride(0), c.stride(1), c.stride(2))
    piece, stride_piece = accumulate or (Nc, 0)
    # every output row of the accumulator starts on 16 bytes (4 FP32 elements): rows
    # start at owner * stride_piece + row * Nc elements from an aligned base
    aligned = accumulate is not None and Nc % 4 == 0 and stride_piece % 4 == 0 and c.data_ptr() % 16 == 0
    further: list[object] = []  # (a_s from a, b_s from b, offsets_s) of sources 1..3, as scalars
    for s in range(1, MAX_WGRAD_SOURCES):
        a_s, b_s, offsets_s = sources[s] if s < len(sources) else (a, b, offsets_E)
        further += (_element_offset(a, a_s), _element_offset(b, b_s), offsets_s)
    wgrad_kernel[(grid,)](
        a, b, c, offsets_E, *further,
        M, Nc, E,
        a.stride(0), b.stride(0), *strides, piece, stride_piece,
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m,
        PRECISION=_precision(a.dtype), ACCUMULATE=accumulate is not None, WHOLE_ROWS=piece % Nc == 0,
        ALIGNED=aligned, ONE_CUT=piece // Nc >= cfg.block_m, SOURCES=len(sources),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def wgrad_mm(
    x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_E: torch.Tensor, like_EKN: torch.Tensor,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``dw[g] = x_g^T @ dy_g`` as an ``[E, K, N]`` tensor laid out like ``like_EKN``."""
    E = like_EKN.shape[0]
    a, b, transposed = _wgrad_operands(x_RK, dy_RN, like_EKN)
    c_EMN = torch.empty(E, a.shape[1], b.shape[1], dtype=like_EKN.dtype, device=a.device)
    _launch_wgrad([(a, b, offsets_E)], c_EMN, E, config, None)
    return c_EMN.transpose(1, 2) if transposed else c_EMN


def wgrad_accumulate_(
    target: torch.Tensor, x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_E: torch.Tensor,
    like_EKN: torch.Tensor, config: TileConfig | None = None,
    more: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
) -> None:
    """``target += dw`` for the weight ``like_EKN`` is a view of, in the kernel's epilogue.

    ``more``: up to ``MAX_WGRAD_SOURCES - 1`` further ``(x, dy, offsets)`` batches of rows
    (e.g. the next microbatches') whose gradients join the same reduction, ``target += dw
    + dw_1 + ...`` rounded once, in one launch: one read-modify-write of ``target`` for all.

    ``target`` is FP32 and holds the weight's elements in its *storage* order (the
    ``[E, N, K]`` order for a K-contiguous view): flat, or as ``[rows, cols]`` with
    contiguous rows read row by row (an owner-major gradient bucket). No ``dw``
    tensor exists, and no separate accumulation pass reads one: this is how
    gradient accumulation in FP32 main grads costs no extra memory traffic.
    """
    piece, stride = accumulator_layout(target, like_EKN.numel(), "wgrad_accumulate_")
    if not (like_EKN.is_contiguous() or like_EKN.transpose(1, 2).is_contiguous()):
        raise ValueError("wgrad_accumulate_: the weight must be contiguous in its storage order, "
                         f"got strides {like_EKN.stride()}")
    if target.device != x_RK.device:
        raise ValueError(f"wgrad_accumulate_: target is on {target.device}, x on {x_RK.device}")
    if len(more) >= MAX_WGRAD_SOURCES:
        raise ValueError(f"wgrad_accumulate_: {1 + len(more)} batches of rows; one launch takes "
                         f"1 to {MAX_WGRAD_SOURCES}")
    sources = []
    for x, dy, offsets in ((x_RK, dy_RN, offsets_E), *more):
        if (x.device, x.dtype, dy.dtype) != (x_RK.device, x_RK.dtype, dy_RN.dtype):
            raise ValueError(
                f"wgrad_accumulate_: x/dy of a later batch of rows ({x.dtype}/{dy.dtype} on {x.device}) "
                f"differ from the first's ({x_RK.dtype}/{dy_RN.dtype} on {x_RK.device})"
            )
        if offsets.shape != (like_EKN.shape[0],):
            raise ValueError(f"wgrad_accumulate_: offsets {tuple(offsets.shape)} do not match the "
                             f"weight's {like_EKN.shape[0]} experts")
        a, b, _ = _wgrad_operands(x, dy, like_EKN)
        sources.append((a, b, offsets))
    _launch_wgrad(_same_row_strides(sources), target, like_EKN.shape[0], config, (piece, stride))


# ----------------------------------------------------------------- custom ops
@torch.library.custom_op("moe_model::triton_grouped_mm", mutates_args=())
def triton_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Differentiable ``y[r] = x[r] @ w[g(r)]`` (``x [R,K]``, ``w [E,K,N]``, ``offsets [E]`` int32)."""
    return rows_mm(x, w, offsets)


@triton_grouped_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


@torch.library.custom_op("moe_model::triton_grouped_mm_wgrad", mutates_args=())
def _wgrad_op(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return wgrad_mm(x, dy, offsets, like)


@_wgrad_op.register_fake
def _(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(like)


@torch.library.custom_op("moe_model::triton_grouped_mm_split2", mutates_args=())
def triton_grouped_mm_split2(
    x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w0[g], x @ w1[g])`` in one launch (``rows_mm_split2``). Not differentiable
    itself: ``moe_model.experts`` wraps it with its own backward (one GEMM for the input
    gradient); a custom op so that selective recompute can keep its outputs."""
    return rows_mm_split2(x, w0, w1, offsets)


@triton_grouped_mm_split2.register_fake
def _(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[0], w0.shape[-1]), x.new_empty(x.shape[0], w1.shape[-1])


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor) -> tuple:
    x, w, offsets = ctx.saved_tensors
    need = grads_needed(ctx)  # dx or dw only in a split (zero-bubble) backward
    dx = triton_grouped_mm(dy, w.transpose(1, 2), offsets) if need[0] else None
    dw = _wgrad_op(x, dy, offsets, w) if need[1] else None
    return dx, dw, None


triton_grouped_mm.register_autograd(_backward, setup_context=_setup_context)
