"""The untied token embedding's weight gradient into a gradient sink: the kernel under the
Triton interpreter on CPU, the CPU path staying autograd's, and at bench-1gpu's vocabulary
on a GPU against autograd without a host sync."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_model import _triton_support
from moe_model.embedding import (
    embed,
    embedding_grad_accumulate_,
    embedding_grad_accumulate_reference_,
)
from moe_testing import assert_no_host_sync, check_backend_api, run_under_triton_interpreter


class _Sink:
    def __init__(self, params, owner_major=False):
        self.targets = {}
        for p in params:
            # owner-major: two rows of half the weight, further apart than a piece
            self.targets[p] = (torch.zeros(2, p.numel() // 2 + 64, device=p.device)[:, : p.numel() // 2]
                               if owner_major else torch.zeros(p.numel(), device=p.device))

    def accepts(self, p):
        return p in self.targets

    def add_gradient(self, p, add):
        add(self.targets[p])


@pytest.mark.slow
@pytest.mark.interpreter
def test_embedding_sink_under_interpreter_matches_index_add_and_autograd():
    run_under_triton_interpreter(Path(__file__).with_name("_embedding_interpret_check.py"))


def test_cpu_tokens_keep_autograds_path():
    module = torch.nn.Embedding(10, 4)
    sink = _Sink([module.weight])
    embed(module, torch.tensor([[1, 2, 1]]), sink).sum().backward()
    assert module.weight.grad is not None and sink.targets[module.weight].abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("owner_major", [False, True])
def test_embedding_sink_at_bench_vocabulary_matches_autograd(owner_major):
    """100352 x 2048 BF16 weight, 2 x 4096 tokens drawn from 3000 ids (many repeats), two
    microbatches, no host sync: the FP32 target holds the exact sum (FP64 index_add) to
    FP32 rounding, and autograd's result to the BF16 rounding autograd applies to each
    microbatch's gradient (the kernel does not round it)."""
    V, D = 100352, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    module = torch.nn.Embedding(V, D, device="cuda", dtype=torch.bfloat16)
    batches = [(torch.randint(0, 3000, (2, 4096), device="cuda", generator=g),
                torch.randn(2, 4096, D, device="cuda", generator=g).bfloat16()) for _ in range(2)]
    want, magnitude = torch.zeros(V, D, device="cuda"), torch.zeros(V, D, device="cuda")
    exact = torch.zeros(V, D, device="cuda", dtype=torch.float64)
    for tokens, dy in batches:
        module.weight.grad = None
        module(tokens).backward(dy)
        want += module.weight.grad.float()
        magnitude += module.weight.grad.float().abs()
        exact.index_add_(0, tokens.reshape(-1), dy.reshape(-1, D).double())
    sink = _Sink([module.weight], owner_major)
    module.weight.grad = None

    def two_microbatches():
        for tokens, dy in batches:
            embed(module, tokens, sink).backward(dy)

    assert_no_host_sync(two_microbatches, warmup=0)
    assert module.weight.grad is None
    got = sink.targets[module.weight].reshape(V, D)
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-6)
    assert ((got - want).abs() <= 2**-8 * magnitude + 1e-6).all()


@pytest.mark.parametrize("owner_major", [False, True])
def test_embedding_grad_accumulate_backends(owner_major):
    V, D = 11, 6

    def make():
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, V, (3, 5), generator=g)
        dy = torch.randn(3, 5, D, generator=g).bfloat16()
        start = torch.randn(V * D, generator=g)
        target = torch.zeros(2, V * D // 2 + 4)[:, : V * D // 2] if owner_major else torch.zeros(V * D)
        target.copy_(start.view(target.shape))
        return target, tokens, dy, V

    check_backend_api(_triton_support, embedding_grad_accumulate_, embedding_grad_accumulate_reference_, make,
                      out=lambda result, args: args[0])
