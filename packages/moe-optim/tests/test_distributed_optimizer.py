"""DistributedOptimizer on 1-4 ranks against single-process oracles (gloo).

Oracles: ``torch.optim.AdamW`` and a Muon written from its published definition,
run in one process over the logical tensors with ``clip_grad_norm_``.

The tests need no model: a parameter set with the shapes that matter (stacked
experts, tensors that divide by some group sizes and not others, small
tensors), gradients drawn per (step, name) at the logical shape, and a
``GradSource`` built from plain tensors. Every layout takes its slice of the
same logical values, so any layout can be compared with one single-process
reference.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from moe_optim import (
    AdamWConfig,
    Cosine,
    DistributedOptimizer,
    MuonConfig,
    OptimConfig,
    OwnedRange,
    ParamRule,
    Placement,
)
from moe_testing import run_distributed
from torch import nn

SHAPES: dict[str, tuple[int, ...]] = {
    "embed.weight": (10, 8),  # 80: sharded for D=2,4, replicated for D=3
    "block.attn.weight": (16, 12),  # 192: sharded for every D
    "block.odd.weight": (7, 9),  # 63: sharded for D=3 only
    "block.norm.weight": (12,),  # below the threshold: replicated
    "block.experts.w1": (4, 6, 8),  # stacked experts [E, F, D]
    "block.experts.w2": (4, 8, 6),  # [E, D, F]
    "head.bias": (5,),
}
MIN_SHARD = 16
STEPS = 5
SCHEDULE = Cosine(warmup_steps=2, total_steps=STEPS, min_ratio=0.1)

NO_DECAY = ParamRule(lambda n, p: p.ndim < 2 or n.startswith("embed"), weight_decay=0.0)
EXPERT_LR = ParamRule(lambda n, p: ".experts." in n, lr_scale=0.5)
MUON = ParamRule(lambda n, p: p.ndim >= 2 and not n.startswith("embed"), algorithm="muon")


def config(kind: str, max_grad_norm: float | None = 1.0) -> OptimConfig:
    return OptimConfig(
        adamw=AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
        muon=MuonConfig(lr=0.05, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="float32",
                        weight_decay=0.1),
        max_grad_norm=max_grad_norm,
        min_shard_numel=MIN_SHARD,
    )


def rules(kind: str) -> list[ParamRule]:
    return [MUON, NO_DECAY, EXPERT_LR] if kind == "muon" else [NO_DECAY, EXPERT_LR]


def seeded(name: str, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    seed = (sum(map(ord, name)) * 7919 + salt * 104729) % (2**31)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def initial(name: str) -> torch.Tensor:
    return seeded(name, SHAPES[name], 0) * 0.5


def gradient(name: str, step: int) -> torch.Tensor:
    return seeded(name, SHAPES[name], step) * 0.3


# -- layouts --------------------------------------------------------------------
# A holding is (name, dim-0 start, dim-0 count, replica group key), the key being
# "world", a tuple of ranks, or None (not replicated).

SUBGROUPS = [(0, 1), (2, 3)]


def holdings(scenario: str, rank: int, world: int) -> list[tuple[str, int, int, object]]:
    experts = [n for n in SHAPES if ".experts." in n]
    dense = [n for n in SHAPES if n not in experts]
    full = lambda n, key: (n, 0, SHAPES[n][0], key)  # noqa: E731
    if scenario == "dp":
        return [full(n, "world") for n in SHAPES]
    pair = SUBGROUPS[rank // 2]
    if scenario == "ep":  # EP-MP 2 x EP-DP 2: ranks {0,1} experts 0-1, {2,3} experts 2-3
        return [full(n, "world") for n in dense] + [(n, 2 * (rank // 2), 2, pair) for n in experts]
    if scenario == "partial":  # only ranks 0 and 1 hold experts (two each, not replicated)
        own = [(n, 2 * rank, 2, None) for n in experts] if rank < 2 else []
        return [full(n, "world") for n in dense] + own
    if scenario == "pp":  # stage 0 = ranks {0,1} (with the experts), stage 1 = ranks {2,3}
        stage0 = ["embed.weight", "block.attn.weight", "block.norm.weight"]
        if rank < 2:
            return [full(n, pair) for n in stage0] + [(n, 2 * rank, 2, None) for n in experts]
        return [full(n, pair) for n in dense if n not in stage0]
    raise ValueError(scenario)


class Grads:
    """A GradSource of plain tensors. ``owner_major``: sharded tensors get a
    ``[G, numel/G]`` main grad (as moe_ddp's reduce_scatter mode gives), whose
    rows other than this rank's are NaN, so reading them would show, and the source
    says which (``grad_is_sharded``)."""

    def __init__(self, held, groups, layout: str) -> None:
        self.items = []
        for name, start, count, key, param in held:
            group = groups[key]
            size = dist.get_world_size(group) if group is not None else 1
            sharded = layout == "owner_major" and size > 1 and param.numel() % size == 0 \
                and param.numel() >= MIN_SHARD
            shape = (size, param.numel() // size) if sharded else param.shape
            self.items.append([name, param, torch.zeros(shape), group, start, count, sharded])

    def fill(self, step: int, poison: bool = False) -> None:
        for name, _, main_grad, group, start, count, sharded in self.items:
            g = gradient(name, step)[start : start + count]
            if poison:
                g = g.clone()
                g.view(-1)[0] = float("nan")
            if sharded:
                rank = dist.get_rank(group)
                main_grad.fill_(float("nan"))
                main_grad[rank] = g.reshape(main_grad.shape)[rank]
            else:
                main_grad.copy_(g)

    def __iter__(self):
        for name, param, main_grad, group, *_ in self.items:
            yield name, param, main_grad, group

    def grad_is_sharded(self, param: nn.Parameter) -> bool:
        """Stated as moe_ddp states it; ``full`` is sound whether the optimizer shards or not."""
        return next(item[6] for item in self.items if item[1] is param)


def build_groups(world: int) -> dict:
    groups = {"world": dist.group.WORLD, None: None}
    if world == 4:
        for ranks in SUBGROUPS:
            groups[ranks] = dist.new_group(list(ranks))
    return groups


def local_model(scenario: str, rank: int, world: int):
    """This rank's parameters (FP32 slices of the logical values) and their placements."""
    held = []
    for name, start, count, key in holdings(scenario, rank, world):
        param = nn.Parameter(initial(name)[start : start + count].clone())
        held.append((name, start, count, key, param))
    placements = {name: Placement(SHAPES[name], start) for name, start, _, _, _ in held}
    return held, placements


# -- references ------------------------------------------------------------------


def newton_schulz_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Muon's orthogonalisation written from its published definition, one matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.clone()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if transposed else x


class ReferenceMuon:
    """Single-process Muon: momentum, Nesterov direction, NS per matrix, decoupled decay."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: MuonConfig) -> None:
        self.params, self.cfg = params, cfg
        self.momentum = {n: torch.zeros_like(p) for n, p in params.items()}

    def step(self, grads: dict[str, torch.Tensor], lrs: dict[str, float], wds: dict[str, float]) -> None:
        mu = self.cfg.momentum
        for name, p in self.params.items():
            g = grads[name]
            buf = self.momentum[name]
            buf.mul_(mu).add_(g, alpha=1 - mu)
            direction = g * (1 - mu) + buf * mu if self.cfg.nesterov else buf
            mats = direction.reshape(-1, *direction.shape[-2:])
            ortho = torch.stack([newton_schulz_reference(m, self.cfg.ns_steps) for m in mats])
            ortho = ortho.reshape(p.shape) * math.sqrt(max(1.0, p.shape[-2] / p.shape[-1]))
            p.mul_(1 - lrs[name] * wds[name]).add_(ortho, alpha=-lrs[name])


def reference_run(kind: str, steps: int, max_grad_norm: float | None = 1.0, skip_steps=()):
    """Single process over the logical tensors: torch.optim.AdamW (+ reference Muon)."""
    cfg = config(kind, max_grad_norm)
    params = {n: initial(n).clone().requires_grad_() for n in SHAPES}
    rule_list = rules(kind)

    def resolved(name):
        algo, scale, wd = "adamw", 1.0, None
        for r in rule_list:
            if r.match(name, params[name]):
                algo = r.algorithm or algo
                scale = r.lr_scale if r.lr_scale is not None else scale
                wd = r.weight_decay if r.weight_decay is not None else wd
        base = cfg.adamw if algo == "adamw" else cfg.muon
        return algo, scale, base.weight_decay if wd is None else wd

    plan = {n: resolved(n) for n in SHAPES}
    adam_names = [n for n in SHAPES if plan[n][0] == "adamw"]
    adam = torch.optim.AdamW(
        [{"params": [params[n]], "lr": cfg.adamw.lr * plan[n][1], "weight_decay": plan[n][2]}
         for n in adam_names],
        betas=cfg.adamw.betas, eps=cfg.adamw.eps,
    )
    muon_names = [n for n in SHAPES if plan[n][0] == "muon"]
    muon = ReferenceMuon({n: params[n].data for n in muon_names}, cfg.muon)
    norms = []
    taken = 0
    for step in range(1, steps + 1):
        if step in skip_steps:
            continue
        taken += 1
        for n, p in params.items():
            p.grad = gradient(n, step).clone()
        norm = torch.nn.utils.clip_grad_norm_(
            list(params.values()), max_grad_norm if max_grad_norm is not None else float("inf")
        )
        norms.append(float(norm))
        factor = SCHEDULE(taken)
        for group, n in zip(adam.param_groups, adam_names, strict=True):
            group["lr"] = cfg.adamw.lr * plan[n][1] * factor
        adam.step()
        muon.step({n: params[n].grad for n in muon_names},
                   {n: cfg.muon.lr * plan[n][1] * factor for n in muon_names},
                   {n: plan[n][2] for n in muon_names})
    return {n: p.detach() for n, p in params.items()}, norms


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def portable(obj) -> bytes:
    """Ranks return bytes: tensors cannot travel through the runner's queue once
    the rank process has exited (torch shares them by file descriptor)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(results: list[bytes]) -> list:
    return [torch.load(io.BytesIO(b)) for b in results]


# -- the distributed side -------------------------------------------------------


def _train(scenario: str, kind: str, layout: str, steps: int, *, max_grad_norm: float | None = 1.0,
           poison_step: int | None = None, load: dict | None = None, first_step: int = 1) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = build_groups(world)
    held, placements = local_model(scenario, rank, world)
    grads = Grads(held, groups, layout)
    opt = DistributedOptimizer(grads, config(kind, max_grad_norm), norm_group=dist.group.WORLD,
                               rules=rules(kind), placement_of=lambda n, p: placements[n])
    hook_calls = []
    opt.register_weights_updated_hook(lambda: hook_calls.append(int(opt.step_count)))
    if load is not None:  # a checkpoint of logical flat tensors, saved on another layout
        opt.load_sharded_state({
            key: OwnedRange(load[key][s.flat_offset : s.flat_offset + s.local.numel()].clone(),
                       s.global_shape, s.flat_offset)
            for key, s in opt.sharded_state().items()
        })
    norms, skipped = [], []
    for step in range(first_step, first_step + steps):
        grads.fill(step, poison=step == poison_step and rank == 0)
        stats = opt.step(SCHEDULE(int(opt.step_count) + 1))
        norms.append(float(stats.grad_norm))
        skipped.append(bool(stats.skipped))
    state = {k: (s.local.clone(), s.global_shape, s.flat_offset) for k, s in opt.sharded_state().items()}
    return portable({
        "params": {name: (start, count, p.detach().clone()) for name, start, count, _, p in held},
        "norms": norms, "skipped": skipped, "hook_calls": hook_calls, "state": state,
        "step_count": int(opt.step_count),
    })


def _check_params(results: list[dict], want: dict[str, torch.Tensor], tol: float) -> None:
    seen = set()
    for rank, result in enumerate(results):
        for name, (start, count, got) in result["params"].items():
            seen.add(name)
            err = max_rel_diff(got, want[name][start : start + count])
            assert err < tol, f"rank {rank} {name}: max relative diff {err:.2e}"
    assert seen == set(SHAPES)


def _adamw_and_muon_runs() -> dict:
    out = {}
    for kind in ("adamw", "muon"):
        for layout in ("full", "owner_major"):
            out[kind, layout] = _train("dp", kind, layout, STEPS)
    if dist.get_world_size() > 1:
        held, _ = local_model("dp", dist.get_rank(), dist.get_world_size())
        grads = Grads(held, build_groups(dist.get_world_size()), "full")
        try:
            DistributedOptimizer(grads, config("adamw"), norm_group=None)
        except ValueError as e:
            assert "norm_group" in str(e)
        else:
            raise AssertionError("replicated parameters were accepted without a norm group")
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_torch_adamw_and_reference_muon(world):
    results = run_distributed(_adamw_and_muon_runs, world, timeout=120)
    per_rank = [{k: torch.load(io.BytesIO(v)) for k, v in r.items()} for r in results]
    for kind, tol in (("adamw", 1e-6), ("muon", 1e-6)):
        want, norms = reference_run(kind, STEPS)
        for layout in ("full", "owner_major"):
            runs = [r[kind, layout] for r in per_rank]
            _check_params(runs, want, tol)
            for r in runs:
                torch.testing.assert_close(r["norms"], norms, rtol=1e-6, atol=0)
                assert r["hook_calls"] == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("scenario", ["ep", "partial", "pp"])
def test_clipping_across_groups_matches_single_process(scenario):
    """Dense + expert groups; ranks without experts; a pipeline split where one
    stage has no MoE parameters. A small max norm keeps the clip active."""
    results = unpack(run_distributed(_train, 4, scenario, "muon", "owner_major", STEPS,
                                     max_grad_norm=0.5, timeout=120))
    want, norms = reference_run("muon", STEPS, max_grad_norm=0.5)
    assert min(norms) > 0.5
    for r in results:
        torch.testing.assert_close(r["norms"], norms, rtol=1e-6, atol=0)
    _check_params(results, want, 1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_non_finite_gradient_skips_the_step_everywhere():
    results = unpack(run_distributed(_train, 4, "ep", "adamw", "owner_major", STEPS,
                                     poison_step=3, timeout=120))
    want, _ = reference_run("adamw", STEPS, skip_steps={3})
    for r in results:
        assert r["skipped"] == [False, False, True, False, False]
        assert r["step_count"] == STEPS - 1
        assert math.isnan(r["norms"][2])
    _check_params(results, want, 1e-6)


def _assemble(results: list[dict]) -> dict[str, torch.Tensor]:
    """What a checkpoint library does with the shards: logical flat tensors."""
    flat, covered = {}, {}
    for r in results:
        for key, (local, global_shape, offset) in r["state"].items():
            numel = math.prod(global_shape)
            flat.setdefault(key, torch.zeros(numel))
            covered.setdefault(key, torch.zeros(numel, dtype=torch.bool))
            flat[key][offset : offset + local.numel()] = local
            covered[key][offset : offset + local.numel()] = True
    assert all(bool(c.all()) for c in covered.values()), "some state was not saved by any rank"
    return flat


@pytest.mark.slow
@pytest.mark.multiprocess
def test_state_saved_on_one_layout_resumes_on_another():
    """Two steps with EP over four ranks, then three more on two plain DP ranks."""
    first = unpack(run_distributed(_train, 4, "ep", "muon", "owner_major", 2, timeout=120))
    checkpoint = _assemble(first)
    assert set(checkpoint) >= {"step", "main/block.experts.w1", "momentum/block.experts.w1",
                               "exp_avg/embed.weight", "exp_avg_sq/head.bias"}
    second = unpack(run_distributed(_train, 2, "dp", "muon", "full", STEPS - 2,
                                    load=checkpoint, first_step=3, timeout=120))
    want, _ = reference_run("muon", STEPS)
    _check_params(second, want, 1e-6)
    assert all(r["hook_calls"] == [2, 3, 4, 5] for r in second)


# -- memory -------------------------------------------------------------------------

MEM_DENSE = {f"layer{i}.weight": (64, 64) for i in range(4)}
MEM_EXPERTS = {"layer.experts.w": (4, 64, 64)}


def _persistent_bytes(expert_parallel: bool, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Bytes per logical parameter, from the storages this rank actually holds (``dtype``:
    the parameters')."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    groups = build_groups(dist.get_world_size()) if distributed else {None: None}
    dense_key = "world" if distributed else None
    expert_key = SUBGROUPS[rank // 2] if expert_parallel else dense_key
    held = [(n, 0, s[0], dense_key, nn.Parameter(torch.randn(s, dtype=dtype)))
            for n, s in MEM_DENSE.items()]
    for n, s in MEM_EXPERTS.items():
        start, count = (2 * (rank // 2), 2) if expert_parallel else (0, s[0])
        held.append((n, start, count, expert_key,
                     nn.Parameter(torch.randn(count, *s[1:], dtype=dtype))))
    grads = Grads(held, groups, "full")
    opt = DistributedOptimizer(grads, OptimConfig(min_shard_numel=MIN_SHARD),
                               norm_group=dist.group.WORLD if distributed else None)
    state = opt.sharded_state()
    out = {}
    for family, shapes in (("dense", MEM_DENSE), ("experts", MEM_EXPERTS)):
        tensors = [p for n, *_, p in held if n in shapes]
        tensors += [g for n, _, g, _ in grads if n in shapes]
        tensors += [s.local for k, s in state.items() if k.split("/", 1)[-1] in shapes]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        logical = sum(math.prod(s) for s in shapes.values())
        out[family] = sum(storages.values()) / logical
    out["bytes_per_step"] = opt.bytes_per_step
    if distributed:
        dist.barrier()  # no rank may leave (and close the store) while others still set up groups
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_persistent_bytes_per_parameter():
    within = lambda got, want: abs(got - want) <= 0.05 * want  # noqa: E731
    plain = _persistent_bytes(False)
    assert within(plain["dense"], 18) and within(plain["experts"], 18), plain
    d = 4
    for r in run_distributed(_persistent_bytes, d, False, timeout=60):
        assert within(r["dense"], 6 + 12 / d) and within(r["experts"], 6 + 12 / d), r
        # Ring all-gather of the BF16 weights: each rank sends the other 3 of 4 regions
        # (32768 parameters / 4 per region), plus the 4-byte norm all-reduce.
        assert r["bytes_per_step"] == {(0, 1, 2, 3): 3 * (32768 // 4) * 2 + 2 * 3 * 4 // 4}
    m_e = 2
    for r in run_distributed(_persistent_bytes, d, True, timeout=60):
        assert within(r["dense"], 6 + 12 / d), r
        assert within(r["experts"], 6 / m_e + 12 / d), r


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fp32_parameters_are_their_own_main_weights():
    """FP32 parameters keep no second FP32 copy: 4 (weight and main) + 4 (grad) + 8
    (moments) bytes per parameter on one rank; sharded over 4, the weight stays whole and
    the moments shard, 8 + 8/4. The updates equal torch's AdamW on FP32 parameters
    (``test_matches_torch_adamw_and_reference_muon``, whose parameters are FP32)."""
    within = lambda got, want: abs(got - want) <= 0.05 * want  # noqa: E731
    plain = _persistent_bytes(False, torch.float32)
    assert within(plain["dense"], 16) and within(plain["experts"], 16), plain
    d = 4
    for r in run_distributed(_persistent_bytes, d, False, torch.float32, timeout=60):
        assert within(r["dense"], 8 + 8 / d) and within(r["experts"], 8 + 8 / d), r
        # the rebuild gathers the FP32 weights' regions (4 bytes each), as for any dtype
        assert r["bytes_per_step"] == {(0, 1, 2, 3): 3 * (32768 // 4) * 4 + 2 * 3 * 4 // 4}


def test_an_fp32_parameter_updates_in_place_and_a_replaced_storage_is_refused():
    """The update lands in the parameter itself; a parameter given new storage afterwards
    (its main weight still a view of the old one) is refused, not silently left untrained."""
    w = nn.Parameter(torch.randn(64, 64))
    opt = DistributedOptimizer([("w", w, torch.ones(64, 64), None)], OptimConfig(), norm_group=None)
    assert opt.sharded_state()["main/w"].local.data_ptr() == w.data_ptr()
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(w.detach(), before)
    for replacement in (w.data.clone(), w.data.bfloat16()):  # new storage; new dtype as well
        w.data = replacement
        with pytest.raises(RuntimeError, match="parameter 'w': its storage was replaced after the optimizer"):
            opt.step()
