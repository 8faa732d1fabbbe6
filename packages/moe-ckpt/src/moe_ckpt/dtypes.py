"""Element types: torch dtype <-> zarr v3 ``data_type`` name <-> NumPy array.

NumPy has no bfloat16; tensorstore ships one (``ts.bfloat16.numpy_dtype``), and a
torch bf16 tensor reaches it without a copy through an int16 view of the same bytes.
"""

from __future__ import annotations

import numpy as np
import tensorstore as ts
import torch

_ZARR_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {name: dtype for dtype, name in _ZARR_NAMES.items()}
_BF16_NUMPY = ts.bfloat16.numpy_dtype


def zarr_name(dtype: torch.dtype, tensor: str) -> str:
    """The zarr v3 data type name of ``dtype``; raises naming ``tensor`` if unsupported."""
    try:
        return _ZARR_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"tensor {tensor!r}: dtype {dtype} is not supported "
            f"(supported: {', '.join(str(d) for d in _ZARR_NAMES)})"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise TypeError(f"unknown stored dtype {name!r}") from None


def itemsize(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor (same memory, strides kept)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NUMPY)
    return t.numpy()


def from_numpy(a: np.ndarray, name: str) -> torch.Tensor:
    """A torch view of a NumPy array read from storage with zarr dtype ``name``."""
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)
