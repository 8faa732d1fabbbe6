"""Compile the Triton kernels for Hopper (sm_90) without a GPU and inspect the PTX.

Three properties the design relies on: the put kernel stores 128-bit vectors through
peer pointers (bandwidth) and fits its registers without spilling (a version that
planned the rows inside it took 255 registers with spills, and a dispatch 5x the time on
two H200s), and the top-k sum has no fused multiply-add (so it equals the PyTorch
reference bit for bit). The plan kernels must at least lower for Hopper.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
compiler = pytest.importorskip("triton.compiler")
from moe_ep_transport import _transport_kernels as kernels  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

_HOPPER = GPUTarget("cuda", 90, 32)


def _compile(fn, signature: dict[str, str], constexprs: dict, aligned: tuple[str, ...] = ("width",),
             **options):
    """The kernel compiled for sm_90 as a launch would build it: pointers 16-byte aligned,
    ``aligned`` ints multiples of 16."""
    names = list(signature)
    aligned_names = [n for n, t in signature.items() if t.startswith("*")] + list(aligned)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned_names}
    src = compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=_HOPPER, options=options)


def _ptx(fn, signature: dict[str, str], constexprs: dict, aligned: tuple[str, ...] = ("width",),
         **options) -> str:
    return _compile(fn, signature, constexprs, aligned, **options).asm["ptx"]


def _resources(tmp: Path, fn, signature: dict[str, str], constexprs: dict, aligned: tuple[str, ...],
               **options) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread: spills) of the sm_90 cubin, read by
    the cuobjdump that ships with Triton (skipped where this Triton has none)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip(f"no cuobjdump at {tool}")
    path = tmp / "kernel.cubin"
    path.write_bytes(_compile(fn, signature, constexprs, aligned, **options).asm["cubin"])
    usage = subprocess.run([str(tool), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                           check=True, timeout=60).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"\b{re.escape(op)}\b", ptx))


_PUT_SIGNATURE = {
    "src_ptr": "*i32", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64",
    "table_ptr": "*i64", "byte_offset": "i32", "local_addr": "i64", "me": "i32", "meta_src_ptr": "*i64", "meta_w_ptr": "*fp32",
    "n_rows": "i32", "width": "i32", "inbox_stride": "i32", "clear_ptr": "*i64", "n_clear": "i32",
    "put_programs": "i32", "PER_SRC": "constexpr", "DEDUP": "constexpr",
    "HAS_LOCAL": "constexpr", "SKIP_LOCAL": "constexpr", "HAS_META": "constexpr", "HAS_META_W": "constexpr",
    "CLEAR": "constexpr", "REMOTE_ROWS": "constexpr", "BLOCK_R": "constexpr",
    "BLOCK_W": "constexpr",
}


@pytest.mark.parametrize("local,skip,meta,dedup,clear,remote", [(True, False, True, True, False, True),
                                                                (True, False, True, True, False, False),
                                                                (False, True, False, False, False, True),
                                                                (False, False, False, False, True, True)])
def test_put_rows_stores_128_bit_vectors_through_peer_pointers(
    local: bool, skip: bool, meta: bool, dedup: bool, clear: bool, remote: bool
) -> None:
    """``remote=False``: the token put whose inbox rows the copy engines move (local rows and metadata)."""
    consts = {"HAS_LOCAL": local, "SKIP_LOCAL": skip, "HAS_META": meta, "BLOCK_R": 4, "BLOCK_W": 1024,
              "PER_SRC": 8 if dedup else 1, "DEDUP": dedup, "HAS_META_W": meta, "CLEAR": clear,
              "REMOTE_ROWS": remote}
    ptx = _ptx(kernels._put_rows_kernel, _PUT_SIGNATURE, consts, aligned=("width", "byte_offset", "local_addr"),
               num_warps=8)
    assert _count(ptx, "st.global.v4.b32") > 0 and _count(ptx, "st.global.b32") == 0


def test_the_dispatch_put_fits_its_registers(tmp_path: Path) -> None:
    """The token put of a dispatch (local rows, weights in the metadata, once per rank): at
    most 128 registers, none spilled, so that two programs of 8 warps share an SM."""
    consts = {"HAS_LOCAL": True, "SKIP_LOCAL": False, "HAS_META": True, "BLOCK_R": 4, "BLOCK_W": 1024,
              "PER_SRC": 8, "DEDUP": True, "HAS_META_W": True, "CLEAR": False, "REMOTE_ROWS": True}
    regs, stack = _resources(tmp_path, kernels._put_rows_kernel, _PUT_SIGNATURE, consts,
                             aligned=("width", "byte_offset", "local_addr"), num_warps=8)
    assert regs <= 128 and stack == 0, (regs, stack)


def test_topk_sum_has_no_fused_multiply_add() -> None:
    sig = {"inbox_ptr": "*bf16", "local_ptr": "*bf16", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64",
           "w_ptr": "*fp32", "y_ptr": "*bf16", "rows_out_ptr": "*bf16", "me": "i32", "width": "i32",
           **_WAIT_ARGS, "K": "constexpr", "STORE_ROWS": "constexpr", "BLOCK_W": "constexpr", **_WAIT_CONSTS}
    consts = {"K": 8, "STORE_ROWS": True, "BLOCK_W": 1024, **_NO_WAIT}
    ptx = _ptx(kernels._topk_gather_sum_kernel, sig, consts, num_warps=4, enable_fp_fusion=False)
    assert _count(ptx, "fma.rn.f32") == 0 and _count(ptx, "mul.rn.f32") > 0
    assert _count(ptx, "ld.global.v4.b32") > 0  # 8 BF16 per load
    fused = _ptx(kernels._topk_gather_sum_kernel, sig, consts, num_warps=4, enable_fp_fusion=True)
    assert _count(fused, "fma.rn.f32") > 0  # the option is what keeps products and sums apart


def test_plan_kernels_compile_for_hopper() -> None:
    """The plan kernels lower for sm_90 at the benchmark's shapes (64 experts, 2 ranks)."""
    from moe_ep_transport import _plan_kernels as plan_kernels

    _ptx(plan_kernels._rank_slots_kernel,
         {"expert_ptr": "*i64", "rank_ptr": "*i32", "hist_ptr": "*i32", "n_slots": "i32", "n_experts": "i32",
          "BLOCK_S": "constexpr", "E_P": "constexpr"},
         {"BLOCK_S": 128, "E_P": 64}, aligned=(), num_warps=4)
    scan = _ptx(plan_kernels._cumsum_blocks_kernel,
                {"hist_ptr": "*i32", "cum_ptr": "*i32", "n_blocks": "i32", "n_experts": "i32",
                 "peer_table_ptr": "*i64", "byte_offset": "i32", "me": "i32", "n_ranks": "i32",
                 "ticket_ptr": "*i32", "counts_ptr": "*i32", "stats_ptr": "*i64", "table_ptr": "*i64",
                 "recv_ptr": "*i64", "offsets_ptr": "*i32", "sum_ptr": "*i64", "capacity": "i32", "salt": "i32",
                 "epoch_ptr": "*i64", "parity": "i32", "flag_table_ptr": "*i64",
                 "CHUNK": "constexpr", "PUBLISH": "constexpr", "M_P": "constexpr", "E_P": "constexpr",
                 "CELLS": "constexpr", "ACCUMULATE": "constexpr", "WAIT": "constexpr", "FLAGS_P": "constexpr",
                 "FENCE": "constexpr"},
                {"CHUNK": 1024, "PUBLISH": True, "M_P": 2, "E_P": 64, "CELLS": True, "ACCUMULATE": True,
                 "WAIT": True, "FLAGS_P": 2, "FENCE": True}, aligned=(), num_warps=4)
    _assert_system_scope_barrier(scan)  # the count exchange's barrier, passed by the scan's last program
    assert _count(scan, "fence.acq_rel.sys") > 0  # each program's count puts ordered before its ticket
    # The ticket: one atomic add per program at GPU scope, acquiring and releasing.
    assert _count(scan, "atom.global.gpu.acq_rel.add") == 1, _count(scan, "atom.")
    cells = _ptx(plan_kernels._plan_cells_kernel,
                 {"counts_ptr": "*i32", "stats_ptr": "*i64", "table_ptr": "*i64", "recv_ptr": "*i64",
                  "offsets_ptr": "*i32", "sum_ptr": "*i64", "capacity": "i32", "salt": "i32", "me": "i32",
                  "n_ranks": "i32", "n_experts": "i32", "epoch_ptr": "*i64", "parity": "i32",
                  "flag_table_ptr": "*i64",
                  "M_P": "constexpr", "E_P": "constexpr", "ACCUMULATE": "constexpr", "WAIT": "constexpr",
                  "FLAGS_P": "constexpr"},
                 {"M_P": 2, "E_P": 64, "ACCUMULATE": True, "WAIT": True, "FLAGS_P": 2}, aligned=(), num_warps=4)
    _assert_system_scope_barrier(cells)  # the count exchange's barrier, passed by the cell kernel
    _ptx(plan_kernels._plan_rows_kernel,
         {"expert_ptr": "*i64", "rank_in_block_ptr": "*i32", "cum_ptr": "*i32", "table_ptr": "*i64",
          "recv_end_ptr": "*i64", "dst_rank_ptr": "*i64", "dst_row_ptr": "*i64", "row_src_ptr": "*i64",
          "n_slots": "i32", "n_rows": "i32", "n_ranks": "i32", "n_experts": "i32",
          "BLOCK": "constexpr", "E_P": "constexpr"},
         {"BLOCK": 128, "E_P": 64}, aligned=(), num_warps=4)


