"""The flag barrier, Triton device functions the plan and the transport kernels share (no launches).

Import this module only from kernel modules (it imports triton).

A barrier numbers itself from two device counters (``epoch_ptr[0:2]``), one per parity
of the barriers passed so far (the caller counts them on the host: ``parity``): it
takes its number ``e = epoch[parity]`` and leaves ``e + 1`` in ``epoch[1 - parity]``
for the next barrier, which runs in a later kernel. Every program of a kernel can then
read its barrier's number without racing the program that advances it: the counter it
reads was written by an earlier kernel, the one it writes is read by a later one. A
rank stores ``e`` into its slot of every rank's flags (release at system scope: the
puts of earlier kernels are visible before the flag) and passes once every rank's flag
here reached ``e``. Graph replays keep the parities: a graph holds an even number of
barriers (``RowwiseTransport.replayable``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def peer_barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    """The flag barrier inside a single-program kernel, before it reads what peers put
    (``_transport_kernels.signal_barrier``; ``ops.PeerWait``)."""
    barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P)
    tl.debug_barrier()  # every thread of the program reads after the spin's acquire


@triton.jit
def barrier(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    # One program: signal every rank (this one too), then spin until every rank's flag
    # here reached the barrier's number (acquire).
    epoch = _signal(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P)
    r = tl.arange(0, M_P)
    live = r < n_ranks
    my_flags = tl.load(flag_table_ptr + me).to(tl.pointer_type(tl.int64))
    waiting = 1
    while waiting > 0:
        seen = tl.atomic_add(my_flags + r, tl.zeros([M_P], dtype=tl.int64), mask=live, sem="acquire",
                             scope="sys")
        waiting = tl.sum((live & (seen < epoch)).to(tl.int32), axis=0)


@triton.jit
def _signal(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P: tl.constexpr):
    """Take the barrier's number, leave the next one's, store it into slot ``me`` of every
    rank's flags (release, system scope); the number."""
    epoch = tl.load(epoch_ptr + parity)
    tl.store(epoch_ptr + 1 - parity, epoch + 1)
    r = tl.arange(0, M_P)
    live = r < n_ranks
    peer_flags = tl.load(flag_table_ptr + r, mask=live, other=0).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(peer_flags + me, tl.zeros([M_P], dtype=tl.int64) + epoch, mask=live, sem="release",
                   scope="sys")
    return epoch


@triton.jit
def wait_in_every_program(epoch_ptr, parity, flag_table_ptr, me, n_ranks, pid,
                          M_P: tl.constexpr, FENCE: tl.constexpr):
    """The flag barrier at the start of a kernel of many programs, which then reads what
    peers put (one launch fewer than a barrier kernel before it).

    Program ``pid == 0`` signals; every program waits for the *other* ranks' flags alone
    (its own rank's puts are complete: they ran in earlier kernels), so no program waits
    for another program of its own grid, only for the peers' programs 0. That takes one
    assumption: a rank's program 0 starts while its other programs spin, which holds where
    the GPU hands out a grid's programs in index order (what CUDA GPUs do, though no
    documented guarantee; the single-program barrier kernel needs none). The wait spins on
    plain volatile loads (thousands of programs doing atomics on the same flags would queue
    on them) and then fences (``FENCE``: acquire at system scope, what an atomic acquire of
    the flag would give; the Triton interpreter, which runs no inline assembly, takes
    ``FENCE=False``)."""
    epoch = tl.load(epoch_ptr + parity)
    if pid == 0:
        _signal(epoch_ptr, parity, flag_table_ptr, me, n_ranks, M_P)
    r = tl.arange(0, M_P)
    peers = (r < n_ranks) & (r != me)
    my_flags = tl.load(flag_table_ptr + me).to(tl.pointer_type(tl.int64))
    waiting = 1
    while waiting > 0:
        seen = tl.load(my_flags + r, mask=peers, other=0, volatile=True)
        waiting = tl.sum((peers & (seen < epoch)).to(tl.int32), axis=0)
    if FENCE:
        fence_system(r)
    tl.debug_barrier()  # every thread of the program reads after the fence


@triton.jit
def fence_system(lanes):
    """``fence.acq_rel.sys`` in every thread that holds an element of ``lanes`` (any int
    tensor; inline assembly, so CUDA only: the Triton interpreter runs none)."""
    tl.inline_asm_elementwise("fence.acq_rel.sys;\n\tmov.b32 $0, $1;", "=r,r", [lanes.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)
