"""MultiGroupDDP against single-process training and PyTorch DDP (gloo, 2-4 ranks).

The toy model has what matters for DDP: dense tensors of several sizes (some
divisible by the group size, some not, some below the shard threshold) and
routed experts that are separate parameters, so an expert that receives no
tokens in a microbatch gets no gradient at all (its hook does not fire).
Expert ids arrive with the data, which lets each rank route only to the experts
it holds: no EP transport is needed to test the replica groups.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from moe_ddp import DDPConfig, MultiGroupDDP, is_sharded
from moe_testing import run_distributed
from torch import nn

D_IN, HIDDEN, N_EXPERTS, TOKENS, MICRO = 9, 16, 4, 12, 3
MIN_SHARD = 32
TINY_CAP_MB = 600 / 2**20  # ~150 FP32 elements: many buckets, so ordering matters


def bucket_launched(ddp: MultiGroupDDP, target: torch.Tensor) -> bool:
    """Whether the bucket ``target`` lies in was launched: buckets launch in the order of
    ``grad_buffers()``, so the first ``launched_buckets`` of them are."""
    storages = [buf.untyped_storage().data_ptr() for _, buf in ddp.grad_buffers()]
    return storages.index(target.untyped_storage().data_ptr()) < ddp.launched_buckets


class _MergeableGradient:
    """A weight gradient as moe_model's grouped experts deliver it: computed when called
    (``target += sum dy^T @ x``), mergeable with the same weight's next ones."""

    calls: list[int] = []  # microbatches added per call, this process
    ddp: MultiGroupDDP | None = None  # set: each call records whether its bucket had launched
    added_after_launch: list[bool] = []

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs

    def merged(self, other: object) -> _MergeableGradient | None:
        return _MergeableGradient(self.pairs + other.pairs) if isinstance(other, _MergeableGradient) else None

    def __call__(self, target: torch.Tensor) -> None:
        _MergeableGradient.calls.append(len(self.pairs))
        if _MergeableGradient.ddp is not None:
            _MergeableGradient.added_after_launch.append(bucket_launched(_MergeableGradient.ddp, target))
        dw = sum(dy.t() @ x for x, dy in self.pairs)  # in the weight's storage order
        target.add_(dw.reshape(target.shape))


class _IntoSink(torch.autograd.Function):
    """``x @ w^T`` whose weight gradient is delivered through ``sink.add_gradient`` (the
    route moe_model's grouped experts take into the main grads), not autograd; with
    ``mergeable``, as a gradient the sink may hold and merge."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: nn.Parameter, sink: MultiGroupDDP, mergeable: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.sink, ctx.mergeable = w, sink, mergeable
        return x @ w.detach().t()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (x,) = ctx.saved_tensors
        if ctx.mergeable:
            ctx.sink.add_gradient(ctx.w, _MergeableGradient([(x, dy)]))
        else:
            dw = dy.t() @ x  # in the weight's storage order; the target may be [G, piece] rows
            ctx.sink.add_gradient(ctx.w, lambda target: target.add_(dw.reshape(target.shape)))
        return dy @ ctx.w.detach(), None, None, None


class ToyMoE(nn.Module):
    def __init__(self, experts: range) -> None:
        super().__init__()
        self.sink: MultiGroupDDP | None = None  # set: expert weight gradients go through it
        self.mergeable = False  # the sink gets mergeable gradients
        g = torch.Generator().manual_seed(0)
        self.inp = nn.Linear(D_IN, HIDDEN)
        self.scale = nn.Parameter(torch.ones(HIDDEN))  # small: never sharded
        self.experts = nn.ModuleDict(
            {str(e): nn.Linear(HIDDEN, HIDDEN, bias=False) for e in range(N_EXPERTS)}
        )
        self.out = nn.Linear(HIDDEN, D_IN)  # bias of 9 elements: never divisible
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for e in range(N_EXPERTS):  # keep only the held experts, values as in the full model
            if e not in experts:
                del self.experts[str(e)]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)) * self.scale
        y = torch.zeros_like(h)
        for e in expert_ids.unique().tolist():
            idx = (expert_ids == e).nonzero().squeeze(1)
            expert = self.experts[str(e)]
            out = (_IntoSink.apply(h[idx], expert.weight, self.sink, self.mergeable) if self.sink
                   else expert(h[idx]))
            y = y.index_add(0, idx, out)
        return self.out(h + y)


def portable(obj) -> bytes:
    """Tensors cannot travel back through the runner's queue once the rank has
    exited (torch shares their storage by file descriptor), so ranks return bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(results: list[bytes]) -> list:
    return [torch.load(io.BytesIO(b)) for b in results]


