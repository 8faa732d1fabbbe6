"""Optional payload encoding for dispatched rows (declared here, implemented elsewhere).

A codec shrinks the bytes moved by the forward dispatch (MXFP8 packs a BF16 row
into about half). It encodes each token once at the source, the transport moves
the packed bytes, and the destination decodes. Gradients pass straight through
(the backward moves rows in the activation dtype), as for any quantised transport.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RowCodec(Protocol):
    def packed_width(self, d: int) -> int:
        """Bytes per encoded row of width ``d``."""
        ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows[R, D]`` -> ``uint8[R, packed_width(D)]``."""
        ...

    def decode(self, packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``uint8[R, W]`` -> ``[R, D]`` of ``dtype``."""
        ...


def bytes_per_row(d_model: int, dtype: torch.dtype, codec: RowCodec | None = None) -> int:
    """Bytes one dispatched row occupies on the wire."""
    if codec is not None:
        return codec.packed_width(d_model)
    return d_model * dtype.itemsize