def test_signal_barrier_orders_at_system_scope() -> None:
    """The flag store releases and the spin acquires at system scope (peers read over NVLink)."""
    ptx = _ptx(kernels._signal_barrier_kernel,
               {"epoch_ptr": "*i64", "parity": "i32", "flag_table_ptr": "*i64", "me": "i32", "n_ranks": "i32",
                "M_P": "constexpr"},
               {"M_P": 2}, aligned=(), num_warps=1)
    _assert_system_scope_barrier(ptx)


_WAIT_ARGS = {"epoch_ptr": "*i64", "parity": "i32", "flag_table_ptr": "*i64", "n_ranks": "i32"}
_WAIT_CONSTS = {"WAIT": "constexpr", "FLAGS_P": "constexpr", "FENCE": "constexpr"}
_NO_WAIT = {"WAIT": False, "FLAGS_P": 2, "FENCE": False}
_FINISH_RECEIVE = {
    "out_ptr": "*i32", "inbox_ptr": "*i32", "row_src_ptr": "*i64", "origin_in_ptr": "*i64",
    "origin_out_ptr": "*i64", "slot_rows_ptr": "*i64", "w_out_ptr": "*fp32", "max_slots": "i32", "me": "i32",
    "n_rows": "i32", "width": "i32", "inbox_stride": "i32", **_WAIT_ARGS, "PER_SRC": "constexpr",
    "DEDUP": "constexpr", "COPY_ORIGIN": "constexpr", "SLOT_ROWS": "constexpr", "W_OUT": "constexpr",
    "BLOCK_R": "constexpr", "BLOCK_W": "constexpr", **_WAIT_CONSTS}
