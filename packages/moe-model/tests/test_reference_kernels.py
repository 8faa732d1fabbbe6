"""The reference switch: ``use_reference_kernels(True)`` sends every op to its eager path."""

import inspect
import threading

import moe_model
import pytest
import torch
from moe_model import DocumentMask, resolve_backend, triton_available, use_reference_kernels
from moe_model._triton_support import reference_kernels_enabled
from moe_testing import check_reference_switch, launched_triton_kernels, package_triton_kernels


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_model._triton_support)


def _reference_name(op: str) -> str:
    return op[:-1] + "_reference_" if op.endswith("_") else op + "_reference"


def test_every_public_op_with_a_backend_has_its_reference_beside_it():
    """The kernel convention: ``<op>(..., backend="auto")`` and ``<op>_reference`` (same
    parameters, no backend) in the same module, both exported."""
    ops = [name for name in moe_model.__all__ if inspect.isfunction(getattr(moe_model, name))
           and list(inspect.signature(getattr(moe_model, name)).parameters)[-1:] == ["backend"]]
    assert {"rms_norm", "swiglu", "route_top_k", "lm_loss_sum", "weighted_gather_sum", "grouped_mm"} <= set(ops)
    for name in ops:
        op = getattr(moe_model, name)
        params = dict(inspect.signature(op).parameters)
        assert params.pop("backend").default == "auto", name
        assert _reference_name(name) in moe_model.__all__, f"{name} has no exported {_reference_name(name)}"
        reference = getattr(moe_model, _reference_name(name))
        assert reference.__module__ == op.__module__, f"{name}: reference in {reference.__module__}"
        assert list(inspect.signature(reference).parameters) == list(params), name


@pytest.mark.parametrize("backend", ["auto", "triton", "grouped_mm", "loop"])
def test_grouped_gemm_takes_the_loop_whatever_backend_is_asked(backend):
    x, w = torch.zeros(4, 16), torch.zeros(2, 16, 16)
    with use_reference_kernels(True):
        assert resolve_backend(backend, x, w) == "loop"
    assert resolve_backend("triton", x, w) == "triton"


def test_document_attention_takes_sdpa_even_when_flex_is_asked():
    ids = torch.zeros(1, 8, dtype=torch.long)
    with use_reference_kernels(True):
        assert DocumentMask(ids, kernel="flex").kernel == "sdpa"


@pytest.mark.skipif(not triton_available(), reason="needs Triton installed")
def test_every_kernel_module_is_found_by_name():
    names = package_triton_kernels(moe_model)
    assert {"rms_norm_fwd_kernel", "rows_kernel", "wgrad_kernel", "split_bf16_kernel"} <= names


def test_backward_threads_see_the_switch():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # noqa: ANN001, ANN205
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            seen.append((threading.get_ident(), reference_kernels_enabled()))
            return g

    x = torch.ones(3, requires_grad=True)
    with use_reference_kernels(True):
        Probe.apply(x).sum().backward()
    assert seen and seen[0][1] is True


def _step(model, tokens):  # noqa: ANN001, ANN202
    out = {}

    def run() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        out["loss"] = moe_model.lm_loss_sum(logits, tokens[:, 1:]) / tokens[:, 1:].numel()
        out["loss"].backward()

    launched = launched_triton_kernels(run, moe_model)
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out["loss"].detach().float(), grads, launched


@pytest.mark.gpu
def test_reference_model_step_matches_fused_and_launches_no_triton_kernel():
    cfg = moe_model.MoEConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=64, n_experts=8, top_k=2, expert_hidden=128,
                              n_shared_experts=1, n_dense_layers=1, z_loss_coef=1e-3,
                              grouped_mm_backend="triton")
    model = moe_model.MoETransformer(cfg).cuda()
    moe_model.init_weights(model, cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 129), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(0))
    fused_loss, fused_grads, fused_launched = _step(model, tokens)
    assert fused_launched, "the fused step should launch this package's Triton kernels"
    with use_reference_kernels(True):
        ref_loss, ref_grads, launched = _step(model, tokens)

    assert not launched, f"Triton kernels launched under use_reference_kernels: {sorted(launched)}"
    torch.testing.assert_close(ref_loss, fused_loss, rtol=1e-2, atol=1e-3)
    assert fused_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        err = (g - fused_grads[name]).norm() / fused_grads[name].norm().clamp_min(1e-12)
        assert err < 3e-2, f"{name}: relative gradient error {err:.3g}"
