"""The flag barrier, a Triton device function the plan and the transport kernels share (no launches).

Import this module only from kernel modules (it imports triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def peer_barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    """The flag barrier inside a single-program kernel, before it reads what peers put
    (``_transport_kernels.signal_barrier``; ``ops.PeerWait``)."""
    barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P)
    tl.debug_barrier()  # every thread of the program reads after the spin's acquire


@triton.jit
def barrier(epoch_ptr, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    # One program: bump this rank's epoch, store it into slot `me` of every rank's flags
    # (release at system scope: the puts of earlier kernels are visible before the flag),
    # then spin until every rank's flag here reached the epoch (acquire).
    epoch = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, epoch)
    r = tl.arange(0, M_P)
    live = r < n_ranks
    peer_flags = tl.load(flag_table_ptr + r, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + me, tl.zeros([M_P], dtype=tl.int64) + epoch, mask=live, sem="release",
                   scope="sys")
    my_flags = tl.load(flag_table_ptr + me).to(tl.pointer_type(tl.int64))
    waiting = 1
    while waiting > 0:
        seen = tl.atomic_add(my_flags + r, tl.zeros([M_P], dtype=tl.int64), mask=live, sem="acquire",
                             scope="sys")
        waiting = tl.sum((live & (seen < epoch)).to(tl.int32), axis=0)