_FINISH_RECEIVE_CONSTS = {"PER_SRC": 8, "DEDUP": True, "COPY_ORIGIN": True, "SLOT_ROWS": True, "W_OUT": True,
                          "BLOCK_R": 4, "BLOCK_W": 1024}


def test_a_receive_passes_the_barrier_in_every_program_at_system_scope() -> None:
    """The receive kernel's own barrier: its first program releases the flag at system
    scope, every program spins on volatile loads of the peers' flags (no atomics for
    thousands of programs to queue on) and fences acquire-release at system scope before
    it reads; without a wait none of it is there."""
    ptx = _ptx(kernels._finish_receive_kernel, _FINISH_RECEIVE,
               {**_FINISH_RECEIVE_CONSTS, "WAIT": True, "FLAGS_P": 2, "FENCE": True}, num_warps=8)
    atoms = re.findall(r"atom\.[\w.]+", ptx)
    assert any("release" in a and "sys" in a and "exch" in a for a in atoms), atoms
    assert not any("acquire" in a for a in atoms), atoms
    assert _count(ptx, "ld.volatile.global.b64") > 0 and _count(ptx, "fence.acq_rel.sys") > 0
    plain = _ptx(kernels._finish_receive_kernel, _FINISH_RECEIVE, {**_FINISH_RECEIVE_CONSTS, **_NO_WAIT},
                 num_warps=8)
    assert not re.findall(r"atom\.|fence\.|ld\.volatile", plain)


