"""Run by test_grouped_mm.py with TRITON_INTERPRET=1: the paired rows kernel (two operand
pairs summed over one reduction; two outputs from one input) on every load path and
both address orders of a pair, and the experts' gate/up projections through it
(``experts.gate_up``: forward, input gradient, weight gradients through autograd and
into a sink, a split input/weight backward, the GroupedExperts module), on CPU."""

import itertools

import torch
from _wgrad_sink_interpret_check import DictSink, close  # the script's folder is on sys.path
from moe_model import experts
from moe_model._grouped_mm_launch import TileConfig, rows_mm_split2, rows_mm_sum2
from moe_model.experts import GroupedExperts, gate_up, grouped_mm_reference

E, N = 5, 40
OFFSETS = torch.tensor([7, 7, 20, 41, 41], dtype=torch.int32)  # experts 1 and 4 empty
VALID, R = 41, 45  # rows 41..44 are padding


def check_kernels(g):
    for K, k_contiguous in ((32, True), (32, False), (24, False)):  # 24: K not a multiple of BK
        x0, x1 = torch.randn(R, K, generator=g), torch.randn(R, K, generator=g)
        shape = (E, N, K) if k_contiguous else (E, K, N)
        s0, s1 = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        w0, w1 = (s.transpose(1, 2) if k_contiguous else s for s in (s0, s1))
        y0, y1 = grouped_mm_reference(x0, w0, OFFSETS), grouped_mm_reference(x0, w1, OFFSETS)
        both = y0 + grouped_mm_reference(x1, w1, OFFSETS)
        for persistent, tma in itertools.product((False, True), repeat=2):
            cfg = TileConfig(16, 16, 16, 2, 1, 1, persistent, tma)
            tag = f"K={K} k_contiguous={k_contiguous} {cfg}"
            # both orders: the pair's first tensor at the lower and at the higher address
            close(rows_mm_sum2(x0, w0, x1, w1, OFFSETS, cfg)[:VALID], both[:VALID], f"sum2 {tag}")
            close(rows_mm_sum2(x1, w1, x0, w0, OFFSETS, cfg)[:VALID], both[:VALID], f"sum2 swapped {tag}")
            for a, b, ra, rb in ((w0, w1, y0, y1), (w1, w0, y1, y0)):
                got_a, got_b = rows_mm_split2(x0, a, b, OFFSETS, cfg)
                close(got_a[:VALID], ra[:VALID], f"split2 first {tag}")
                close(got_b[:VALID], rb[:VALID], f"split2 second {tag}")
    try:
        rows_mm_sum2(x0, w0, x1[:, :8], w1, OFFSETS)
    except ValueError as e:
        assert "match" in str(e)
    else:
        raise AssertionError("mismatched pairs must be refused")


def reference(x, w1, w3, dg, du):
    """g, u and the gradients of <g, dg> + <u, du> through the per-expert loop."""
    g_ = grouped_mm_reference(x, w1.transpose(1, 2), OFFSETS)
    u_ = grouped_mm_reference(x, w3.transpose(1, 2), OFFSETS)
    grads = torch.autograd.grad((g_[:VALID] * dg[:VALID]).sum() + (u_[:VALID] * du[:VALID]).sum(), (x, w1, w3))
    return g_, u_, grads


def check_gate_up(g):
    D, F = 32, 40
    x = torch.randn(R, D, generator=g, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(E, F, D, generator=g))
    w3 = torch.nn.Parameter(torch.randn(E, F, D, generator=g))
    dg, du = torch.randn(R, F, generator=g), torch.randn(R, F, generator=g)
    dg[VALID:] = 0
    du[VALID:] = 0
    ref_g, ref_u, (ref_dx, ref_dw1, ref_dw3) = reference(x, w1, w3, dg, du)

    # through autograd
    gg, uu = gate_up(x, w1, w3, OFFSETS, None)
    close(gg[:VALID], ref_g[:VALID], "gate")
    close(uu[:VALID], ref_u[:VALID], "up")
    dx, dw1, dw3 = torch.autograd.grad((gg, uu), (x, w1, w3), (dg, du))
    close(dx[:VALID], ref_dx[:VALID], "dx")
    close(dw1, ref_dw1, "dw1")
    close(dw3, ref_dw3, "dw3")

    # into a sink: an input pass delivers nothing, the weight pass each gradient once
    sink = DictSink({w1: torch.zeros(w1.numel()), w3: torch.zeros(w3.numel())})
    gg, uu = gate_up(x, w1, w3, OFFSETS, sink)
    (dx,) = torch.autograd.grad((gg, uu), x, (dg, du), retain_graph=True)
    assert sink.added == {}, "an input-gradient pass must not deliver weight gradients"
    close(dx[:VALID], ref_dx[:VALID], "dx (sink)")
    torch.autograd.backward((gg, uu), (dg, du), inputs=[w1, w3])
    assert sink.added == {w1: 1, w3: 1} and w1.grad is None and w3.grad is None
    close(sink.targets[w1].view(w1.shape), ref_dw1, "dw1 into the sink")
    close(sink.targets[w3].view(w3.shape), ref_dw3, "dw3 into the sink")

    # a sink that takes one of the two: the other through autograd
    half = DictSink({w3: torch.zeros(w3.numel())})
    gg, uu = gate_up(x, w1, w3, OFFSETS, half)
    torch.autograd.backward((gg, uu), (dg, du), inputs=[w1, w3])
    close(w1.grad, ref_dw1, "dw1 through autograd next to a sink")
    close(half.targets[w3].view(w3.shape), ref_dw3, "dw3 into the sink next to autograd")
    w1.grad = None

    # no gradient wanted: the plain op
    with torch.no_grad():
        gg, uu = gate_up(x, w1, w3, OFFSETS, None)
    close(gg[:VALID], ref_g[:VALID], "gate without grad")


def check_module(g):
    """GroupedExperts with the paired path (as on CUDA) equals the two-GEMM loop path."""
    experts.gate_up_pairs = lambda rows, backend: True
    experts.sink_adds_in_kernel = lambda rows: True
    D, F = 16, 24
    ref_mod = GroupedExperts(E, D, F, backend="loop")
    for p in ref_mod.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=g)
    mod = GroupedExperts(E, D, F, backend="triton")
    mod.load_state_dict(ref_mod.state_dict())
    rows = torch.randn(R, D, generator=g)
    dout = torch.randn(R, D, generator=g)
    dout[VALID:] = 0
    experts.gate_up_pairs = lambda rows, backend: False
    ref_out = ref_mod(rows, OFFSETS)
    ref_out.backward(dout)
    experts.gate_up_pairs = lambda rows, backend: True
    mod.grad_sink = DictSink({p: torch.zeros(p.numel()) for p in mod.parameters()})
    out = mod(rows, OFFSETS)
    close(out[:VALID], ref_out[:VALID], "module output")
    out.backward(dout)
    for (name, p), ref_p in zip(mod.named_parameters(), ref_mod.parameters(), strict=True):
        assert p.grad is None and mod.grad_sink.added[p] == 1, name
        close(mod.grad_sink.targets[p].view(p.shape), ref_p.grad, f"module {name}")


def main():
    g = torch.Generator().manual_seed(0)
    check_kernels(g)
    check_gate_up(g)
    check_module(g)
    print("ok")


if __name__ == "__main__":
    main()
