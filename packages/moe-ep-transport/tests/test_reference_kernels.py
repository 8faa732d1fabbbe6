"""The reference switch: ``use_reference_kernels(True)`` sends ``ops`` to its PyTorch path."""

import moe_ep_transport
import pytest
from moe_ep_transport import use_reference_kernels
from moe_testing import check_reference_switch


@pytest.fixture(autouse=True)
def _switch_off():
    with use_reference_kernels(False):
        yield


def test_the_switch_keeps_the_contract_of_every_package():
    check_reference_switch(moe_ep_transport._triton_support)


