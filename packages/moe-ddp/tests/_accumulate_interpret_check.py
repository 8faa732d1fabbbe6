"""Run by test_accumulate.py with TRITON_INTERPRET=1 (set before Triton is imported): the
Triton accumulation kernel on CPU, called as ``accumulate_(..., backend="triton")``, is bit
for bit ``accumulate_reference_`` (``add_``); tensors it cannot take are refused."""

import pytest
import torch
from moe_ddp.accumulate import accumulate_, accumulate_reference_


def main():
    g = torch.Generator().manual_seed(0)
    for src_dtype in (torch.bfloat16, torch.float16):
        # flat, with a tail that is not a multiple of the block
        dst = torch.randn(3 * 4096 + 17, generator=g)
        src = (torch.randn(dst.shape, generator=g) * 1e-3).to(src_dtype)
        ref = dst.clone()
        accumulate_reference_(ref, src)
        accumulate_(dst, src, backend="triton")
        assert torch.equal(dst, ref), f"flat {src_dtype}"
        # owner-major reduce-scatter view: rows of a wider buffer
        buf = torch.randn(3, 5000, generator=g)
        view = buf[:, 100:4200 + 100]
        src = torch.randn(3 * 4200, generator=g).to(src_dtype)
        ref_buf = buf.clone()
        accumulate_reference_(ref_buf[:, 100:4300], src)
        accumulate_(view, src, backend="triton")
        assert torch.equal(buf, ref_buf), f"strided {src_dtype}"
    for dst, src, why in ((torch.zeros(8), torch.zeros(8), "another dtype"),
                          (torch.zeros(4, 8).t(), torch.zeros(32, dtype=torch.bfloat16), "contiguous rows"),
                          (torch.zeros(2, 2, 2), torch.zeros(8, dtype=torch.bfloat16), "1-D or 2-D")):
        with pytest.raises(ValueError, match=why):
            accumulate_(dst, src, backend="triton")
        accumulate_(dst, src)  # auto: the reference for what the kernel cannot take
    print("ok")


if __name__ == "__main__":
    main()
