"""Multi-group data parallelism with FP32 gradient buckets.

Design notes (docs/ARCHITECTURE.md, "Loss normalisation and gradient reduction"):

- Every trainable parameter has one replica group (dense: DP group; routed
  experts: EP-DP group; ``None``: not replicated). Its gradient is reduced inside
  that group only, so one wrapper serves dense and expert parameters at once,
  which a single-group ``DistributedDataParallel`` cannot.
- Each parameter's *main grad* is a view into a flat bucket of ``grad_dtype``
  (FP32). A post-accumulate-grad hook adds autograd's BF16/FP32 ``param.grad``
  into it and frees ``param.grad`` at once, so accumulation over microbatches
  happens in FP32 and no parameter-sized BF16 gradient outlives its backward op.
- Reductions happen once per optimizer step. Under ``no_sync()`` hooks only
  accumulate. Outside it (the last microbatch) a bucket is launched as soon as
  all its members got a gradient *and* every earlier bucket was launched: launch
  order is the bucket order, identical on all ranks, whatever order gradients
  arrive in. ``finish_grad_sync()`` launches the rest in the same order (buckets
  whose parameters saw no gradient in the last microbatch, or all of them after a
  pipeline schedule run entirely under ``no_sync()``) and waits. Buckets are never
  zeroed at finalisation: gradients accumulated in earlier microbatches survive.
- ``reduce_op="sum"`` is what the trainer uses: each rank's loss is its token-loss
  sum divided by the *global* target-token count, so the true gradient is the sum
  over replicas for dense and expert parameters alike. ``"mean"`` divides by the
  group size (PyTorch DDP's convention) for comparisons.
- ``mode="reduce_scatter"``: tensors the optimizer shards (same rule as
  moe_optim) are reduce-scattered into owner-major buckets, so each rank gets only
  its shard of every tensor, valid after ``finish_grad_sync()``; the other tensors
  are all-reduced. Moves half the gradient bytes of ``all_reduce``.
- ``merge_microbatch_gradients=n`` (> 1): a gradient delivered through ``add_gradient``
  as a mergeable callable (it has ``merged(other)``) under ``no_sync()`` is held, not
  added; the parameter's next gradients are merged into it and up to ``n`` are added in
  one call (moe_model's expert weight gradients: one GEMM over all their microbatches'
  rows, one FP32 read-modify-write of the main grad instead of ``n``). Nothing is held
  past the window: a held gradient is added before its parameter counts as arrived
  (whether the synchronised microbatch's gradient comes through ``add_gradient`` or
  autograd's hook), so before its bucket can launch, and ``finish_grad_sync()`` adds
  whatever is still held before it launches a bucket.
- ``synced`` tells a consumer (moe_optim's optimizer) whether the main grads hold no
  contribution that is not reduced: false from ``no_sync()`` or the first synchronised
  gradient until ``finish_grad_sync()``, true otherwise (``zero_grad()`` too: zeros agree
  on every rank). It changes only where Python runs, so a CUDA-graph replay (which runs
  none) finds it as the captured window's ``finish_grad_sync()`` left it: true.

Main-grad shapes seen through iteration (the GradSource contract of moe_optim):
the parameter's shape, except for sharded tensors in ``reduce_scatter`` mode,
whose main grad is a ``[G, numel/G]`` view whose row ``r`` is rank ``r``'s shard
(only the own row is reduced). In both cases ``main_grad.reshape(G, -1)[r]`` is
rank ``r``'s shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from moe_ddp.accumulate import accumulate_
from moe_ddp.layout import BucketSpec, ParamEntry, is_sharded, plan_buckets

ReplicaGroupOf = Callable[[str, nn.Parameter], "dist.ProcessGroup | None"]


@dataclass
class DDPConfig:
    mode: Literal["all_reduce", "reduce_scatter"] = "all_reduce"  # gradient sync collective
    reduce_op: Literal["sum", "mean"] = "sum"  # sum: loss is pre-divided by global tokens
    bucket_cap_mb: float = 64.0  # flat bucket size cap (MiB of grad storage)
    min_shard_numel: int = 4096  # smaller tensors are never sharded (must match the optimizer)
    grad_dtype: str = "float32"  # main-grad storage dtype
    comm_dtype: str | None = None  # reduction dtype; None: grad_dtype
    # up to this many microbatches' gradients of a parameter added in one call: under
    # no_sync(), a mergeable gradient given to add_gradient (one with merged(), e.g.
    # moe_model's expert weight gradients) is held and merged with the parameter's next
    # ones; 1/depth of the main-grad read-modify-writes, for the memory of what is held
    merge_microbatch_gradients: int = 1

    def validate(self) -> None:
        if self.mode not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"DDPConfig.mode must be all_reduce or reduce_scatter, got {self.mode!r}")
        if self.reduce_op not in ("sum", "mean"):
            raise ValueError(f"DDPConfig.reduce_op must be sum or mean, got {self.reduce_op!r}")
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"DDPConfig.bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        if self.merge_microbatch_gradients < 1:
            raise ValueError(
                f"DDPConfig.merge_microbatch_gradients must be >= 1, got {self.merge_microbatch_gradients}"
            )
        if self.min_shard_numel < 1:
            raise ValueError(f"DDPConfig.min_shard_numel must be >= 1, got {self.min_shard_numel}")
        for name in ("grad_dtype", "comm_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(getattr(torch, value, None), torch.dtype):
                raise ValueError(f"DDPConfig.{name} is not a torch dtype name: {value!r}")


def sent_bytes(collective: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective over ``nbytes`` with the ring algorithm.

    all-reduce sends ``2(G-1)/G`` of the buffer, reduce-scatter ``(G-1)/G`` of its
    input; the counter compares modes with these, not with NCCL internals.
    """
    if collective == "all_reduce":
        return 2 * (group_size - 1) * nbytes // group_size
    if collective == "reduce_scatter":
        return (group_size - 1) * nbytes // group_size
    return 0


