"""Run by test_fused_router.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported): the fused router kernels on CPU against the eager ``route_top_k_reference``, for
softmax and sigmoid scores, with and without a selection bias and top-k normalisation,
at sizes that leave a partial last program (and none at all): ids and counts identical,
weights, probabilities and z-loss within a few FP32 ulps, the logits' gradient from
every combination of upstream gradients (dense, the balancing loss's stride-0 broadcast,
absent) against autograd through the eager graph; ties to the lower expert index;
two runs bit-identical; the split of the logits' gradient into BF16 parts."""

import itertools

import torch
from moe_model._router_kernels import split_bf16
from moe_model.router import load_balancing_loss, route_top_k, route_top_k_reference

# (T, E, k): a partial last program of 8 rows, several programs, k = E, k = 1, E = 2,
# a non-power-of-two E with k = E, the largest supported E, no tokens
SHAPES = ((37, 6, 2), (130, 64, 8), (5, 8, 8), (19, 16, 1), (11, 2, 1), (9, 3, 3), (10, 256, 8), (0, 8, 2))
FWD_TOL = {"rtol": 1e-6, "atol": 1e-12}


def fused_routing(logits, bias, k, sigmoid, norm):
    """``route_top_k(..., backend="triton")`` as the kernel entry's tuple."""
    r = route_top_k(logits, "sigmoid" if sigmoid else "softmax", k, norm, bias, backend="triton")
    return r.expert_ids, r.weights, r.tokens_per_expert, r.probs, r.z_loss


def routes(logits, bias, k, score, norm):
    """(fused, eager) routing of the same logits."""
    fused = fused_routing(logits, bias, k, score == "sigmoid", norm)
    eager = route_top_k_reference(logits, score, k, norm, bias)
    return fused, (eager.expert_ids, eager.weights, eager.tokens_per_expert, eager.probs, eager.z_loss)


def grads(routing, logits, upstream):
    """d logits of ``sum(dw * weights) + sum(dp * probs) + dz * z_loss`` (each term only if
    its upstream gradient is given; ``dp="balance"``: through ``load_balancing_loss``, whose
    backward hands the probabilities a stride-0 broadcast)."""
    _, weights, counts, probs, z = routing
    dw, dp, dz = upstream
    outs, gouts = [], []
    if dw is not None:
        outs.append(weights), gouts.append(dw)
    if isinstance(dp, str):
        outs.append(load_balancing_loss(probs, counts)), gouts.append(torch.tensor(0.37))
    elif dp is not None:
        outs.append(probs), gouts.append(dp)
    if dz is not None:
        outs.append(z), gouts.append(dz)
    return torch.autograd.grad(outs, logits, gouts, retain_graph=True)[0]


def check_case(gen, T, E, k, score, bias_on, norm):
    tag = f"T={T} E={E} k={k} {score} bias={bias_on} norm={norm}"
    logits = (2 * torch.randn(T, E, generator=gen)).requires_grad_(True)
    bias = 0.05 * torch.randn(E, generator=gen) if bias_on else None
    fused, eager = routes(logits, bias, k, score, norm)
    ids, weights, counts, probs, z = fused
    assert ids.dtype == counts.dtype == torch.int64 and ids.shape == (T, k) and counts.shape == (E,), tag
    assert weights.dtype == probs.dtype == z.dtype == torch.float32 and z.shape == (), tag
    assert torch.equal(ids, eager[0]), f"ids {tag}"
    assert torch.equal(counts, eager[2]), f"counts {tag}"
    for name, got, want in (("weights", weights, eager[1]), ("probs", probs, eager[3]), ("z", z, eager[4])):
        torch.testing.assert_close(got, want, **FWD_TOL, msg=lambda m, n=name: f"{n} {tag}: {m}")

    dw, dp, dz = torch.randn(T, k, generator=gen), torch.randn(T, E, generator=gen), torch.tensor(0.3)
    scenarios = ((dw, dp, dz), (dw, "balance", dz), (dw, None, None), (None, dp, None), (None, None, dz),
                 (dw.t().contiguous().t(), dp.t().contiguous().t(), dz))  # column-major upstream grads
    for i, upstream in enumerate(scenarios):
        seen = []
        hook = probs.register_hook(lambda g, seen=seen: seen.append(None if g is None else g.stride()))
        got = grads(fused, logits, upstream)
        hook.remove()
        want = grads(eager, logits, upstream)
        if upstream[1] == "balance" and T:
            assert seen[-1][0] == 0, f"{tag}: the balancing loss's gradient arrived materialised"
        # rtol: a few FP32 ulps of each chain; atol: where terms of the upstream gradients'
        # scale (~1) cancel (k = 1 with normalisation: exactly zero, eager ~1e-8)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"d logits, upstream {i}, {tag}: {m}")

    again = fused_routing(logits, bias, k, score == "sigmoid", norm)
    for a, b in zip(fused, again, strict=True):
        assert torch.equal(a, b), f"not deterministic: {tag}"
    g1, g2 = (grads(f, logits, scenarios[1]) for f in (fused, again))
    assert torch.equal(g1, g2), f"backward not deterministic: {tag}"


def check_ties():
    """Equal keys go to the lower expert index, in the selection and in the counts: equal
    logits, equal biased keys, and a bias that reorders equal scores."""
    E, k = 8, 3
    logits = torch.zeros(4, E)
    logits[1, 5] = logits[1, 6] = 1.0  # 5, 6 first, then 0 of the equal rest
    logits[2, 3] = 1.0  # 3, then 0, 1
    logits[3] = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0, 2.0, 0.0, 0.0])
    want = torch.tensor([[0, 1, 2], [5, 6, 0], [3, 0, 1], [4, 5, 0]])
    for score in ("softmax", "sigmoid"):
        ids, *_ = fused_routing(logits, None, k, score == "sigmoid", False)
        assert torch.equal(ids, want), f"ties {score}: {ids.tolist()}"
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    ids, _, counts, *_ = fused_routing(torch.zeros(3, E), bias, k, False, False)
    assert torch.equal(ids, torch.tensor([[7, 0, 1]] * 3)), f"biased ties: {ids.tolist()}"
    assert counts.tolist() == [3, 3, 0, 0, 0, 0, 0, 3], counts.tolist()


def check_split_bf16(gen):
    """The logits gradient's split into three BF16 parts (``_RouterLogits`` backward): the
    parts sum back to the FP32 values exactly, each smaller than the one before, laid out
    ``[g0 | g1 | g2]`` per row (the interpreter's BF16 conversion may truncate where a GPU
    rounds to nearest; three parts carry all 24 bits either way)."""
    for T, E in ((37, 6), (3, 64), (0, 8)):
        g = torch.randn(T, E, generator=gen) * torch.logspace(-8, 3, E)
        out = split_bf16(g, 3)
        assert out.dtype == torch.bfloat16 and out.shape == (T, 3 * E), (out.dtype, out.shape)
        p0, p1, p2 = (out[:, i * E:(i + 1) * E].float() for i in range(3))
        assert torch.equal(p0 + p1 + p2, g), f"T={T} E={E}: parts do not sum to g"
        assert (p1.abs() <= p0.abs() * 2**-7).all() and (p2.abs() <= p1.abs() * 2**-7).all()


def main():
    gen = torch.Generator().manual_seed(0)
    check_split_bf16(gen)
    for T, E, k in SHAPES:
        for score, bias_on, norm in itertools.product(("softmax", "sigmoid"), (False, True), (False, True)):
            check_case(gen, T, E, k, score, bias_on, norm)
    check_ties()
    print("ok")


if __name__ == "__main__":
    main()