def experts_of(rank: int, world: int, ep: bool) -> range:
    """With ``ep``, ranks {0,1} hold experts 0-1 and ranks {2,3} experts 2-3."""
    if not ep:
        return range(N_EXPERTS)
    half = N_EXPERTS // 2
    return range(0, half) if rank < world // 2 else range(half, N_EXPERTS)


def microbatch(rank: int, world: int, mb: int, ep: bool):
    g = torch.Generator().manual_seed(1000 * rank + mb)
    x = torch.randn(TOKENS, D_IN, generator=g)
    target = torch.randn(TOKENS, D_IN, generator=g)
    held = list(experts_of(rank, world, ep))
    ids = torch.tensor(held)[torch.randint(len(held), (TOKENS,), generator=g)]
    if ep:
        # Expert 1 gets tokens in microbatch 0 only. Expert 3 gets tokens in the last
        # microbatch on rank 2 but never on rank 3: readiness differs inside a group.
        ids[(ids == 1) & (mb > 0)] = 0
        if rank == 3:
            ids[ids == 3] = 2
        elif rank == 2 and mb == MICRO - 1:
            ids[0] = 3
    return x, ids, target


def loss_sum(model: nn.Module, x, ids, target) -> torch.Tensor:
    return ((model(x, ids) - target) ** 2).sum()


def global_tokens(world: int) -> int:
    return world * MICRO * TOKENS


