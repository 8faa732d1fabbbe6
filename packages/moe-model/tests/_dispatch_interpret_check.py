"""Run by test_dispatch.py in a subprocess with TRITON_INTERPRET=1 (set before Triton is
imported): the counting-sort layout kernels of the dropless local dispatch on CPU against
the stable ``argsort`` path, bit for bit, over expert counts that are and are not powers of
two, experts with no slot, slot counts not a multiple of the kernel's block, a single
token, none, and several blocks; an expert id outside the range fails."""

import torch
from moe_model import dispatch


def check(T, E, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most slots to a few experts, the last experts never chosen
        ids = torch.randint(0, max(1, E // 4), (T, k), generator=g)
    else:
        ids = torch.randint(0, E, (T, k), generator=g)
    got = dispatch.dropless_layout(ids, E, backend="triton")
    want = dispatch.dropless_layout_reference(ids, E)
    for name, a, b in zip(("slot_of_row", "row_of_slot", "token_of_row", "counts", "offsets"),
                          got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, f"T={T} E={E} k={k} {name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(a, b), f"T={T} E={E} k={k} skew={skew} {name}: {a[:20]} vs {b[:20]}"


def main():
    for T, E, k, skew in ((37, 6, 2, False), (300, 64, 8, False), (300, 64, 8, True), (1, 8, 8, False),
                          (0, 8, 2, False), (2050, 3, 1, True), (129, 256, 4, False)):
        check(T, E, k, seed=T + E, skew=skew)
    bad = torch.tensor([[0, 5]])
    try:
        dispatch.dropless_layout(bad, 4, backend="triton")
    except RuntimeError as e:
        assert "outside [0, n_experts)" in str(e), e
    else:
        raise AssertionError("an expert id outside [0, E) passed")
    print("ok")


if __name__ == "__main__":
    main()
