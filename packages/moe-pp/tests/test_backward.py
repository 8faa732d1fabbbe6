"""The input/weight backward split equals one full backward, through AccumulateGrad."""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import pytest
import torch
from moe_model import MoEConfig, MoETransformer, init_weights, lm_loss_sum, set_aux_loss_scale
from moe_pp import backward_input, backward_weight
from torch import nn


class Reused(nn.Module):
    """One weight used twice with input-path work in between (a multi-boundary group)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(torch.tanh(x @ self.w))) @ self.w


class _Square(torch.autograd.Function):
    """A custom Function, as moe_model's fused CUDA kernels are: its backward node is a
    Python ``BackwardCFunction`` (no ``_input_metadata``) that can sit on a boundary."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _Scale(torch.autograd.Function):
    """``x * gain`` as a custom Function taking a parameter, like a fused RMSNorm: its
    node has an input-path child and a weight-only child, so it is a boundary."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, gain)
        return x * gain

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, gain = ctx.saved_tensors
        return grad * gain, (grad * x).sum(0)


class WithCustomFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Square.apply(self.a(_Square.apply(x)))
        return self.b(_Square.apply(_Scale.apply(h, self.gain)))


class CustomFunctionOnTop(nn.Module):
    """The stage's last op is a custom Function on a weight boundary (a final fused
    RMSNorm, say): no built-in root above it keeps its node alive once the stage
    outputs are dropped (torch 2.11)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(self.a(x), self.gain)


def test_outputs_are_kept_only_when_a_root_would_die_with_them():
    """The weight pass holds the stage outputs (the whole graph) only when a custom
    Function root has no built-in root above it; otherwise memory is freed as before.
    Checked on the decision itself, since torch 2.15 would not fail without it."""
    for model, kept in ((CustomFunctionOnTop(), True), (WithCustomFunctions(), False),
                        (nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), False)):
        x = torch.randn(4, 8, requires_grad=True)
        y = model(x)
        _, work = backward_input([y], [torch.randn_like(y)], x, list(model.parameters()))
        assert bool(work.keepalive) == kept, type(model).__name__
        backward_weight(work)
        assert work.keepalive == ()


def _moe(part: str) -> nn.Module:
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16, lb_loss_coef=0.1)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=0)
    set_aux_loss_scale(model, 1 / 16)
    if part == "middle":
        model.embed = model.norm = model.head = None
    return model


TOKENS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor], Callable]] = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8)),
            lambda: torch.randn(4, 8), lambda m, x: m(x)),
    "reused_weight": (Reused, lambda: torch.randn(4, 8), lambda m, x: m(x)),
    "custom_functions": (WithCustomFunctions, lambda: torch.randn(4, 8), lambda m, x: m(x)),
    "custom_function_on_top": (CustomFunctionOnTop, lambda: torch.randn(4, 8), lambda m, x: m(x)),
    "first_stage_tokens": (lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8)),
                           lambda: torch.randint(0, 10, (4,)), lambda m, x: m(x)),
    "moe_middle_stage_with_aux_loss": (lambda: _moe("middle"), lambda: torch.randn(2, 8, 32),
                                       lambda m, x: m(x)),
    "moe_last_stage_loss": (lambda: _moe("full"), lambda: TOKENS[:, :-1],
                            lambda m, x: lm_loss_sum(m(x), TOKENS[:, 1:]) / 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_backward_equals_full_backward(case):
    make, make_input, run = CASES[case]
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    x = make_input()
    needs_grad = x.is_floating_point()

    x_ref = x.clone().requires_grad_(needs_grad)
    y_ref = run(reference, x_ref)
    grad_y = torch.randn_like(y_ref) if y_ref.dim() else None
    torch.autograd.backward([y_ref], [grad_y])

    accumulated: list[str] = []
    names = {p: n for n, p in model.named_parameters()}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda t: accumulated.append(names[t]))
    x_split = x.clone().requires_grad_(needs_grad)
    y = run(model, x_split)
    dx, work = backward_input([y], [grad_y], x_split if needs_grad else None,
                              list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()), "the input pass must not touch weights"
    if needs_grad:
        torch.testing.assert_close(dx, x_ref.grad, rtol=1e-6, atol=0)
    else:
        assert dx is None
    # The runtime drops the stage outputs after the input pass: the weight pass must not
    # depend on them (a custom Function's node is only weakly held by its Python object).
    del y
    gc.collect()
    backward_weight(work)

    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        ref = ref_params[name].grad
        if ref is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-9, msg=name)
    with_grad = sorted(n for n, p in ref_params.items() if p.grad is not None)
    assert sorted(accumulated) == with_grad, "every gradient goes through AccumulateGrad once"