def reference_grads(world: int, ep: bool) -> dict[str, torch.Tensor]:
    """Single process, full model, the concatenated global batch, loss / global tokens."""
    model = ToyMoE(range(N_EXPERTS))
    batches = [microbatch(r, world, m, ep) for r in range(world) for m in range(MICRO)]
    x, ids, target = (torch.cat(parts) for parts in zip(*batches, strict=True))
    (loss_sum(model, x, ids, target) / global_tokens(world)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _train_window(mode: str, ep: bool, pipeline: bool, sink: bool = False, merge: int = 1,
                  last_via_autograd: bool = False) -> dict:
    """One window of ``MICRO`` microbatches; with ``sink``, expert weight gradients go through
    ``add_gradient`` (mergeable with ``merge > 1``), except in the last microbatch with
    ``last_via_autograd`` (autograd's ``param.grad`` and the hook)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    expert_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])] if ep else []
    model = ToyMoE(experts_of(rank, world, ep))

    def group_of(name: str, param: nn.Parameter):
        if ep and name.startswith("experts."):
            return expert_groups[rank // 2]
        return dist.group.WORLD

    ddp = MultiGroupDDP(model, group_of, DDPConfig(mode=mode, bucket_cap_mb=TINY_CAP_MB,
                                                   min_shard_numel=MIN_SHARD, merge_microbatch_gradients=merge))
    if sink:
        model.sink = ddp
        model.mergeable = merge > 1
    _MergeableGradient.ddp = ddp
    n_global = global_tokens(world)
    launched_during_backward = 0
    for mb in range(MICRO):
        x, ids, target = microbatch(rank, world, mb, ep)
        if last_via_autograd and mb == MICRO - 1:
            model.sink = None
        loss = loss_sum(model, x, ids, target) / n_global
        if pipeline or mb < MICRO - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
            launched_during_backward = ddp.launched_buckets
        assert all(p.grad is None for p in model.parameters()), "param.grad must be freed"
    ddp.finish_grad_sync()
    grads = {}
    for name, param, main_grad, group in ddp:
        size = dist.get_world_size(group)
        if mode == "reduce_scatter" and is_sharded(param.numel(), size, MIN_SHARD):
            assert main_grad.shape == (size, param.numel() // size) and ddp.grad_is_sharded(param)
            grads[name] = ("shard", dist.get_rank(group), size, main_grad[dist.get_rank(group)].clone())
        else:
            assert main_grad.shape == param.shape and not ddp.grad_is_sharded(param)
            grads[name] = ("full", 0, 1, main_grad.clone())
    return portable({
        "grads": grads,
        "launched_during_backward": launched_during_backward,
        "n_buckets": len(ddp.grad_buffers()),
        "bytes": ddp.last_sync_bytes,
        "merged_calls": sorted(_MergeableGradient.calls),
        "added_after_launch": _MergeableGradient.added_after_launch,
    })


def _check_against_reference(results: list[dict], world: int, ep: bool) -> None:
    ref = reference_grads(world, ep)
    for rank, result in enumerate(results):
        held = {f"experts.{e}.weight" for e in experts_of(rank, world, ep)}
        names = set(result["grads"])
        assert names == {n for n in ref if not n.startswith("experts.")} | held
        for name, (kind, r, size, got) in result["grads"].items():
            want = ref[name].reshape(size, -1)[r] if kind == "shard" else ref[name]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=f"rank {rank} {name}")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_dense_matches_single_process(world, mode):
    results = unpack(run_distributed(_train_window, world, mode, False, False, timeout=90))
    _check_against_reference(results, world, ep=False)
    # Every parameter got a gradient in the last backward: all buckets launched
    # during it, overlapping with the rest of backward.
    assert all(r["launched_during_backward"] == r["n_buckets"] > 1 for r in results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_expert_groups_and_late_experts_match_single_process(mode):
    results = unpack(run_distributed(_train_window, 4, mode, True, False, timeout=90))
    _check_against_reference(results, 4, ep=True)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("ep", [False, True])
def test_gradients_added_through_the_sink_match_single_process(mode, ep):
    """Expert weight gradients delivered by ``add_gradient`` (into flat or owner-major
    main grads) instead of the hook: same reductions, same buckets launched in backward."""
    results = unpack(run_distributed(_train_window, 4, mode, ep, False, True, timeout=90))
    _check_against_reference(results, 4, ep=ep)
    if not ep:
        assert all(r["launched_during_backward"] == r["n_buckets"] > 1 for r in results)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize(("merge", "pipeline"), [(2, False), (3, False), (2, True)])
def test_merged_microbatch_gradients_match_single_process(mode, merge, pipeline):
    """Mergeable expert gradients held under no_sync and added together (3 microbatches):
    with 2, microbatches 0+1 in one call and the last on its own (synchronised: at once,
    or after a pipeline schedule, held until finish_grad_sync); with 3, all in one call
    in the last backward. Same gradients as without merging; buckets still launch in it."""
    results = unpack(run_distributed(_train_window, 4, mode, False, pipeline, True, merge, timeout=90))
    _check_against_reference(results, 4, ep=False)
    per_expert = [2, 1] if merge == 2 else [3]
    for r in results:
        assert r["merged_calls"] == sorted(per_expert * N_EXPERTS), r["merged_calls"]
        assert r["launched_during_backward"] == (0 if pipeline else r["n_buckets"])
        assert not any(r["added_after_launch"])


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_held_gradients_are_added_before_the_bucket_launches_when_the_last_comes_via_autograd(mode):
    """Microbatches 0 and 1 deliver mergeable expert gradients through the sink (held: merge 3),
    the synchronised last one through autograd's hook. The held pair is added before the
    parameter counts as arrived, so before its bucket launches, which every add checks when
    it runs (no timing involved): added after the launch, it would race the reduction."""
    results = unpack(run_distributed(_train_window, 4, mode, False, False, True, 3, True, timeout=90))
    _check_against_reference(results, 4, ep=False)
    for r in results:
        assert r["merged_calls"] == [2] * N_EXPERTS, r["merged_calls"]
        assert r["added_after_launch"] == [False] * N_EXPERTS
        assert r["launched_during_backward"] == r["n_buckets"]


class _TwoWeights(nn.Module):
    """Two weights in one bucket: ``a``'s gradient through the sink, ``b``'s through autograd."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = nn.Parameter(torch.randn(3, 4, generator=g))


def test_a_mergeable_gradient_after_its_parameter_arrived_is_added_at_once(monkeypatch):
    """Out of the usual order: ``a`` arrives in a synchronised backward while ``b`` keeps the
    bucket open, then a no_sync() backward delivers a mergeable gradient of ``a``. Held, it
    could outlive the bucket's launch (``b``'s arrival); it is added at once, as without
    merging, and the sum is the two microbatches' gradient."""
    model = _TwoWeights()
    ddp = MultiGroupDDP(model, lambda n, p: None, DDPConfig(merge_microbatch_gradients=3))
    for name, value in (("ddp", ddp), ("calls", []), ("added_after_launch", [])):
        monkeypatch.setattr(_MergeableGradient, name, value)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=g) for _ in range(2)]
    _IntoSink.apply(xs[0], model.a, ddp, True).sum().backward()
    with ddp.no_sync():
        _IntoSink.apply(xs[1], model.a, ddp, True).sum().backward()
    (xs[0] @ model.b.t()).sum().backward()  # b arrives: the bucket launches
    assert ddp.launched_buckets == 1
    ddp.finish_grad_sync()
    assert _MergeableGradient.calls == [1, 1] and _MergeableGradient.added_after_launch == [False, False]
    twin = model.a.detach().clone().requires_grad_()
    sum((x @ twin.t()).sum() for x in xs).backward()
    torch.testing.assert_close(ddp.main_grad("a"), twin.grad, rtol=1e-6, atol=1e-7)


