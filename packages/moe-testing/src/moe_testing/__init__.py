"""Test support shared by every moe-stack package.

Why a package of its own: each library package must pass its tests in an
environment that holds only its declared dependencies, and multi-process tests
need one runner. Copying the runner into seven test folders would let them drift,
so it lives here and is a *test-only* dependency (a dependency group, never a
runtime requirement).
"""

from moe_testing.distributed import DistributedTestError, run_distributed
from moe_testing.kernels import (
           assert_no_host_sync,
           check_backend_api,
           check_reference_switch,
           launched_triton_kernels,
           package_triton_kernels,
           run_under_triton_interpreter,
           same_bits,
           saved_tensor_bytes,
)
from moe_testing.processes import kill_tree, run_process_tree
from moe_testing.scripts import load_script

__all__ = ["DistributedTestError", "assert_no_host_sync", "check_backend_api", "check_reference_switch",
           "kill_tree", "launched_triton_kernels", "load_script", "run_process_tree",
           "package_triton_kernels", "run_distributed", "run_under_triton_interpreter", "same_bits",
           "saved_tensor_bytes"]
