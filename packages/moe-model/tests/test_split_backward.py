"""A backward split in an input pass and a weight pass (a pipeline's zero-bubble schedule)
over moe_model's custom autograd Functions: each pass computes only the gradients it uses
(``moe_model.backward_needs``), so each GEMM or kernel runs once over both passes, and
the gradients are bit for bit those of one full backward.

The Functions that run on CPU are checked here (``_RouterLogits`` with its FP32-output GEMM
emulated, ``_LinearsIntoSink``, ``_GroupedMMIntoSink`` over the loop backend); the Triton
ones (the paired gate/up GEMM, the grouped GEMM custom op, the fused norms) under the
Triton interpreter (``_split_backward_interpret_check.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import experts, router
from moe_model.backward_needs import engine_will_run, grads_needed
from moe_model.linear import _LinearsIntoSink
from moe_testing import run_under_triton_interpreter
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._python_dispatch import TorchDispatchMode


class _Probe(torch.autograd.Function):
    """``x * w * eps`` with a non-tensor input between the tensors; records ``grads_needed``."""

    seen: list[tuple[bool, ...]] = []

    @staticmethod
    def forward(ctx, x, tag, w, eps):  # noqa: ANN001, ANN205
        return x * w * eps

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        need = grads_needed(ctx, (0, 2))
        _Probe.seen.append(need)
        return (g if need[0] else None), None, (g if need[2] else None), None


def _probe_needs(run) -> tuple[bool, ...]:  # noqa: ANN001
    _Probe.seen.clear()
    run()
    (need,) = _Probe.seen
    return need


def test_grads_needed_follows_the_engine():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = _Probe.apply(x, "tag", w, 2.0).sum()
    assert _probe_needs(lambda: y.backward(retain_graph=True)) == (True, False, True, False)
    # torch.autograd.grad toward a leaf: torch refuses to say; a captured gradient is wanted
    assert _probe_needs(lambda: torch.autograd.grad(y, x, retain_graph=True)) == (True, False, False, False)
    assert _probe_needs(lambda: torch.autograd.grad(y, w, retain_graph=True)) == (False, False, True, False)
    assert _probe_needs(lambda: y.backward(inputs=[x], retain_graph=True)) == (True, False, False, False)
    assert _probe_needs(lambda: y.backward(inputs=[w], retain_graph=True)) == (False, False, True, False)
    # a non-leaf input, captured by torch.autograd.grad or run through
    x2 = x * 3
    y2 = _Probe.apply(x2, "tag", w, 2.0).sum()
    assert _probe_needs(lambda: torch.autograd.grad(y2, x2, retain_graph=True)) == (True, False, False, False)
    assert _probe_needs(lambda: torch.autograd.grad(y2, x, retain_graph=True)) == (True, False, False, False)
    assert _probe_needs(lambda: torch.autograd.grad(y2, w, retain_graph=True)) == (False, False, True, False)
    # an input that needs no gradient (no edge)
    y3 = _Probe.apply(x.detach(), "tag", w, 2.0).sum()
    assert _probe_needs(lambda: y3.backward()) == (False, False, True, False)
    # outside a backward run the engine cannot tell: assume the gradient is wanted
    assert engine_will_run(get_gradient_edge(w).node)


def test_grads_needed_checks_the_tensor_positions():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, tag, w):  # noqa: ANN001, ANN205
            return x * w

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            grads_needed(ctx, (0,))
            return g, None, g

    x, w = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="1 tensor input positions given, the Function has 2"):
        Bad.apply(x, "tag", w).sum().backward()


class _CountMM(TorchDispatchMode):
    """Counts the GEMMs dispatched (``mm``, ``addmm``, and ``addmm_``)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default,
           torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out, torch.ops.aten.mm.out)

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func in self.OPS:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _split_passes(out, dout, inputs, weights, *, weight_pass="grad"):  # noqa: ANN001, ANN202
    """(input grads, weight grads, GEMMs of the input pass, GEMMs of the weight pass).

    ``weight_pass``: ``grad`` (``torch.autograd.grad`` toward the weights), or ``edge``: as
    moe_pp does, the weight pass restarts at the output's node (a ``GradientEdge`` root) and
    accumulates into ``.grad`` through ``backward(inputs=weights)``."""
    with _CountMM() as a:
        d_in = torch.autograd.grad(out, inputs, dout, retain_graph=True)
    with _CountMM() as b:
        if weight_pass == "grad":
            d_w = torch.autograd.grad(out, weights, dout, retain_graph=True)
        else:
            outs = out if isinstance(out, tuple) else (out,)
            douts = dout if isinstance(dout, tuple) else (dout,)
            roots = [GradientEdge(o.grad_fn, o.output_nr) for o in outs]
            for p in weights:
                p.grad = None
            torch.autograd.backward(roots, list(douts), inputs=list(weights), retain_graph=True)
            d_w = tuple(p.grad for p in weights)
    return d_in, d_w, a.n, b.n


def _full(out, dout, inputs, weights):  # noqa: ANN001, ANN202
    with _CountMM() as c:
        grads = torch.autograd.grad(out, (*inputs, *weights), dout, retain_graph=True)
    return grads[:len(inputs)], grads[len(inputs):], c.n


def _assert_same(got, want, what):  # noqa: ANN001, ANN202
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a is not None and torch.equal(a, b), f"{what}: gradient {i} differs from the full backward"