def test_a_held_gradient_is_never_added_into_a_reduced_bucket():
    """White-box: the state no public call sequence reaches (a gradient still held in a
    launched bucket) is refused, not added behind the reduction's back."""
    model = _TwoWeights()
    ddp = MultiGroupDDP(model, lambda n, p: None, DDPConfig(merge_microbatch_gradients=2))
    ddp.finish_grad_sync()
    written: list[torch.Tensor] = []
    ddp._slots[model.a].held = written.append
    with pytest.raises(RuntimeError, match="'a' still holds a gradient .* already reduced"):
        ddp.finish_grad_sync()
    assert not written


@pytest.mark.multiprocess
def test_after_a_pipeline_schedule_finish_launches_everything():
    results = unpack(run_distributed(_train_window, 4, "reduce_scatter", True, True, timeout=90))
    _check_against_reference(results, 4, ep=True)
    assert all(r["launched_during_backward"] == 0 for r in results)


def _bytes_per_mode() -> dict:
    out = {}
    for mode in ("all_reduce", "reduce_scatter"):
        model = ToyMoE(range(N_EXPERTS))
        ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                            DDPConfig(mode=mode, min_shard_numel=MIN_SHARD))
        x, ids, target = microbatch(dist.get_rank(), 4, 0, False)
        loss_sum(model, x, ids, target).backward()
        ddp.finish_grad_sync()
        buffer_bytes = sum(b.numel() * b.element_size() for _, b in ddp.grad_buffers())
        out[mode] = (ddp.last_sync_bytes, buffer_bytes)
    return out


