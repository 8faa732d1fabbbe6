"""The public-API contract every fused op of moe_model keeps, checked on CPU in the test
process (no kernel runs; the kernels themselves are checked through ``backend="triton"``
by the ``_*_interpret_check.py`` scripts under the Triton interpreter).

``op(..., backend="reference")`` and ``op(..., backend="auto")`` (on CPU) give exactly
what ``op_reference(...)`` gives, forward and gradients; an unknown backend raises a
``ValueError`` naming it and the choices; ``backend="triton"`` on CPU outside the
interpreter fails with one line; under ``use_reference_kernels(True)`` it gives the
reference instead, and so does ``"auto"`` even where the kernels would run (a CUDA device
is stood in for by making ``fused_kernels_enabled`` say yes).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from moe_model import KERNEL_BACKENDS, _triton_support, use_reference_kernels


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _run(op: Callable[..., Any], make_args: Callable[[], tuple], out: Callable[[Any, tuple], Any],
         **backend: str) -> list[torch.Tensor]:
    """The op's outputs (``out(result, args)``) and the gradients of a fixed function of
    them with respect to the arguments that require one."""
    args = make_args()
    outputs = _tensors(out(op(*args, **backend), args))
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    differentiable = [o for o in outputs if o.requires_grad]
    if not inputs or not differentiable:
        return [o.detach() for o in outputs]
    loss = sum((o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape)).sum()
               for o in differentiable)
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [o.detach() for o in outputs] + [g for g in grads if g is not None]


def check_backend_api(op: Callable[..., Any], reference: Callable[..., Any], make_args: Callable[[], tuple],
                      out: Callable[[Any, tuple], Any] = lambda result, args: result) -> None:
    """The contract above for ``op`` and ``reference`` on fresh arguments from
    ``make_args`` (an in-place op names what it wrote through ``out``)."""
    with use_reference_kernels(False):
        want = _run(reference, make_args, out)
        assert want, "the op gave no tensor to compare"
        for backend in ("reference", "auto"):
            got = _run(op, make_args, out, backend=backend)
            assert len(got) == len(want), f"backend={backend!r}: {len(got)} tensors, the reference {len(want)}"
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), f"backend={backend!r} differs from the reference"
        with pytest.raises(ValueError, match=re.escape(f"unknown backend 'cuda'; expected one of {KERNEL_BACKENDS}")):
            op(*make_args(), backend="cuda")
        with pytest.raises(RuntimeError, match="backend='triton' needs"):
            op(*make_args(), backend="triton")
        with use_reference_kernels(True):
            under_switch = {"triton": _run(op, make_args, out, backend="triton")}
            with mock.patch.object(_triton_support, "fused_kernels_enabled", lambda device: True):
                under_switch["auto"] = _run(op, make_args, out, backend="auto")
    for backend, got in under_switch.items():
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"backend={backend!r} under use_reference_kernels(True) is not the reference"