@pytest.mark.parametrize("weight_pass", ["grad", "edge"])
def test_router_logits_split_runs_each_gemm_once(monkeypatch, weight_pass):
    """The router's split backward: 4 + 4 GEMMs before, now 1 (dx) then 3 (dw, three BF16 parts).
    On CPU the FP32-output GEMM is emulated (as in test_router)."""
    monkeypatch.setattr(router, "_mm_fp32", lambda a, b: a.float() @ b.float())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 16, generator=g).bfloat16().requires_grad_()
    w = torch.nn.Parameter((0.1 * torch.randn(4, 16, generator=g)).bfloat16())
    logits = router._RouterLogits.apply(x, w)
    dlogits = torch.randn(24, 4, generator=g) * 1e-3
    full_in, full_w, n_full = _full(logits, dlogits, (x,), (w,))
    assert n_full == 4
    d_in, d_w, n_in, n_w = _split_passes(logits, dlogits, (x,), (w,), weight_pass=weight_pass)
    assert (n_in, n_w) == (1, 3)
    _assert_same(d_in, full_in, "router dx")
    _assert_same(d_w, full_w, "router dw")


def test_router_logits_weight_pass_with_a_frozen_input(monkeypatch):
    """An input that needs no gradient: only dW's three GEMMs, in one ordinary backward."""
    monkeypatch.setattr(router, "_mm_fp32", lambda a, b: a.float() @ b.float())
    x = torch.randn(8, 16).bfloat16()
    w = torch.nn.Parameter(torch.randn(4, 16).bfloat16())
    logits = router._RouterLogits.apply(x, w)
    with _CountMM() as c:
        logits.backward(torch.ones_like(logits))
    assert c.n == 3 and w.grad is not None


class _KeepSink:
    """A gradient sink that keeps what it is given (the GEMM is not run)."""

    def __init__(self, params) -> None:  # noqa: ANN001
        self.params, self.got = params, []

    def accepts(self, param) -> bool:  # noqa: ANN001
        return any(param is p for p in self.params)

    def add_gradient(self, param, add) -> None:  # noqa: ANN001
        self.got.append((param, add))


def _run_adds(sink):  # noqa: ANN001, ANN202
    """The gradients kept by ``sink``, each added to a zero FP32 target (GEMMs counted)."""
    with _CountMM() as c, torch.no_grad():  # as inside a backward
        out = []
        for p, add in sink.got:
            target = torch.zeros(p.numel())
            add(target)
            out.append(target.view(p.shape))
    return out, c.n


@pytest.mark.parametrize("n_weights", [1, 3])
def test_linears_into_sink_split_runs_each_gemm_once(n_weights):
    """``_LinearsIntoSink`` (CPU; its route is forced): the input gradient (one GEMM per
    weight, added up in place) only in the input pass; the weight gradients into the sink
    only in the weight pass."""
    from moe_model.sink import sink_route

    g = torch.Generator().manual_seed(n_weights)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weights = tuple(torch.nn.Parameter(torch.randn(6 + i, 8, generator=g)) for i in range(n_weights))
    douts = tuple(torch.randn(2, 5, 6 + i, generator=g) for i in range(n_weights))

    def outputs(sink):  # noqa: ANN001, ANN202
        routes = tuple(sink_route(sink, w) for w in weights)
        return _LinearsIntoSink.apply(x, routes, *weights)

    full_sink = _KeepSink(weights)
    ys = outputs(full_sink)
    with _CountMM() as c:
        torch.autograd.backward(ys, douts, inputs=[x, *weights])
    assert c.n == n_weights and len(full_sink.got) == n_weights
    full_dx = x.grad
    full_w, _ = _run_adds(full_sink)

    sink = _KeepSink(weights)
    ys = outputs(sink)
    with _CountMM() as a:
        (dx,) = torch.autograd.grad(ys, x, douts, retain_graph=True)
    assert a.n == n_weights and sink.got == []
    with _CountMM() as b:
        torch.autograd.backward(ys, douts, inputs=list(weights))
    assert b.n == 0 and len(sink.got) == n_weights
    assert all(w.grad is None for w in weights)
    assert torch.equal(dx, full_dx)
    split_w, n_adds = _run_adds(sink)
    assert n_adds == n_weights
    _assert_same(split_w, full_w, "dense weight gradients into the sink")


def test_grouped_mm_into_sink_split_runs_each_gemm_once(monkeypatch):
    """``_GroupedMMIntoSink`` over the loop backend (CPU): the input gradient's grouped GEMM
    only in the input pass, the weight gradient only into the sink in the weight pass."""
    g = torch.Generator().manual_seed(0)
    E, N, K, R = 3, 6, 8, 11
    offsets = torch.tensor([4, 4, 9], dtype=torch.int32)
    x = torch.randn(R, K, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(E, N, K, generator=g))
    dy = torch.randn(R, N, generator=g)
    calls = []
    real = experts.grouped_mm

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(experts, "grouped_mm", counted)

    full_sink = _KeepSink((w,))
    y = experts.grouped_mm_into_sink(x, w, offsets, "loop", full_sink)
    calls.clear()
    torch.autograd.backward(y, dy, inputs=[x, w])
    assert len(calls) == 1 and len(full_sink.got) == 1

    sink = _KeepSink((w,))
    y = experts.grouped_mm_into_sink(x, w, offsets, "loop", sink)
    calls.clear()
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    assert len(calls) == 1 and sink.got == []
    calls.clear()
    torch.autograd.backward(y, dy, inputs=[w])
    assert calls == [] and len(sink.got) == 1 and w.grad is None
    assert torch.equal(dx[:9], x.grad[:9])
    # the weight gradient's operands are those of the full backward
    (_, full_add), (_, add) = full_sink.got[0], sink.got[0]
    for a, b in zip(full_add.sources[0], add.sources[0], strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.interpreter
def test_split_backward_of_triton_functions_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_split_backward_interpret_check.py"), timeout=600)