@pytest.mark.multiprocess
def test_byte_counter_reduce_scatter_moves_at_most_065x():
    world = (0, 1, 2, 3)
    for r in run_distributed(_bytes_per_mode, 4, timeout=60):
        (ar, ar_buffers), (rs, _) = r["all_reduce"], r["reduce_scatter"]
        assert ar == {world: 2 * 3 * ar_buffers // 4}  # ring all-reduce: 2(G-1)/G per byte
        assert rs[world] <= 0.65 * ar[world]


def _mean_mode_vs_torch_ddp() -> dict:
    rank = dist.get_rank()
    ours = ToyMoE(range(N_EXPERTS))
    theirs = nn.parallel.DistributedDataParallel(ToyMoE(range(N_EXPERTS)), find_unused_parameters=True)
    ddp = MultiGroupDDP(ours, lambda n, p: dist.group.WORLD,
                        DDPConfig(reduce_op="mean", bucket_cap_mb=TINY_CAP_MB))
    for mb in range(MICRO):
        x, ids, target = microbatch(rank, 2, mb, False)
        last = mb == MICRO - 1
        with (ddp.no_sync() if not last else torch.enable_grad()):
            loss_sum(ours, x, ids, target).backward()
        with (theirs.no_sync() if not last else torch.enable_grad()):
            loss_sum(theirs, x, ids, target).backward()
    ddp.finish_grad_sync()
    return portable({n: (ddp.main_grad(n), p.grad) for n, p in theirs.module.named_parameters()})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_mean_mode_matches_pytorch_ddp():
    for result in unpack(run_distributed(_mean_mode_vs_torch_ddp, 2, timeout=60)):
        for name, (ours, theirs) in result.items():
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7, msg=name)


def _bf16_reduction(mode: str) -> bytes:
    """Each rank's BF16-reduced main grads, and its own FP32 contribution: the same
    microbatches through a plain autograd twin (gradients accumulated in the same order)."""
    rank = dist.get_rank()
    model = ToyMoE(range(N_EXPERTS))
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                        DDPConfig(mode=mode, comm_dtype="bfloat16", min_shard_numel=MIN_SHARD))
    local = ToyMoE(range(N_EXPERTS))
    for mb in range(MICRO):
        batch = microbatch(rank, 2, mb, False)
        with ddp.no_sync() if mb < MICRO - 1 else torch.enable_grad():
            loss_sum(model, *batch).div(global_tokens(2)).backward()
        loss_sum(local, *batch).div(global_tokens(2)).backward()
    ddp.finish_grad_sync()
    twin = MultiGroupDDP(ToyMoE(range(N_EXPERTS)), lambda n, p: dist.group.WORLD,
                         DDPConfig(mode=mode, min_shard_numel=MIN_SHARD))
    twin.finish_grad_sync()  # the same buckets reduced in FP32, for the byte count
    return portable({
        "grads": {n: (g[rank] if ddp.grad_is_sharded(p) else g) for n, p, g, _ in ddp},
        "sharded": {n: ddp.grad_is_sharded(p) for n, p, _, _ in ddp},
        "local": {n: p.grad for n, p in local.named_parameters()},
        "bytes": ddp.last_sync_bytes,
        "fp32_bytes": twin.last_sync_bytes[(0, 1)],
    })


