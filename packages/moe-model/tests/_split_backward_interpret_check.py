"""Run by test_split_backward.py with TRITON_INTERPRET=1: a backward split in an input pass
and a weight pass (a pipeline's zero-bubble schedule) over the custom autograd Functions
whose backward runs Triton kernels, on CPU. Each pass computes only the gradients it
uses: each GEMM or kernel runs once over the two passes (the fused norms' one backward
kernel writes dx in the input pass and dweight in the weight pass, and touches nothing
else), and every gradient is bit for bit the full backward's.

- ``_RMSNormFunction``, ``_AddRMSNormFunction`` (``rms_norm``, ``add_rms_norm``);
- ``QKNormRope``;
- ``_GateUp`` with its weight gradients through autograd and into a sink;
- the ``moe_model::triton_grouped_mm`` custom op's backward."""

import torch
from _wgrad_sink_interpret_check import DictSink  # the script's folder is on sys.path
from moe_model import _grouped_mm_launch as tgm
from moe_model import _qk_norm_rope_kernels as qk_module
from moe_model import _rms_norm_kernels as norm_module
from moe_model.experts import gate_up
from moe_model.layers import rope_tables

EPS = 1e-6
E = 4
OFFSETS = torch.tensor([5, 5, 12, 19], dtype=torch.int32)  # expert 1 empty
VALID, R = 19, 22  # rows 19..21 are padding (their input gradient is unspecified)


class KernelLaunches:
    """Records the ``(WRITE_DX, WRITE_DW)`` of each launch of a backward kernel that the
    module ``module`` launches as ``module.<name>[grid](...)``."""

    def __init__(self, module, name):
        self.module, self.name, self.kernel = module, name, getattr(module, name)
        self.calls = []
        setattr(module, name, self)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.calls.append((kwargs["WRITE_DX"], kwargs["WRITE_DW"]))
            return launch(*args, **kwargs)

        return run

    def take(self):
        calls, self.calls = self.calls, []
        return calls


class Calls:
    """Counts the calls of ``module.<name>`` for each name."""

    def __init__(self, module, *names):
        self.n = dict.fromkeys(names, 0)
        for name in names:
            real = getattr(module, name)

            def counted(*args, real=real, name=name, **kwargs):
                self.n[name] += 1
                return real(*args, **kwargs)

            setattr(module, name, counted)

    def take(self):
        n, self.n = self.n, dict.fromkeys(self.n, 0)
        return n


