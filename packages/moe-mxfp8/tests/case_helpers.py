"""Helpers of the Triton case files and the GPU tests: sample rows, count mismatching
elements, report a case file's results. Importable in either Triton mode: the case
files run under the interpreter, the GPU tests do not."""

from __future__ import annotations

import json
import traceback

import torch


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows over many magnitudes with special values sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if dtype == torch.float16:
        x = x * torch.exp2(torch.randint(-20, 12, (*shape[:-1], 1), generator=g).float())
    else:
        x = x * torch.exp2(torch.randint(-140, 120, (*shape[:-1], 1), generator=g).float())
    flat = x.view(-1)
    flat[:40] = 0.0
    flat[41] = -0.0
    flat[50] = 6e4 if dtype == torch.float16 else 1e30
    flat[60:70] = torch.randn(10, generator=g) * (1e-6 if dtype == torch.float16 else 1e-40)
    flat[100] = float("inf")
    flat[130] = float("nan")
    flat[200:240] = 448.0
    flat[300] = -float("inf")
    return x.to(dtype)


def mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bits differ (a NaN against a NaN counts as equal); -1 where the
    shapes or dtypes differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    both_nan = a.float().isnan() & b.float().isnan()
    return int(((a.view(as_int) != b.view(as_int)) & ~both_nan).sum())


def report(named_cases) -> None:
    """Run every ``(name, fn)`` case; print one JSON line (name -> its result, or the
    traceback of an exception, reported to the parent test), then ``ok``."""
    results = {}
    for name, fn in named_cases:
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    print(json.dumps(results))
    print("ok")