def bf16_sum_of_two(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What a BF16 sum over 2 gloo ranks yields, back in FP32: each rank's contribution
    rounded to BF16, one BF16 addition (gloo adds BF16 elements as BF16: on 3 ranks,
    1 + 2^-8 + 2^-8 gives 1 or 1 + 2^-7 depending on the chunk's order, so partial sums
    are rounded; with 2 ranks there is one addition, the same in either order), then the
    exact BF16 -> FP32 copy into the main grad."""
    return (a.bfloat16() + b.bfloat16()).float()


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["all_reduce", "reduce_scatter"])
def test_bf16_communication_reduces_a_bf16_copy(mode):
    results = unpack(run_distributed(_bf16_reduction, 2, mode, timeout=60))
    ref = reference_grads(2, ep=False)
    differ = total = 0
    for rank, r in enumerate(results):
        assert r["grads"].keys() == ref.keys()
        for name, got in r["grads"].items():
            a, b = (results[i]["local"][name].reshape(-1) for i in (0, 1))
            want, fp32 = bf16_sum_of_two(a, b), a + b
            torch.testing.assert_close(fp32.view(ref[name].shape), ref[name], rtol=1e-5, atol=1e-7)
            if r["sharded"][name]:
                want, fp32 = want.view(2, -1)[rank], fp32.view(2, -1)[rank]
            assert got.dtype == torch.float32
            assert torch.equal(got.reshape(want.shape), want), f"rank {rank} {name}: not the BF16 sum"
            assert not torch.equal(want, fp32), name  # BF16 rounding shows in every tensor
            differ += int((want != fp32).sum())
            total += want.numel()
        fp32_bytes = r["fp32_bytes"]
        assert r["bytes"] == {(0, 1): fp32_bytes // 2}  # the counter counts BF16 bytes
    # Random gradients: almost every element has bits below BF16's 8-bit mantissa, so an
    # FP32 reduction (rounded nowhere) cannot pass for the BF16 one.
    assert differ >= 0.9 * total, (differ, total)


def test_synced_is_false_from_the_first_accumulation_to_finish_grad_sync():
    """What the optimizer checks before a step. ``zero_grad()`` leaves it true (zeros agree on
    every rank): a step replayed from a CUDA graph runs no Python, so the flag must read
    true after ``zero_grad()`` and a replay, as the captured ``finish_grad_sync()`` left it."""
    model = ToyMoE(range(N_EXPERTS))
    ddp = MultiGroupDDP(model, lambda n, p: None)
    batches = [microbatch(0, 1, mb, False) for mb in range(2)]
    assert ddp.synced
    with ddp.no_sync():
        assert not ddp.synced
        loss_sum(model, *batches[0]).backward()
    assert not ddp.synced
    loss_sum(model, *batches[1]).backward()  # the synchronised last microbatch: buckets launch
    assert not ddp.synced and ddp.launched_buckets == len(ddp.grad_buffers())
    ddp.finish_grad_sync()
    assert ddp.synced
    ddp.zero_grad()
    assert ddp.synced
    loss_sum(model, *batches[0]).backward()  # one microbatch, no no_sync()
    assert not ddp.synced
    ddp.finish_grad_sync()
    ddp.zero_grad()
    ddp.add_gradient(model.out.weight, lambda target: target.add_(1.0))  # the sink route
    assert not ddp.synced
    ddp.finish_grad_sync()
    assert ddp.synced


def _owner_major_parameter_of_its_own_shape() -> None:
    model = nn.Linear(64, 2, bias=False)  # weight [2, 64]: owner-major [G, numel/G] for G = 2
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD,
                        DDPConfig(mode="reduce_scatter", min_shard_numel=128))
    assert ddp.main_grad("weight").shape == model.weight.shape and ddp.grad_is_sharded(model.weight)
    replicated = MultiGroupDDP(nn.Linear(64, 2, bias=False), lambda n, p: dist.group.WORLD,
                               DDPConfig(mode="reduce_scatter", min_shard_numel=129))
    assert not any(replicated.grad_is_sharded(p) for _, p, _, _ in replicated)
    with pytest.raises(KeyError, match="not a trainable parameter"):
        ddp.grad_is_sharded(nn.Parameter(torch.zeros(2)))
    dist.barrier()


@pytest.mark.multiprocess
def test_grad_is_sharded_states_what_the_main_grad_shape_cannot_tell():
    run_distributed(_owner_major_parameter_of_its_own_shape, 2, timeout=60)


def _gradient_after_sync_is_refused() -> None:
    model = ToyMoE(range(N_EXPERTS))
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD)
    x, ids, target = microbatch(dist.get_rank(), 2, 0, False)
    loss_sum(model, x, ids, target).backward()
    ddp.finish_grad_sync()
    try:
        loss_sum(model, x, ids, target).backward()
    except RuntimeError as e:
        assert "after its bucket was reduced" in str(e)
    else:
        raise AssertionError("a gradient after finish_grad_sync() was accepted")
    written = []  # the sink route refuses too, before anything is written into the bucket
    try:
        ddp.add_gradient(model.out.weight, written.append)
    except RuntimeError as e:
        assert "after its bucket was reduced" in str(e) and not written
    else:
        raise AssertionError("add_gradient after finish_grad_sync() was accepted")
    assert ddp.accepts(model.out.weight) and not ddp.accepts(nn.Parameter(torch.zeros(1)))
    ddp.zero_grad()  # a new window works again
    loss_sum(model, x, ids, target).backward()
    ddp.finish_grad_sync()


@pytest.mark.multiprocess
def test_gradient_after_sync_is_refused_until_zero_grad():
    run_distributed(_gradient_after_sync_is_refused, 2, timeout=60)


def test_bf16_grads_accumulate_in_fp32_and_are_freed():
    """Not replicated (group None): no communication, exact FP32 sums of BF16 grads."""
    model = ToyMoE(range(N_EXPERTS)).to(torch.bfloat16)
    twin = ToyMoE(range(N_EXPERTS)).to(torch.bfloat16)
    ddp = MultiGroupDDP(model, lambda n, p: None)
    acc = {n: torch.zeros(p.shape) for n, p in twin.named_parameters()}
    for mb in range(MICRO):
        x, ids, target = microbatch(0, 1, mb, False)
        with ddp.no_sync():
            loss_sum(model, x.bfloat16(), ids, target.bfloat16()).backward()
        loss_sum(twin, x.bfloat16(), ids, target.bfloat16()).backward()
        for n, p in twin.named_parameters():
            if p.grad is not None:
                acc[n] += p.grad.float()
                p.grad = None
        assert all(p.grad is None for p in model.parameters())
    ddp.finish_grad_sync()
    assert ddp.last_sync_bytes == {}
    for name, _, main_grad, group in ddp:
        assert group is None and main_grad.dtype == torch.float32
        assert torch.equal(main_grad, acc[name]), name
    ddp.zero_grad()
    assert all(float(buf.abs().sum()) == 0.0 for _, buf in ddp.grad_buffers())
    # Persistent gradient memory: the FP32 buckets only (4 bytes per parameter plus
    # alignment padding); no BF16 param.grad survives a backward.
    bucket_bytes = sum(buf.untyped_storage().nbytes() for _, buf in ddp.grad_buffers())
    n_params = sum(p.numel() for p in model.parameters())
    assert 4 * n_params <= bucket_bytes <= 1.05 * 4 * n_params


def test_dropping_or_closing_the_ddp_frees_its_buckets_and_detaches_the_hooks():
    """The hooks sit on C++ gradient accumulators that Python's cycle collector cannot
    see; they must not keep the FP32 buckets alive once the object is gone."""
    import gc
    import weakref

    model = ToyMoE(range(N_EXPERTS))
    x, ids, target = microbatch(0, 1, 0, False)
    ddp = MultiGroupDDP(model, lambda n, p: None)
    buckets = [weakref.ref(buf) for _, buf in ddp.grad_buffers()]
    gone = weakref.ref(ddp)
    del ddp
    gc.collect()
    assert gone() is None and all(b() is None for b in buckets)
    loss_sum(model, x, ids, target).backward()  # a plain module again: grads in .grad
    assert all(p.grad is not None for p in model.parameters())

    model.zero_grad(set_to_none=True)
    ddp = MultiGroupDDP(model, lambda n, p: None)
    ddp.close()
    loss_sum(model, x, ids, target).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(float(buf.abs().sum()) == 0.0 for _, buf in ddp.grad_buffers())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="DDPConfig.mode"):
        MultiGroupDDP(ToyMoE(range(1)), lambda n, p: None, DDPConfig(mode="allreduce"))
    with pytest.raises(ValueError, match="DDPConfig.comm_dtype"):
        MultiGroupDDP(ToyMoE(range(1)), lambda n, p: None, DDPConfig(comm_dtype="bf16"))


STEPS = 3


def _adamw_steps(world: int) -> dict[str, torch.Tensor]:
    """``STEPS`` AdamW steps of MultiGroupDDP on ``world`` ranks, through ``set_param_grads``;
    returns the final parameters. Also checks the refusals where whole grads cannot be set."""
    rank = dist.get_rank()
    model = ToyMoE(range(N_EXPERTS))
    ddp = MultiGroupDDP(model, lambda n, p: dist.group.WORLD, DDPConfig(bucket_cap_mb=TINY_CAP_MB))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        for mb in range(MICRO):
            x, ids, target = microbatch(rank, world, step * MICRO + mb, False)
            loss = loss_sum(model, x, ids, target) / global_tokens(world)
            if mb < MICRO - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        ddp.finish_grad_sync()
        ddp.set_param_grads()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        ddp.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    scattered = ToyMoE(range(N_EXPERTS))
    rs = MultiGroupDDP(scattered, lambda n, p: dist.group.WORLD,
                       DDPConfig(mode="reduce_scatter", min_shard_numel=MIN_SHARD))
    with pytest.raises(ValueError, match="'inp.weight' is reduce-scattered"):
        rs.set_param_grads()
    return portable({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                     "last_grads": grads})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_set_param_grads_lets_torch_adamw_train_like_a_single_process():
    """moe-ddp's reduced FP32 grads exposed as ``.grad`` for ``torch.optim.AdamW`` on 2 gloo
    ranks: the same parameters as single-process AdamW on the concatenated global batch."""
    world = 2
    results = unpack(run_distributed(_adamw_steps, world, world, timeout=90))
    model = ToyMoE(range(N_EXPERTS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        batches = [microbatch(r, world, step * MICRO + m, False) for r in range(world) for m in range(MICRO)]
        x, ids, target = (torch.cat(parts) for parts in zip(*batches, strict=True))
        (loss_sum(model, x, ids, target) / global_tokens(world)).backward()
        last_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(results):
        for name, want in model.named_parameters():
            # the grads too: AdamW's update hardly changes with the gradients' scale
            torch.testing.assert_close(result["last_grads"][name], last_grads[name], rtol=1e-5,
                                       atol=1e-7, msg=f"rank {rank} grad of {name}")
            torch.testing.assert_close(result["params"][name], want.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {name}")
        assert not torch.equal(result["params"]["inp.weight"], ToyMoE(range(N_EXPERTS)).inp.weight)


def test_set_param_grads_refuses_unreduced_grads_and_a_dtype_mismatch():
    model = _TwoWeights()
    ddp = MultiGroupDDP(model, lambda n, p: None)
    with ddp.no_sync():
        (model.a.sum() + model.b.sum()).backward()
    with pytest.raises(RuntimeError, match=r"before finish_grad_sync\(\)"):
        ddp.set_param_grads()
    ddp.finish_grad_sync()
    ddp.set_param_grads()
    assert model.a.grad.data_ptr() == ddp.main_grad("a").data_ptr()
    torch.testing.assert_close(model.a.grad, torch.ones(3, 4))
    half = _TwoWeights().to(torch.bfloat16)
    with pytest.raises(ValueError, match="'a' is torch.bfloat16 but its main grad is torch.float32"):
        MultiGroupDDP(half, lambda n, p: None).set_param_grads()
