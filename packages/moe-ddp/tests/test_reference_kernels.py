"""The reference switch: ``use_reference_kernels(True)`` sends accumulation to ``add_``."""

import moe_ddp
import pytest
import torch
from moe_ddp import use_reference_kernels
from moe_ddp.accumulate import accumulate_
from moe_testing import check_reference_switch


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_ddp._triton_support)


def test_switch_overrides_a_forced_kernel(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dst, src = torch.ones(3, 5), torch.full((15,), 0.5, dtype=torch.bfloat16)
    with use_reference_kernels(True):
        # A CPU tensor: without the switch the kernel is refused outside the interpreter.
        accumulate_(dst, src, backend="triton")
    torch.testing.assert_close(dst, torch.full((3, 5), 1.5), rtol=0, atol=0)


def test_resolve_backend_is_the_one_decision():
    resolve, cpu, cuda = moe_ddp._triton_support.resolve_backend, torch.device("cpu"), torch.device("cuda")
    assert not resolve("reference", cuda) and not resolve("auto", cpu)
    assert resolve("auto", cuda) == moe_ddp.triton_available()
    with use_reference_kernels(True):
        assert not resolve("triton", cuda) and not resolve("auto", cuda)
    with pytest.raises(ValueError, match="got 'fused'"):
        resolve("fused", cpu)


@pytest.mark.gpu
def test_on_gpu_the_switch_launches_no_triton_kernel_and_matches_the_kernel():
    import moe_ddp
    from moe_testing import launched_triton_kernels

    src = torch.randn(64, 300, device="cuda").bfloat16()
    dst = {tag: torch.randn(64, 300, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
           for tag in ("fused", "reference")}
    assert launched_triton_kernels(lambda: accumulate_(dst["fused"], src), moe_ddp)
    with use_reference_kernels(True):
        launched = launched_triton_kernels(lambda: accumulate_(dst["reference"], src), moe_ddp)
    assert not launched, sorted(launched)
    assert torch.equal(dst["reference"], dst["fused"])
