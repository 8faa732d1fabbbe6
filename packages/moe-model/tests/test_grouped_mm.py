"""Grouped GEMM backends against the per-expert loop: forward and gradients, empty experts,
odd group sizes, padding rows; the Triton kernels run under the Triton interpreter."""

from pathlib import Path

import pytest
import torch
from moe_model import grouped_mm, grouped_mm_reference, resolve_backend, use_reference_kernels
from moe_testing import run_under_triton_interpreter


@pytest.mark.parametrize("k_contiguous", [True, False])
def test_grouped_mm_backend_matches_loop(k_contiguous):
    g = torch.Generator().manual_seed(0)
    E, K, N = 5, 8, 12
    offsets = torch.tensor([3, 3, 10, 13, 13], dtype=torch.int32)  # empty experts, odd sizes
    R, valid = 16, 13  # 3 padding rows
    x = torch.randn(R, K, generator=g, requires_grad=True)
    store = torch.randn(*((E, N, K) if k_contiguous else (E, K, N)), generator=g, requires_grad=True)
    w = store.transpose(1, 2) if k_contiguous else store
    dy = torch.randn(R, N, generator=g)
    results = {}
    for backend in ("grouped_mm", "loop"):
        out = grouped_mm(x, w, offsets, backend)
        dx, dw = torch.autograd.grad(out[:valid], (x, store), dy[:valid])
        results[backend] = (out[:valid], dx[:valid], dw)  # padding rows are unspecified
    for a, b in zip(results["grouped_mm"], results["loop"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert results["loop"][2][1].abs().sum() == 0 and results["loop"][2][4].abs().sum() == 0


def test_auto_backend_on_cpu():
    x, w = torch.randn(4, 8), torch.randn(2, 8, 4)
    assert resolve_backend("auto", x, w) == "grouped_mm"
    assert resolve_backend("auto", torch.randn(4, 3), torch.randn(2, 3, 4)) == "loop"  # 12-byte rows
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cublas", x, w)


def test_grouped_mm_public_api_on_cpu():
    """``backend="loop"`` is ``grouped_mm_reference`` exactly; ``"triton"`` on CPU outside the
    interpreter fails with one line, and gives way to ``use_reference_kernels(True)``."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    offsets = torch.tensor([2, 6], dtype=torch.int32)
    want = grouped_mm_reference(x, w, offsets)
    assert torch.equal(grouped_mm(x, w, offsets, "loop"), want)
    with pytest.raises(RuntimeError, match="grouped_mm: backend='triton' needs"):
        grouped_mm(x, w, offsets, "triton")
    with use_reference_kernels(True):
        assert torch.equal(grouped_mm(x, w, offsets, "triton"), want)
    with pytest.raises(ValueError, match="unknown grouped GEMM backend 'cublas'"):
        grouped_mm(x, w, offsets, "cublas")


@pytest.mark.slow
@pytest.mark.interpreter
def test_triton_kernels_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_triton_interpret_check.py"))


def test_gpu_tile_configs_fit_shared_memory_for_fp32():
    """The tuned bf16 tiles overflowed an H200's shared memory with fp32 operands."""
    from moe_model._grouped_mm_launch import _SHARED_MEMORY_BUDGET, default_config

    cuda = torch.device("cuda")
    for kind in ("rows", "wgrad", "wgrad_long"):
        bf16 = default_config(kind, cuda, torch.bfloat16)
        fp32 = default_config(kind, cuda, torch.float32)
        for cfg, size in ((bf16, 2), (fp32, 4)):
            assert cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * size <= _SHARED_MEMORY_BUDGET
        assert fp32.num_stages >= 2


@pytest.mark.parametrize(
    ("rows_per_group", "batches", "kind"),
    [(1024, 1, "wgrad"), (1024, 2, "wgrad_long"), (512, 4, "wgrad_long"), (2048, 1, "wgrad_long"),
     (511, 4, "wgrad")],
)
def test_weight_gradient_tiles_follow_the_reduction_length(monkeypatch, rows_per_group, batches, kind):
    """A launch reducing over ``LONG_REDUCTION_ROWS`` rows per group or more (merged
    microbatches, an EP rank's larger groups) takes the long-reduction tiles, shorter ones
    the short tiles (tuned apart: tools/bench_expert_gemms.py gemms --merge 1 / --merge 4)."""
    pytest.importorskip("triton")
    from moe_model import _grouped_mm_launch as tgm

    chosen, launched = [], []
    monkeypatch.setattr(tgm, "default_config", lambda k, device, dtype=None: chosen.append(k) or tgm._CPU)

    class RecordingKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launched.append(meta)

    import triton

    monkeypatch.setattr(tgm, "_kernels", lambda: (triton, None, RecordingKernel()))
    assert tgm.LONG_REDUCTION_ROWS == 2048
    E, D, F = 4, 8, 16
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * rows_per_group
    like = torch.empty(E, F, D, dtype=torch.bfloat16).transpose(1, 2)
    target = torch.zeros(E * F * D)
    batches_of_rows = [(torch.randn(E * rows_per_group, D).bfloat16(), torch.randn(E * rows_per_group, F).bfloat16(),
                        offsets) for _ in range(batches)]
    tgm.wgrad_accumulate_(target, *batches_of_rows[0], like, more=batches_of_rows[1:])
    assert chosen == [kind] and len(launched) == 1 and launched[0]["SOURCES"] == batches


@pytest.mark.slow
@pytest.mark.interpreter
def test_weight_gradients_into_a_sink_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_wgrad_sink_interpret_check.py"))


def test_sink_is_left_alone_where_no_kernel_runs():
    """On a CPU (no Triton epilogue) the experts' gradients go through autograd as before."""
    from moe_model import GroupedExperts

    class Refusing:
        def accepts(self, param):
            raise AssertionError("the sink must not be consulted on a CPU")

        def add_gradient(self, param, add):
            raise AssertionError("the sink must not be consulted on a CPU")

    mod = GroupedExperts(3, 8, 12, backend="loop")
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.1)
    mod.grad_sink = Refusing()
    mod(torch.randn(6, 8), torch.tensor([2, 2, 6], dtype=torch.int32)).sum().backward()
    assert all(p.grad is not None for p in mod.parameters())


@pytest.mark.slow
@pytest.mark.interpreter
def test_paired_gate_up_gemms_under_interpreter():
    run_under_triton_interpreter(Path(__file__).with_name("_gate_up_interpret_check.py"))


def test_selective_recompute_keeps_the_paired_gemm_outputs():
    from moe_model.recompute import _saved_ops

    assert torch.ops.moe_model.triton_grouped_mm_split2.default in _saved_ops()
