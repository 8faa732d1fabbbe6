"""``check_backend_api`` against a stand-in package: it passes an op that keeps the
kernel convention and fails each way an op can break it (so the per-package tests that
use it are not hollow)."""

from __future__ import annotations

import os
import types

import pytest
import torch
from moe_testing import check_backend_api, same_bits

CHOICES = ("auto", "triton", "reference")


def _support() -> types.SimpleNamespace:
    """A ``_triton_support`` stand-in: Triton 'installed', the switch a flag."""
    state = types.SimpleNamespace(switch=False)

    class use_reference_kernels:
        def __init__(self, on: bool) -> None:
            self.previous, state.switch = state.switch, on

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            state.switch = self.previous

    state.use_reference_kernels = use_reference_kernels
    state.triton_available = lambda: True
    state.fused_kernels_enabled = lambda device: device.type == "cuda" and not state.switch
    return state


def _op(support, *, honour_switch: bool = True, message: str = "backend must be one of"):
    def kernel(x: torch.Tensor) -> torch.Tensor:  # the 'fused' path: a different rounding
        return (x * 2).bfloat16().float()

    def reference(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def op(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        if backend not in CHOICES:
            raise ValueError(f"{message} {', '.join(map(repr, CHOICES))}, got {backend!r}")
        if backend == "reference" or (honour_switch and support.switch):
            return reference(x)
        if backend == "auto":
            return kernel(x) if support.fused_kernels_enabled(x.device) else reference(x)
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("backend='triton' needs CUDA tensors, got cpu tensors")
        return kernel(x)

    return op, reference


def _args() -> tuple[torch.Tensor]:
    return (torch.linspace(-1, 1, 7, requires_grad=True) / 3,)


def test_a_conforming_op_passes():
    support = _support()
    op, reference = _op(support)
    check_backend_api(support, op, reference, _args)
    assert not support.switch


@pytest.mark.parametrize("broken", ["ignores the switch", "another message"])
def test_a_broken_op_fails(broken):
    support = _support()
    op, reference = (_op(support, honour_switch=False) if broken == "ignores the switch"
                     else _op(support, message="pick one of"))
    with pytest.raises(AssertionError):
        check_backend_api(support, op, reference, _args)


def test_same_bits_walks_results_and_sees_nan_and_dtype():
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits((nan, [nan.clone()]), (nan.clone(), [nan]))
    assert not same_bits(nan, nan.double())
    assert not same_bits((nan,), (nan, nan))