class _Bucket:
    """A flat gradient buffer of one replica group and its in-flight reduction."""

    def __init__(
        self,
        spec: BucketSpec,
        group: dist.ProcessGroup | None,
        device: torch.device,
        grad_dtype: torch.dtype,
        comm_dtype: torch.dtype,
    ) -> None:
        self.spec = spec
        self.group = group
        self.buffer = torch.zeros(spec.numel, dtype=grad_dtype, device=device)
        self.comm_dtype = comm_dtype
        self.rank = dist.get_rank(group) if group is not None else 0
        self.pending = len(spec.params)  # members still without a gradient this window
        self.launched = False
        self._work: dist.Work | None = None
        self._comm_buffer: torch.Tensor | None = None

    def launch(self, mean: bool) -> int:
        """Start the reduction; returns the bytes this rank sends."""
        self.launched = True
        spec = self.spec
        if spec.collective == "none":
            return 0
        if mean:
            self.buffer.div_(spec.group_size)
        buf = self.buffer
        if self.comm_dtype != buf.dtype:
            buf = self._comm_buffer = buf.to(self.comm_dtype)
        if spec.collective == "all_reduce":
            self._work = dist.all_reduce(buf, group=self.group, async_op=True)
        else:
            own = buf[self.rank * spec.region_numel : (self.rank + 1) * spec.region_numel]
            self._work = dist.reduce_scatter_tensor(own, buf, group=self.group, async_op=True)
        return sent_bytes(spec.collective, buf.numel() * buf.element_size(), spec.group_size)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._comm_buffer is not None:
            if self.spec.collective == "reduce_scatter":
                own = slice(self.rank * self.spec.region_numel, (self.rank + 1) * self.spec.region_numel)
                self.buffer[own].copy_(self._comm_buffer[own])
            else:
                self.buffer.copy_(self._comm_buffer)
            self._comm_buffer = None

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def reset(self) -> None:
        self.buffer.zero_()
        self.pending = len(self.spec.params)
        self.launched = False


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    group: dist.ProcessGroup | None
    bucket: _Bucket
    main_grad: torch.Tensor  # a view into bucket.buffer
    seen: bool = False  # got a gradient while synchronisation was enabled
    held: Callable[[torch.Tensor], None] | None = None  # a mergeable gradient not yet added
    held_count: int = 0  # microbatches merged into ``held``

    def __post_init__(self) -> None:
        # What the hook accumulates into: flat when contiguous, else the [G, piece] rows
        # view of an owner-major bucket (``accumulate_`` takes 1-D or row-strided 2-D).
        main = self.main_grad
        self.accumulation_view = main.view(-1) if main.is_contiguous() else main


