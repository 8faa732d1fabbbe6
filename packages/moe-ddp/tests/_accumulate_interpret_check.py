"""Run by test_accumulate.py with TRITON_INTERPRET=1 (set before Triton is imported): the
Triton accumulation kernel on CPU is bit for bit ``add_``."""

import torch
from moe_ddp.accumulate import accumulate_


def main():
    g = torch.Generator().manual_seed(0)
    for src_dtype in (torch.bfloat16, torch.float16):
        # flat, with a tail that is not a multiple of the block
        dst = torch.randn(3 * 4096 + 17, generator=g)
        src = (torch.randn(dst.shape, generator=g) * 1e-3).to(src_dtype)
        ref = dst.clone().add_(src)
        accumulate_(dst, src, fused=True)
        assert torch.equal(dst, ref), f"flat {src_dtype}"
        # owner-major reduce-scatter view: rows of a wider buffer
        buf = torch.randn(3, 5000, generator=g)
        view = buf[:, 100:4200 + 100]
        src = torch.randn(3 * 4200, generator=g).to(src_dtype)
        ref_buf = buf.clone()
        ref_buf[:, 100:4300].add_(src.view(3, 4200))
        accumulate_(view, src, fused=True)
        assert torch.equal(buf, ref_buf), f"strided {src_dtype}"
    print("ok")


if __name__ == "__main__":
    main()
