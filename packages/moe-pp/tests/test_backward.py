"""The input/weight backward split equals one full backward, through AccumulateGrad."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, lm_loss_sum, wire_model
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


class _LinearOp(torch.autograd.Function):
    """``x @ w.T`` as a custom Function, like moe_model's fused linear layers (the head)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class _CrossEntropySum(torch.autograd.Function):
    """A token-loss sum that saves the logits, as the fused cross-entropy does."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        return nn.functional.cross_entropy(logits, targets, reduction="sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets = ctx.saved_tensors
        probs = logits.softmax(-1)
        probs[torch.arange(len(targets)), targets] -= 1
        return probs * grad, None


class CustomHeadLoss(nn.Module):
    """A last stage whose head and loss are custom Functions: the head is a root with no
    built-in root above it, so the outputs are kept for the weight pass (torch 2.11)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Parameter(torch.randn(50, 8) / 3)
        self.targets = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CrossEntropySum.apply(_LinearOp.apply(x, self.head), self.targets) / 16


class CustomFunctionUnderASkip(nn.Module):
    """A custom-Function root on top with a residual around it: the input pass cannot run
    the nodes above the roots on their own (an autograd call stopping at the input would
    run the root), so the outputs are kept whole."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = CustomFunctionOnTop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2 + x


class _FirstOnly(torch.autograd.Function):
    """``a + 0 * b`` whose backward gives ``b`` no gradient."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + 0 * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class CustomRootUnderAGradientlessBoundary(nn.Module):
    """A custom root whose only built-in root above it gets no gradient in the input pass:
    no weight pass holds that boundary, so it keeps nothing alive (torch 2.11)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.rand(8) + 0.5)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = _Scale.apply(x * 1.0, self.gain)
        return _FirstOnly.apply(c, c @ self.w)


def test_outputs_are_kept_only_when_a_root_would_die_with_them():
    """The weight pass holds the stage outputs only when a custom Function root has no
    built-in root above it; otherwise they are freed after the input pass.
    Checked on the decision itself, since torch 2.15 would not fail without it."""
    for model, kept in ((CustomFunctionOnTop(), True), (CustomHeadLoss(), True),
                        (CustomRootUnderAGradientlessBoundary(), True),
                        (WithCustomFunctions(), False),
                        (nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), False)):
        x = torch.randn(16, 8, requires_grad=True)
        y = model(x)
        _, work = backward_input([y], [torch.randn_like(y)], x, list(model.parameters()))
        assert bool(work.keepalive) == kept, type(model).__name__
        backward_weight(work)
        assert work.keepalive == ()


def test_kept_outputs_do_not_hold_what_the_nodes_above_the_roots_saved():
    """The outputs kept for the weight pass hold the loss's node, but it has run and
    freed its saved logits ([N, V] on a real last stage), which the weight pass never
    reads; the weight gradient is still the full backward's."""
    model = CustomHeadLoss()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 8)
    x_ref = x.clone().requires_grad_()
    reference(x_ref).backward()

    x = x.clone().requires_grad_()
    logits = _LinearOp.apply(x, model.head)
    alive = weakref.ref(logits)
    loss = _CrossEntropySum.apply(logits, model.targets) / 16
    del logits
    dx, work = backward_input([loss], [None], x, [model.head])
    assert work.keepalive, "the case under test: the head root needs the outputs kept"
    del loss
    gc.collect()
    assert alive() is None, "the logits the loss saved are alive until the weight pass"
    assert model.head.grad is None
    backward_weight(work)
    torch.testing.assert_close(dx, x_ref.grad, rtol=1e-6, atol=0)
    torch.testing.assert_close(model.head.grad, reference.head.grad, rtol=1e-6, atol=0)


def _moe(part: str) -> nn.Module:
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16, lb_loss_coef=0.1)
    model = MoETransformer(cfg)
    init_weights(model, cfg, seed=0)
    wire_model(model, ModelWiring(aux_loss_scale=1 / 16))
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
    "custom_head_and_loss": (CustomHeadLoss, lambda: torch.randn(16, 8), lambda m, x: m(x)),
    "custom_function_under_a_skip": (CustomFunctionUnderASkip, lambda: torch.randn(4, 8),
                                     lambda m, x: m(x)),
    "custom_root_under_a_gradientless_boundary": (CustomRootUnderAGradientlessBoundary,
                                                  lambda: torch.randn(4, 8), lambda m, x: m(x)),
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