def _weak_on_grad(ref: weakref.ReferenceType[MultiGroupDDP]) -> Callable[[nn.Parameter], None]:
    """The hook: forwards to the live object; once it is gone the module is plain again
    (the gradient stays in ``param.grad``)."""

    def on_grad(param: nn.Parameter) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad(param)

    return on_grad


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


class MultiGroupDDP:
    """Gradient buckets and once-per-step reduction for a module's parameters.

    The module is not wrapped in a new ``nn.Module``: it keeps its parameter
    names and is called as before. Create this after the module has its final
    placement, dtype and parameter set (hooks hold the parameter objects).

    Iterating yields ``(name, param, main_grad, replica_group)`` per trainable
    parameter in registration order: moe_optim's ``GradSource``.
    """

    def __init__(
        self,
        module: nn.Module,
        replica_group_of: ReplicaGroupOf,
        config: DDPConfig | None = None,
    ) -> None:
        self.config = config = config or DDPConfig()
        config.validate()
        self.module = module
        grad_dtype = getattr(torch, config.grad_dtype)
        comm_dtype = getattr(torch, config.comm_dtype or config.grad_dtype)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        groups: list[dist.ProcessGroup | None] = []
        entries: list[ParamEntry] = []
        for name, param in named:
            group = replica_group_of(name, param)
            size = 1
            if group is not None:
                if dist.get_rank(group) < 0:
                    raise ValueError(
                        f"replica group of parameter {name!r} does not contain this rank "
                        f"({dist.get_rank()})"
                    )
                size = dist.get_world_size(group)
            if size > 1:
                sharded = config.mode == "reduce_scatter" and is_sharded(
                    param.numel(), size, config.min_shard_numel
                )
                collective = "reduce_scatter" if sharded else "all_reduce"
            else:
                collective = "none"
            groups.append(group)
            entries.append(ParamEntry(param.numel(), (id(group), param.device), size, collective))

        cap_numel = max(1, int(config.bucket_cap_mb * 2**20) // grad_dtype.itemsize)
        self._buckets: list[_Bucket] = []
        self._slots: dict[nn.Parameter, _Slot] = {}
        self._order: list[_Slot] = []
        for spec in plan_buckets(entries, cap_numel):
            first = spec.params[0]
            bucket = _Bucket(spec, groups[first], named[first][1].device, grad_dtype, comm_dtype)
            self._buckets.append(bucket)
            for index, offset in zip(spec.params, spec.offsets, strict=True):
                name, param = named[index]
                piece = spec.piece_numel(entries[index])
                if spec.collective == "reduce_scatter":
                    view = bucket.buffer.view(spec.group_size, spec.region_numel)
                    main_grad = view[:, offset : offset + piece]
                else:
                    main_grad = bucket.buffer[offset : offset + piece].view(param.shape)
                self._slots[param] = _Slot(name, param, groups[index], bucket, main_grad)
        self._order = [self._slots[p] for _, p in named]
        # The hooks live on the parameters' C++ gradient accumulators, which Python's cycle
        # collector cannot see: a hook holding ``self`` would keep every FP32 bucket alive
        # after the last reference to this object is gone. They hold a weak reference.
        on_grad = _weak_on_grad(weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for _, p in named]

        self._sync_enabled = True
        self._synced = True  # the main grads hold no contribution that is not reduced
        self._next_launch = 0
        self._bytes: dict[tuple[int, ...], int] = {}
        self.last_sync_bytes: dict[tuple[int, ...], int] = {}
        """Bytes this rank sent per replica group (keyed by its global ranks) in the
        last ``finish_grad_sync()``."""

    def close(self) -> None:
        """Remove the gradient hooks: the parameters stop feeding this object's buckets.

        Dropping the last reference has the same effect (the hooks hold a weak one);
        ``close()`` makes it explicit, e.g. before wrapping the module again.
        """
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # -- accumulation ----------------------------------------------------------

    def _on_grad(self, param: nn.Parameter) -> None:
        if param.grad is None:  # autograd's node ran without a gradient: it came via add_gradient
            return
        slot = self._open_slot(param)
        accumulate_(slot.accumulation_view, param.grad)
        param.grad = None
        self._arrived(slot)

    def accepts(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s gradient may be delivered through ``add_gradient``."""
        return param in self._slots

    def add_gradient(self, param: nn.Parameter, add: Callable[[torch.Tensor], None]) -> None:
        """A gradient delivered straight into the main grad: ``add(target)`` adds it to the
        FP32 accumulator (1-D, or ``[G, piece]`` rows of an owner-major bucket, elements in
        the parameter's storage order), then it counts as arrived, as from the hook.

        The ``moe_model.GradientSink`` protocol: the expert GEMMs' weight-gradient kernel
        adds in its epilogue, a dense layer's weight-gradient GEMM writes FP32 with beta 1,
        so no BF16 gradient is written and no accumulation pass re-reads it.
        ``param.grad`` stays ``None``.

        With ``config.merge_microbatch_gradients > 1``, an ``add`` that has
        ``merged(other)`` (one callable that adds both, or ``None`` where they cannot
        share a call) may be held under ``no_sync()`` and merged with the parameter's
        next ones.
        """
        slot = self._open_slot(param)
        held, slot.held = slot.held, None
        count = 1
        if held is not None:
            merged = held.merged(add)  # type: ignore[attr-defined]
            if merged is None:
                held(slot.accumulation_view)
            else:
                add, count = merged, slot.held_count + 1
        if (count < self.config.merge_microbatch_gradients and not self._sync_enabled
                and not slot.seen and callable(getattr(add, "merged", None))):
            # no_sync, and the parameter has not arrived: its bucket cannot launch before
            # its next gradient or the finish, which add what is held first
            slot.held, slot.held_count = add, count
            return
        add(slot.accumulation_view)
        self._arrived(slot)

    def _add_held(self, slot: _Slot) -> None:
        """Add ``slot``'s held gradient, if any, on its own (no partner came for it)."""
        held = slot.held
        if held is None:
            return
        if slot.bucket.launched:
            raise RuntimeError(
                f"parameter {slot.name!r} still holds a gradient merged under no_sync(), but its "
                "bucket was already reduced: the gradient would be missing from the reduction"
            )
        slot.held = None
        held(slot.accumulation_view)

    def _open_slot(self, param: nn.Parameter) -> _Slot:
        slot = self._slots[param]
        if slot.bucket.launched:
            raise RuntimeError(
                f"parameter {slot.name!r} received a gradient after its bucket was reduced; "
                "run all but the last backward under no_sync() and call zero_grad() after "
                "the optimizer step"
            )
        return slot

    def _arrived(self, slot: _Slot) -> None:
        if self._sync_enabled and not slot.seen:
            self._add_held(slot)  # an earlier microbatch's, held to merge: before any launch
            self._synced = False
            slot.seen = True
            slot.bucket.pending -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch buckets in bucket order while the next one is complete."""
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        sent = bucket.launch(self.config.reduce_op == "mean")
        if bucket.group is not None and sent:
            key = _group_ranks(bucket.group)
            self._bytes[key] = self._bytes.get(key, 0) + sent

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without launching reductions (all microbatches but the last);
        the main grads count as not synced from here to ``finish_grad_sync()``."""
        previous, self._sync_enabled = self._sync_enabled, False
        self._synced = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Add held gradients, launch the remaining buckets in bucket order and wait for
        all reductions; then ``synced`` is true."""
        for slot in self._order:
            self._add_held(slot)
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        for bucket in self._buckets:
            bucket.wait()
        self.last_sync_bytes, self._bytes = self._bytes, {}
        self._synced = True

    def zero_grad(self) -> None:
        """Zero every bucket and open a new accumulation window; ``synced`` is true (zeros
        agree on every rank) until its first gradient or ``no_sync()``."""
        for bucket in self._buckets:
            if bucket.in_flight:
                raise RuntimeError("zero_grad() while reductions are in flight; call finish_grad_sync()")
            bucket.reset()
        for slot in self._order:
            slot.seen = False
            slot.held = None  # a gradient of the discarded window
            slot.param.grad = None
        self._next_launch = 0
        self._bytes = {}
        self._synced = True

    def set_param_grads(self) -> None:
        """Point every trainable parameter's ``.grad`` at its reduced main grad, so a
        ``torch.optim`` optimizer can step on the synchronised gradients.

        Without this call a torch optimizer does nothing: the gradient hooks free
        ``param.grad`` as they accumulate, so after ``finish_grad_sync()`` every ``.grad``
        is ``None``. The ``.grad`` set here is a view of the bucket (no copy), valid until
        ``zero_grad()``, which sets it back to ``None``; call that (not only the optimizer's
        ``zero_grad``) before the next backward. A torch optimizer keeps whole tensors, so
        every main grad must be whole and of its parameter's dtype: refused, naming the
        parameter, after ``no_sync()`` without ``finish_grad_sync()``, for a tensor
        reduce-scattered in ``"reduce_scatter"`` mode, and for a parameter whose dtype is
        not ``grad_dtype`` (BF16 weights need FP32 master weights, e.g. moe_optim's).
        """
        if not self._synced:
            raise RuntimeError("set_param_grads() before finish_grad_sync(): the main grads are not reduced")
        for slot in self._order:
            if slot.bucket.spec.collective == "reduce_scatter":
                raise ValueError(
                    f"parameter {slot.name!r} is reduce-scattered (DDPConfig.mode='reduce_scatter'): "
                    "this rank holds only its shard; use mode='all_reduce' with a torch optimizer"
                )
            if slot.param.dtype != slot.main_grad.dtype:
                raise ValueError(
                    f"parameter {slot.name!r} is {slot.param.dtype} but its main grad is "
                    f"{slot.main_grad.dtype} (DDPConfig.grad_dtype): a torch optimizer needs "
                    "them equal; keep FP32 master weights (e.g. moe_optim)"
                )
        for slot in self._order:
            slot.param.grad = slot.main_grad

    # -- the GradSource --------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[str, nn.Parameter, torch.Tensor, dist.ProcessGroup | None]]:
        for slot in self._order:
            yield slot.name, slot.param, slot.main_grad, slot.group

    def main_grad(self, name: str) -> torch.Tensor:
        """The main-grad view of the parameter called ``name``."""
        for slot in self._order:
            if slot.name == name:
                return slot.main_grad
        raise KeyError(f"no trainable parameter named {name!r}")

    @property
    def synced(self) -> bool:
        """Whether every main grad is reduced and complete, as an optimizer step needs.

        False from ``no_sync()`` or a gradient outside it until ``finish_grad_sync()``;
        true before (construction, ``zero_grad()``: the zeros agree on every rank).
        Part of moe_optim's ``GradSource``: its ``step()`` refuses to run while false.
        """
        return self._synced

    def grad_is_sharded(self, param: nn.Parameter) -> bool:
        """Whether ``param``'s main grad is reduce-scattered over its replica group, so only
        this rank's row of ``main_grad.reshape(G, -1)`` is reduced. Part of moe_optim's
        ``GradSource``: the optimizer refuses to keep such a tensor replicated."""
        slot = self._slots.get(param)
        if slot is None:
            raise KeyError(f"a parameter of shape {tuple(param.shape)} is not a trainable "
                           "parameter of this MultiGroupDDP")
        return slot.bucket.spec.collective == "reduce_scatter"

    def grad_buffers(self) -> list[tuple[dist.ProcessGroup | None, torch.Tensor]]:
        """Every flat bucket with its replica group, in launch order."""
        return [(b.group, b.buffer) for b in self._buckets]

    @property
    def launched_buckets(self) -> int:
        """Buckets launched so far in this window (overlap diagnostics)."""
        return sum(b.launched for b in self._buckets)