def same(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a is not None and a.dtype == b.dtype and torch.equal(a, b), f"{what}: gradient {i} differs"


def split(outs, douts, inputs, weights):
    """(input grads, weight grads) of an input pass then a weight pass (torch.autograd.grad)."""
    d_in = torch.autograd.grad(outs, inputs, douts, retain_graph=True)
    d_w = torch.autograd.grad(outs, weights, douts, retain_graph=True)
    return d_in, d_w


def check_rms_norm(g, launches):
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 7, 40, generator=g) * 2).to(dtype).requires_grad_()
        w = torch.nn.Parameter((1 + 0.3 * torch.randn(40, generator=g)).to(dtype))
        y = norm_module.rms_norm(x, w, EPS)
        dy = torch.randn(y.shape, generator=g).to(y.dtype)
        full = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
        assert launches.take() == [(True, True)], "the full backward: one launch writing both"
        x_before = x.detach().clone()
        d_in, d_w = split(y, dy, (x,), (w,))
        assert launches.take() == [(True, False), (False, True)], f"rms_norm {dtype}: split launches"
        same((*d_in, *d_w), full, f"rms_norm {dtype}")
        assert torch.equal(x.detach(), x_before), "the unused pointer (x) was written"

        # a residual add fused in: (h, norm(h)) for h = x + branch, gradients to both halves
        branch = torch.randn(x.shape, generator=g).to(dtype).requires_grad_()
        h, y = norm_module.add_rms_norm(x, branch, w, EPS)
        dh = torch.randn(h.shape, generator=g).to(h.dtype)
        dy = torch.randn(y.shape, generator=g).to(y.dtype)
        full = torch.autograd.grad((h, y), (x, branch, w), (dh, dy), retain_graph=True)
        assert launches.take() == [(True, True)]
        h_before = h.detach().clone()
        d_in, d_w = split((h, y), (dh, dy), (x, branch), (w,))
        assert launches.take() == [(True, False), (False, True)], f"add_rms_norm {dtype}: split launches"
        same((*d_in, *d_w), full, f"add_rms_norm {dtype}")
        assert torch.equal(h.detach(), h_before), "the unused pointer (h) was written"

        # moe_pp's way: the weight pass restarts at the norm's node and accumulates into .grad
        y = norm_module.rms_norm(x, w, EPS)
        dy = torch.randn(y.shape, generator=g).to(y.dtype)
        (dx_full, dw_full) = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
        launches.take()
        (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
        w.grad = None
        torch.autograd.backward(
            [torch.autograd.graph.GradientEdge(y.grad_fn, 0)], [dy], inputs=[w], retain_graph=True)
        assert launches.take() == [(True, False), (False, True)]
        same((dx, w.grad), (dx_full, dw_full), f"rms_norm {dtype}, weight pass from the node")
        w.grad = None


def check_qk_norm_rope(g, launches):
    for dtype in (torch.float32, torch.bfloat16):
        B, S, H, Dh = 2, 5, 3, 16
        cos, sin = rope_tables(S, Dh, 10000.0, torch.device("cpu"))
        x = (torch.randn(B, S, H, Dh, generator=g) * 3).to(dtype).requires_grad_()
        w = torch.nn.Parameter((1 + 0.3 * torch.randn(Dh, generator=g)).to(dtype))
        out = qk_module.QKNormRope.apply(x, w, EPS, cos, sin)
        dout = torch.randn(B, H, S, Dh, generator=g).to(dtype).transpose(1, 2)  # as attention gives it
        full = torch.autograd.grad(out, (x, w), dout, retain_graph=True)
        assert launches.take() == [(True, True)]
        x_before = x.detach().clone()
        d_in, d_w = split(out, dout, (x,), (w,))
        assert launches.take() == [(True, False), (False, True)], f"qk_norm_rope {dtype}: split launches"
        same((*d_in, *d_w), full, f"qk_norm_rope {dtype}")
        assert torch.equal(x.detach(), x_before), "the unused pointer (x) was written"


def check_gate_up(g, gemms):
    D, F = 16, 24
    x = torch.randn(R, D, generator=g, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(E, F, D, generator=g))
    w3 = torch.nn.Parameter(torch.randn(E, F, D, generator=g))
    dg, du = torch.randn(R, F, generator=g), torch.randn(R, F, generator=g)

    # weight gradients through autograd
    gg, uu = gate_up(x, w1, w3, OFFSETS, None)
    gemms.take()
    full = torch.autograd.grad((gg, uu), (x, w1, w3), (dg, du), retain_graph=True)
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 1, "wgrad_mm": 2, "wgrad_accumulate_": 0}
    (dx,) = torch.autograd.grad((gg, uu), x, (dg, du), retain_graph=True)
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 1, "wgrad_mm": 0, "wgrad_accumulate_": 0}
    dws = torch.autograd.grad((gg, uu), (w1, w3), (dg, du), retain_graph=True)
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 0, "wgrad_mm": 2, "wgrad_accumulate_": 0}
    same((dx[:VALID], *dws), (full[0][:VALID], *full[1:]), "gate_up")

    # into a sink (moe_pp's weight pass: backward(inputs=weights), the AccumulateGrad nodes run)
    def sink():
        return DictSink({w1: torch.zeros(w1.numel()), w3: torch.zeros(w3.numel())})

    full_sink = sink()
    gg, uu = gate_up(x, w1, w3, OFFSETS, full_sink)
    x.grad = None
    torch.autograd.backward((gg, uu), (dg, du), inputs=[x, w1, w3])
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 1, "wgrad_mm": 0, "wgrad_accumulate_": 2}
    full_dx, x.grad = x.grad, None
    split_sink = sink()
    gg, uu = gate_up(x, w1, w3, OFFSETS, split_sink)
    (dx,) = torch.autograd.grad((gg, uu), x, (dg, du), retain_graph=True)
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 1, "wgrad_mm": 0, "wgrad_accumulate_": 0}
    assert split_sink.added == {}
    torch.autograd.backward((gg, uu), (dg, du), inputs=[w1, w3])
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 0, "wgrad_mm": 0, "wgrad_accumulate_": 2}
    assert split_sink.added == {w1: 1, w3: 1} and w1.grad is None and w3.grad is None
    same((dx[:VALID], split_sink.targets[w1], split_sink.targets[w3]),
         (full_dx[:VALID], full_sink.targets[w1], full_sink.targets[w3]), "gate_up into a sink")


def check_grouped_mm_op(g, gemms):
    K, N = 16, 12
    x = torch.randn(R, K, generator=g, requires_grad=True)
    store = torch.nn.Parameter(torch.randn(E, N, K, generator=g))
    dy = torch.randn(R, N, generator=g)
    y = tgm.triton_grouped_mm(x, store.transpose(1, 2), OFFSETS)
    gemms.take()
    full = torch.autograd.grad(y, (x, store), dy, retain_graph=True)
    assert gemms.take() == {"rows_mm": 1, "rows_mm_sum2": 0, "wgrad_mm": 1, "wgrad_accumulate_": 0}
    (dx,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    assert gemms.take() == {"rows_mm": 1, "rows_mm_sum2": 0, "wgrad_mm": 0, "wgrad_accumulate_": 0}
    (dw,) = torch.autograd.grad(y, store, dy, retain_graph=True)
    assert gemms.take() == {"rows_mm": 0, "rows_mm_sum2": 0, "wgrad_mm": 1, "wgrad_accumulate_": 0}
    same((dx[:VALID], dw), (full[0][:VALID], full[1]), "triton_grouped_mm")


def main():
    g = torch.Generator().manual_seed(0)
    check_rms_norm(g, KernelLaunches(norm_module, "rms_norm_bwd_kernel"))
    check_qk_norm_rope(g, KernelLaunches(qk_module, "qk_norm_rope_bwd_kernel"))
    gemms = Calls(tgm, "rows_mm", "rows_mm_sum2", "wgrad_mm", "wgrad_accumulate_")
    check_gate_up(g, gemms)
    check_grouped_mm_op(g, gemms)
    print("ok")


if __name__ == "__main__":
    main()
