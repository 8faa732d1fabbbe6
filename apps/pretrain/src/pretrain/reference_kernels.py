"""``train.reference_kernels``: every package's eager reference paths for one trainer's life.

Each library package with fused kernels (moe_model, moe_mxfp8, moe_ddp,
moe_ep_transport) has its own process-wide ``use_reference_kernels`` switch; a run
that bisects a numerical problem between the kernels and their references turns them
all on together. The rowwise EP transport's peer-memory puts stay kernels (they copy
bytes and have no eager CUDA counterpart); ``parallel.ep_backend`` chooses the
all-to-all one for a run without them.
"""

from __future__ import annotations

from contextlib import ExitStack

import moe_ddp
import moe_ep_transport
import moe_model
import moe_mxfp8

PACKAGES = (moe_model, moe_mxfp8, moe_ddp, moe_ep_transport)


def reference_kernels(enabled: bool) -> ExitStack:
    """Turn every package's switch on when ``enabled`` (else leave them as they are);
    closing the returned stack restores each one's previous setting."""
    stack = ExitStack()
    if enabled:
        for package in PACKAGES:
            stack.enter_context(package.use_reference_kernels(True))
    return stack
