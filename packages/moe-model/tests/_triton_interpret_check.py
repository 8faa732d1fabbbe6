"""Run by test_grouped_mm.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported, and never in the test process itself): the Triton grouped GEMM kernels on
CPU against the per-expert loop (``grouped_mm_reference``), forward and both gradients,
through ``grouped_mm(..., backend="triton")``."""

import itertools

import torch
from moe_model._grouped_mm_launch import TileConfig, rows_mm, wgrad_mm
from moe_model._triton_support import num_sms
from moe_model.experts import grouped_mm, grouped_mm_reference


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"{what}: {m}")


def main():
    g = torch.Generator().manual_seed(0)
    E, N = 5, 40
    offsets = torch.tensor([7, 7, 20, 41, 41], dtype=torch.int32)  # experts 1 and 4 empty
    valid, R = 41, 45  # rows 41..44 are padding
    for K, k_contiguous in ((32, True), (24, False)):  # 24: K not a multiple of BK
        x = torch.randn(R, K, generator=g, requires_grad=True)
        store = torch.randn(*((E, N, K) if k_contiguous else (E, K, N)), generator=g, requires_grad=True)
        w = store.transpose(1, 2) if k_contiguous else store
        dy = torch.randn(R, N, generator=g)
        ref = grouped_mm_reference(x, w, offsets)
        ref_dx, ref_dw = torch.autograd.grad(ref[:valid], (x, store), dy[:valid])
        tag = f"K={K} k_contiguous={k_contiguous}"
        # the public op on the differentiable custom op, default (CPU) tiles
        out = grouped_mm(x, w, offsets, backend="triton")
        dx, dw = torch.autograd.grad(out[:valid], (x, store), dy[:valid])
        close(out[:valid], ref[:valid], f"forward {tag}")
        close(dx[:valid], ref_dx[:valid], f"dx {tag}")
        close(dw, ref_dw, f"dw {tag}")
        assert (dw[1] == 0).all() and (dw[4] == 0).all(), "empty experts must get zero dw"
        if K != 32:
            continue
        # every scheduling / load path of the rows kernel, and the wgrad kernel's tiles
        with torch.no_grad():
            for persistent, tma in itertools.product((False, True), repeat=2):
                cfg = TileConfig(16, 16, 16, 2, 1, 1, persistent, tma)
                close(rows_mm(x, w, offsets, cfg)[:valid], ref[:valid], f"rows {tag} {cfg}")
            cfg = TileConfig(16, 32, 16, 1, 1, 1, True, True)
            dx = rows_mm(dy, w.transpose(1, 2), offsets, cfg)
            close(dx[:valid], ref_dx[:valid], f"dx rows {tag} {cfg}")
            dw = wgrad_mm(x, dy, offsets, w, TileConfig(32, 16, 16, 1, 1, 1, False, False))
            close(dw.transpose(1, 2) if k_contiguous else dw, ref_dw, f"wgrad {tag}")
            # torch's SM carveout: the persistent grid spreads over the SMs left (one program
            # walks every tile here) and computes the same
            torch._C._set_sm_carveout_experimental(num_sms(x.device) - 1)
            try:
                assert num_sms(x.device) == 1
                cfg = TileConfig(16, 16, 16, 2, 1, 1, True, False)
                close(rows_mm(x, w, offsets, cfg)[:valid], ref[:valid], f"rows, one program {tag}")
                dw = wgrad_mm(x, dy, offsets, w, TileConfig(32, 16, 16, 1, 1, 1, False, False))
                close(dw.transpose(1, 2) if k_contiguous else dw, ref_dw, f"wgrad, one program {tag}")
            finally:
                torch._C._set_sm_carveout_experimental(None)
    print("ok")


if __name__ == "__main__":
    main()
