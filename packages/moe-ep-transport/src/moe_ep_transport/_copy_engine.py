"""Byte copies into a peer's slab by the GPU's copy engines: rows move and no SM runs.

The put kernels store rows through peer pointers, and stores that cross NVLink keep an
SM busy for as long as they travel: a put at full speed occupies most of the GPU, which
is what keeps a transport call from hiding under the expert GEMMs of another microbatch
or chunk. Where a send is one contiguous block per destination (the token inbox: a
source's rows land at rows ``source * T_max + token``; the partial sums: at ``source *
T_max + token`` too), the copy engines can move it instead: ``cuMemcpyDtoDAsync`` to the
peer's address (mapped into this process by NVSHMEM) enqueues a copy on the stream,
ordered with the kernels around it and captured into CUDA graphs as a memcpy node.

On CPU (the EP ranks as threads of one process, ``tests/_thread_peers.py``) the same
call is a ``memmove`` into the other thread's slab.
"""

from __future__ import annotations

import ctypes

import torch


def copy_to(address: int, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` (made contiguous) to ``address``, in stream order on CUDA.

    ``address`` must lie in memory this process can address on ``src``'s device (its own
    or a peer's symmetric buffer) with room for ``src.nbytes`` bytes. ``src`` must stay
    alive until the copy ran: the caching allocator keeps it for the current stream.
    """
    src = src.contiguous()
    nbytes = src.numel() * src.element_size()
    if nbytes == 0:
        return
    if src.device.type != "cuda":
        ctypes.memmove(address, src.data_ptr(), nbytes)
        return
    from cuda.bindings import driver

    stream = torch.cuda.current_stream(src.device).cuda_stream
    (err,) = driver.cuMemcpyDtoDAsync(driver.CUdeviceptr(address), driver.CUdeviceptr(src.data_ptr()), nbytes,
                                      driver.CUstream(stream))
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"copy_to: cuMemcpyDtoDAsync of {nbytes} bytes to {address:#x} failed: {err}")
