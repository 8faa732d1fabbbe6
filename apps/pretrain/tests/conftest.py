"""One intra-op thread for in-process runs, as torchrun gives each worker.

The tests' tensors are tiny: a second thread buys nothing, and on a shared
two-core machine its barrier waits made small runs several times slower.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
