"""Derived low-precision copies of a weight, in the two orientations its GEMMs reduce over.

The weight (a parameter the optimizer owns, rebuilt each step from the FP32 main
weight) stays the only source of truth. The cache is a pure function of it:
``refresh()`` re-quantizes the weight rounded to BF16, so a layer sees the same
quantized values whether the optimizer keeps BF16 compute weights or FP32 parameters.
Nothing ever updates the cache on its own. ``check_fresh()`` catches a cache that
was not refreshed after the weight changed (an optimizer step, a checkpoint load,
a device move, a parameter replaced by another, e.g. ``load_state_dict(assign=True)``)
by comparing the owner's current parameters (which objects, their storage and version
counters) with those recorded at the last refresh; the layers call it on every
forward, and refresh from their current parameters. A write through ``.data`` bumps
no version counter: call ``refresh_weight_cache()`` after one.

Orientation, for a weight stored ``[..., out, in]``: ``rows`` is blocked along the
last dim (the forward GEMM reduces over ``in``), ``cols`` along dim -2 (the
input-gradient GEMM reduces over ``out``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe_mxfp8.format import BLOCK_SIZE, MXFP8Tensor, quantize_rows_and_cols
from moe_mxfp8.fp8 import cat_parts

CACHE_SOURCE_DTYPE = torch.bfloat16  # the compute-weight dtype the cache is derived from


Params = tuple[nn.Parameter, ...]


def _stamp(params: Params) -> tuple[tuple[int, int, int, torch.device], ...]:
    return tuple((id(p), p.data_ptr(), p._version, p.device) for p in params)


def _tensors(copies: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors of quantized copies (``MXFP8Tensor`` / ``FP8Tensor`` fields), in order."""
    return [v for c in copies for v in vars(c).values() if isinstance(v, torch.Tensor)]


def _source_layout(params: Params) -> tuple[tuple[tuple[int, ...], torch.device], ...]:
    """What fixes the copies' shapes: the parameters' shapes and devices (the copies derive
    from their BF16 values, whatever their dtype)."""
    return tuple((tuple(p.shape), p.device) for p in params)


class WeightCache:
    """Derived copies (``rows``/``cols``) of ``cat(params, dim=-2)`` (one param, or e.g. gate
    and up); subclasses say how a copy is derived (``_derive``).

    ``params`` are the owner's parameters, passed again to ``refresh`` and ``check_fresh``
    as they are then (the owner may have been given new parameter objects).
    """

    def __init__(self, params: Params) -> None:
        if not params:
            raise ValueError(f"{type(self).__name__} needs at least one parameter")
        self.rows: Any = None
        self.cols: Any = None
        self._stamp: tuple[tuple[int, int, int, torch.device], ...] = ()
        self._source: tuple[tuple[tuple[int, ...], torch.device], ...] = ()
        self.refresh(params)

    def _derive(self, parts: list[torch.Tensor], into: tuple[Any, Any] | None) -> tuple[Any, Any]:
        """``(rows, cols)`` of the BF16 weight ``cat(parts, dim=-2)`` ``[..., out, in]``.
        ``into``: the current copies, when refreshing in place from parameters of unchanged
        shapes and devices (so they have the layout these parts derive); a subclass may write
        the new values into them and return them (no second copy), or return new ones."""
        raise NotImplementedError

    @torch.no_grad()
    def refresh(self, params: Params, in_place: bool = False) -> None:
        """Re-derive both orientations from the current weight values.

        ``in_place``: keep the current cache tensors where shapes, dtypes and devices are
        unchanged, so their addresses stay (what a captured CUDA graph reads), writing the
        new values into them; a backward of a forward run before the refresh then sees the
        new values. Otherwise the cache gets new tensors.
        """
        parts = [p.detach().to(CACHE_SOURCE_DTYPE) for p in params]
        source = _source_layout(params)
        into = (self.rows, self.cols) if in_place and source == self._source else None
        rows, cols = self._derive(parts, into)
        if into is None:
            self.rows, self.cols = rows, cols
        elif not (rows is into[0] and cols is into[1]):
            for old, new in zip(_tensors(into), _tensors((rows, cols)), strict=True):
                old.copy_(new)
        self._source = source
        self._stamp = _stamp(params)

    def check_fresh(self, owner: str, params: Params) -> None:
        """Raise if a parameter changed (values, storage, device, or the object itself)
        since the last refresh."""
        if _stamp(params) != self._stamp:
            raise RuntimeError(
                f"{owner}: the weights changed since the weight cache was built; call "
                "refresh_weight_cache() after every weight update (register "
                "moe_mxfp8.refresh_weight_caches as the optimizer's weights-updated hook)"
            )

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.cols.nbytes


class MXFP8WeightCache(WeightCache):
    """MXFP8 ``rows`` (blocked along the last dim) and ``cols`` (along dim -2)."""

    def __init__(self, params: Params, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        super().__init__(params)

    def _derive(self, parts: list[torch.Tensor], into: tuple[Any, Any] | None
                ) -> tuple[MXFP8Tensor, MXFP8Tensor]:
        return quantize_rows_and_cols(cat_parts(parts), self.block_size)