def _assert_system_scope_barrier(ptx: str) -> None:
    atoms = re.findall(r"atom\.[\w.]+", ptx)
    assert any("release" in a and "sys" in a and "exch" in a for a in atoms), atoms
    assert any("acquire" in a and "sys" in a and "add" in a for a in atoms), atoms


@pytest.mark.parametrize("stage", [False, True], ids=["stores", "staged"])
def test_destination_sum_kernels_lower_for_hopper(stage: bool) -> None:
    """The partial sums are unfused (bit-equal to PyTorch) and stored as 128-bit vectors, into
    the peers or (``stage``: the copy engines move them) into local staging rows."""
    sig = {"rows_ptr": "*bf16", "w_ptr": "*fp32", "slot_rows_ptr": "*i64", "row_src_ptr": "*i64",
           "origin_ptr": "*i64", "n_rows": "i32", "table_ptr": "*i64",
           "byte_offset": "i32", "me": "i32", "max_tokens": "i32", "width": "i32", "stage_ptr": "*fp32",
           "K": "constexpr", "HAS_W": "constexpr", "STAGE": "constexpr", "BLOCK_W": "constexpr"}
    ptx = _ptx(kernels._put_partial_sums_kernel, sig, {"K": 8, "HAS_W": True, "STAGE": stage, "BLOCK_W": 1024},
               aligned=("width", "byte_offset"), num_warps=4, enable_fp_fusion=False)
    assert _count(ptx, "fma.rn.f32") == 0 and _count(ptx, "mul.rn.f32") > 0
    assert _count(ptx, "st.global.v4.b32") > 0 and _count(ptx, "st.global.b32") == 0
    _ptx(kernels._sum_partials_kernel,
         {"partials_ptr": "*fp32", "dst_rank_ptr": "*i64", "y_ptr": "*bf16", "n_ranks": "i32",
          "max_tokens": "i32", "width": "i32", "epoch_ptr": "*i64", "parity": "i32", "flag_table_ptr": "*i64",
          "me": "i32", "K": "constexpr", "BLOCK_W": "constexpr", **_WAIT_CONSTS},
         {"K": 8, "BLOCK_W": 1024, "WAIT": True, "FLAGS_P": 2, "FENCE": True}, num_warps=4,
         enable_fp_fusion=False)
    _ptx(kernels._combine_grads_kernel,  # combine's backward reading the received token gradients
         {"g_ptr": "*bf16", "w_ptr": "*fp32", "rows_ptr": "*bf16", "scaled_ptr": "*bf16", "grad_w_ptr": "*fp32",
          "width": "i32", "bound_ptr": "*fp32", "inbox_ptr": "*bf16", "row_src_ptr": "*i64", "origin_ptr": "*i64",
          "me": "i32", "inbox_stride": "i32", **_WAIT_ARGS, "K": "constexpr", "SCALED": "constexpr",
          "GRAD_W": "constexpr", "BLOCK_W": "constexpr", "HAS_BOUND": "constexpr", "RECEIVE": "constexpr",
          "PER_SRC": "constexpr", "DEDUP": "constexpr", **_WAIT_CONSTS},
         {"K": 1, "SCALED": True, "GRAD_W": True, "BLOCK_W": 1024, "HAS_BOUND": False, "RECEIVE": True,
          "PER_SRC": 8, "DEDUP": True, "WAIT": True, "FLAGS_P": 2, "FENCE": True},
         num_warps=4)
    _ptx(kernels._copy_rows_kernel,  # the weights' return, out of the slab
         {"src_ptr": "*i32", "dst_ptr": "*i32", "n_rows": "i32", "width": "i32", "epoch_ptr": "*i64",
          "parity": "i32", "flag_table_ptr": "*i64", "me": "i32", "n_ranks": "i32", "BLOCK_R": "constexpr",
          "BLOCK_W": "constexpr", **_WAIT_CONSTS},
         {"BLOCK_R": 4, "BLOCK_W": 1024, "WAIT": True, "FLAGS_P": 2, "FENCE": True}, aligned=(), num_warps=8)
