"""The distributed optimizer: AdamW and Muon over FP32 main-weight shards.

One step (docs/ARCHITECTURE.md, step timeline):

1. read each parameter's reduced FP32 main grad from the ``GradSource`` (this
   rank's shard of a sharded tensor, all of a replicated one), after checking the
   source reports them reduced (its optional ``synced``);
2. global gradient norm over all replica groups (``clipping``), clip in place,
   non-finite flag, all on the device;
3. AdamW: PyTorch's fused ``AdamW`` over the main-weight shard tensors, which
   skips the update on the device when the norm is not finite (``found_inf``);
4. Muon: momentum on the shards, Newton-Schulz on whole matrices brought to one
   owner rank each (``muon_exchange``), update applied to the shards, guarded by
   the same flag;
5. rebuild the compute weights in place (``rebuild``; an FP32 parameter is its own
   main weight, ``TensorLayout.main_is_param``), then run the weights-updated hooks.

Nothing in the steady state reads a device value on the host. The FP32 main
weights start from the parameters' values at construction: build the optimizer
while the parameters still hold their FP32 initialisation, or load a checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from moe_optim.clipping import clip_coefficient, global_grad_norm
from moe_optim.config import OptimConfig, ParamRule, ResolvedRule, resolve_rule
from moe_optim.muon_exchange import MuonExchange
from moe_optim.newton_schulz import orthogonalize_many
from moe_optim.protocols import GradSource, OwnedRange, Placement
from moe_optim.rebuild import WeightRebuilder
from moe_optim.sharding import TensorLayout

PlacementOf = Callable[[str, nn.Parameter], Placement]


@dataclass
class StepStats:
    """Device tensors describing one step (read them when logging, not before)."""

    grad_norm: torch.Tensor  # global norm before clipping
    skipped: torch.Tensor  # bool: the gradients were not finite and nothing was updated


def _group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


class DistributedOptimizer:
    """AdamW/Muon with FP32 main weights and states sharded over each replica group.

    Args:
        grads: the gradient source (e.g. ``moe_ddp.MultiGroupDDP``).
        config: hyperparameters, clipping, sharding threshold.
        norm_group: the process group over which squared-norm contributions are
            summed: all ranks that together hold the model (usually
            ``dist.group.WORLD``; the PP x DP ranks). Every replica group must lie
            inside it. ``None``: a single process, no parameter replicated.
        rules: per-parameter overrides selected by name predicates (no weight decay
            on norms and embeddings, an expert LR multiplier, Muon for matrices).
        placement_of: each parameter's logical shape and dim-0 offset (experts under
            EP), used for checkpoint offsets; default: the local tensor is global.
        device: where the step counter and norm live on a rank without parameters.
    """

    def __init__(
        self,
        grads: GradSource,
        config: OptimConfig | None = None,
        *,
        norm_group: dist.ProcessGroup | None,
        rules: list[ParamRule] | None = None,
        placement_of: PlacementOf | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config = config = config or OptimConfig()
        config.validate()
        self._grads = grads
        self._norm_group = norm_group
        rules = rules or []
        norm_ranks = set(_group_ranks(norm_group)) if norm_group is not None else None

        self._layouts: list[TensorLayout] = []
        self._rules: list[ResolvedRule] = []
        source_sharded = getattr(grads, "grad_is_sharded", None)  # optional (GradSource)
        for name, param, _, group in grads:
            placement = placement_of(name, param) if placement_of else None
            layout = TensorLayout.build(name, param, group, config.min_shard_numel, placement)
            if source_sharded is not None:
                layout.check_source_sharding(source_sharded(param), config.min_shard_numel)
            if group is not None and layout.group_size > 1:
                ranks = set(_group_ranks(group))
                if norm_ranks is None or not ranks <= norm_ranks:
                    raise ValueError(
                        f"parameter {name!r} is replicated over ranks {sorted(ranks)}, which norm_group "
                        f"({'None' if norm_ranks is None else sorted(norm_ranks)}) does not contain; pass "
                        "the group of all ranks that hold the model (usually dist.group.WORLD)"
                    )
            self._layouts.append(layout)
            self._rules.append(resolve_rule(name, param, rules, config))
        if len({lay.name for lay in self._layouts}) != len(self._layouts):
            raise ValueError("the gradient source yields a parameter name twice")
        if device is None:
            if not self._layouts:
                raise ValueError("this rank holds no parameters: pass device=")
            device = self._layouts[0].param.device
        self.device = device

        self._mains = [lay.initial_main() for lay in self._layouts]
        # FP32 parameters whose main weight is a view of them, fixed now: a parameter given
        # new storage (or dtype) later must not drop out of the check
        self._views = [(lay, main) for lay, main in zip(self._layouts, self._mains, strict=True)
                       if lay.main_is_param]
        self._step = torch.zeros(1, dtype=torch.float32, device=device)
        # Squared-norm weight per tensor: a replicated tensor is held by all G ranks.
        self._norm_weights = torch.tensor(
            [1.0 if lay.sharded else 1.0 / lay.group_size for lay in self._layouts],
            dtype=torch.float32, device=device,
        )
        self._exp_avg: dict[int, torch.Tensor] = {}
        self._exp_avg_sq: dict[int, torch.Tensor] = {}
        self._adamw = self._build_adamw()
        self._muon = [i for i, r in enumerate(self._rules) if r.algorithm == "muon"]
        self._momentum = {i: torch.zeros_like(self._mains[i]) for i in self._muon}
        self._exchanges = self._build_exchanges()
        self._rebuilder = WeightRebuilder(
            self._layouts, self._mains, int(config.gather_bucket_mb * 2**20)
        )
        self._hooks: OrderedDict[int, Callable[[], None]] = OrderedDict()
        self.bytes_per_step: dict[tuple[int, ...], int] = self._count_bytes_per_step()
        """Bytes this rank sends per group in one step (norm, Muon exchange, weight
        rebuild); static, a function of the layout."""

    # -- construction ------------------------------------------------------------

    def _build_adamw(self) -> list[tuple[float, float, list[int]]]:
        """AdamW tensors grouped by (lr scale, weight decay), with eager zero moments."""
        groups: dict[tuple[float, float], list[int]] = {}
        for i, rule in enumerate(self._rules):
            if rule.algorithm == "adamw":
                groups.setdefault((rule.lr_scale, rule.weight_decay), []).append(i)
        for idx in groups.values():
            for i in idx:
                self._exp_avg[i] = torch.zeros_like(self._mains[i])
                self._exp_avg_sq[i] = torch.zeros_like(self._mains[i])
        return [(scale, wd, idx) for (scale, wd), idx in groups.items()]

    def _build_exchanges(self) -> list[tuple[MuonExchange, list[int]]]:
        by_group: dict[int, list[int]] = {}
        for i in self._muon:
            if self._layouts[i].sharded:
                by_group.setdefault(id(self._layouts[i].group), []).append(i)
        out = []
        for idx in by_group.values():
            lay = self._layouts[idx[0]]
            shapes = [self._layouts[i].param.shape for i in idx]
            out.append((MuonExchange(shapes, lay.group, lay.group_size, lay.rank), idx))
        return out

    def _count_bytes_per_step(self) -> dict[tuple[int, ...], int]:
        out = dict(self._rebuilder.sent_bytes())
        for exchange, _ in self._exchanges:
            key = _group_ranks(exchange.group)
            out[key] = out.get(key, 0) + exchange.sent_bytes()
        if self._norm_group is not None:
            size = dist.get_world_size(self._norm_group)
            key = _group_ranks(self._norm_group)
            out[key] = out.get(key, 0) + 2 * (size - 1) * 4 // size
        return out

    # -- the step ------------------------------------------------------------------

    def _read_grads(self) -> list[torch.Tensor]:
        grads = []
        for k, (name, param, main_grad, _) in enumerate(self._grads):
            if k >= len(self._layouts):
                raise ValueError(f"the gradient source yielded more than the {len(self._layouts)} "
                                 "items it had at construction")
            layout = self._layouts[k]
            if layout.name != name:
                raise ValueError(f"the gradient source changed: item {k} is {name!r}, expected {layout.name!r}")
            if layout.param is not param:
                raise ValueError(f"the gradient source changed: item {k} ({name!r}) is another "
                                 "parameter object than at construction")
            grads.append(layout.local_grad(main_grad))
        if len(grads) != len(self._layouts):
            raise ValueError(f"the gradient source yielded {len(grads)} items, expected {len(self._layouts)}")
        return grads

    def step(self, lr_factor: float = 1.0) -> StepStats:
        """One update of every parameter, then the rebuild of the compute weights;
        ``lr_factor`` scales each group's peak LR (a schedule)."""
        stats = self.update(lr_factor)
        self.rebuild_weights()
        return stats

    @torch.no_grad()
    def update(self, lr_factor: float = 1.0) -> StepStats:
        """The local part of ``step``: norm, clip and the sharded update of the FP32 main
        weights, without rebuilding the compute weights (a caller that times the two
        phases separately calls ``rebuild_weights()`` next)."""
        if not getattr(self._grads, "synced", True):  # optional (GradSource)
            raise RuntimeError(
                "optimizer step on gradients that are not reduced: the gradient source reports "
                "synced=False (reductions in flight or not launched); call its "
                "finish_grad_sync() after the last backward, before step()/update()"
            )
        self._check_params_are_mains()
        grads = self._read_grads()
        norm = global_grad_norm(grads, self._norm_weights, self._norm_group, self.device)
        found_inf = (~torch.isfinite(norm)).to(torch.float32)
        if self.config.max_grad_norm is not None and grads:
            torch._foreach_mul_(grads, clip_coefficient(norm, self.config.max_grad_norm))
        self._step.add_(1.0)
        self._adamw_step(grads, lr_factor, found_inf)
        self._step.sub_(found_inf)
        self._muon_step(grads, lr_factor, found_inf.bool())
        return StepStats(grad_norm=norm, skipped=found_inf.bool())

    def _check_params_are_mains(self) -> None:
        """Refuse to update an FP32 parameter whose storage was replaced (``param.data = ...``,
        ``load_state_dict(assign=True)``, a device move) since construction: its main weight
        is a view of the old storage, so the update would go there and the model would
        silently stop training that tensor. Host pointers only, no device work, and nothing
        where no parameter is FP32."""
        for lay, main in self._views:
            if main.data_ptr() != lay.param.data_ptr() + lay.start * main.element_size():
                raise RuntimeError(
                    f"parameter {lay.name!r}: its storage was replaced after the optimizer was "
                    "built, and an FP32 parameter is its own main weight; write new values in place "
                    "(param.data.copy_(...)) or load them with load_sharded_state()"
                )

    def _adamw_step(self, grads: list[torch.Tensor], lr_factor: float, found_inf: torch.Tensor) -> None:
        """PyTorch's fused AdamW kernel (the one behind ``AdamW(fused=True)``) on the shards.

        The kernel leaves weights and moments untouched where ``found_inf`` is set;
        the shared step counter is advanced before and taken back after, as
        ``torch.optim.AdamW`` does with its per-tensor counters.
        """
        cfg = self.config.adamw
        for scale, weight_decay, idx in self._adamw:
            torch._fused_adamw_(
                [self._mains[i] for i in idx],
                [grads[i] for i in idx],
                [self._exp_avg[i] for i in idx],
                [self._exp_avg_sq[i] for i in idx],
                [],
                [self._step] * len(idx),
                lr=cfg.lr * scale * lr_factor,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                weight_decay=weight_decay,
                eps=cfg.eps,
                amsgrad=False,
                maximize=False,
                grad_scale=None,
                found_inf=found_inf,
            )

    def _muon_step(self, grads: list[torch.Tensor], lr_factor: float, skip: torch.Tensor) -> None:
        if not self._muon:
            return
        cfg = self.config.muon
        directions: dict[int, torch.Tensor] = {}
        for i in self._muon:
            momentum = self._momentum[i]
            updated = momentum.lerp(grads[i], 1.0 - cfg.momentum)  # M <- mu M + (1 - mu) G
            directions[i] = grads[i].lerp(updated, cfg.momentum) if cfg.nesterov else updated
            momentum.copy_(torch.where(skip, momentum, updated))

        def orthogonalize(mats: list[torch.Tensor]) -> list[torch.Tensor]:
            return orthogonalize_many(mats, cfg.ns_steps, getattr(torch, cfg.ns_dtype), cfg.scale)

        updates: dict[int, torch.Tensor] = {}
        for exchange, idx in self._exchanges:
            shards = exchange.run([directions[i] for i in idx], orthogonalize)
            updates.update(zip(idx, shards, strict=True))
        local = [i for i in self._muon if i not in updates]
        if local:
            full = orthogonalize([directions[i].view(self._layouts[i].param.shape) for i in local])
            updates.update((i, u.reshape(-1)) for i, u in zip(local, full, strict=True))
        for i in self._muon:
            lr = cfg.lr * self._rules[i].lr_scale * lr_factor
            main = self._mains[i]
            new = main * (1.0 - lr * self._rules[i].weight_decay) - lr * updates[i]
            main.copy_(torch.where(skip, main, new))

    @torch.no_grad()
    def rebuild_weights(self) -> None:
        """Write the FP32 main weights into the compute weights, then run the
        weights-updated hooks. ``step()`` and ``load_sharded_state()`` do this;
        collective: every rank of every replica group calls it."""
        self._rebuilder.run()
        for hook in list(self._hooks.values()):
            hook()

    def register_weights_updated_hook(self, fn: Callable[[], None]) -> RemovableHandle:
        """Call ``fn()`` after every rebuild of the compute weights (steps and loads),
        e.g. to refresh derived MXFP8 caches."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = fn
        return handle

    # -- checkpoint state ------------------------------------------------------------

    def _states(self) -> Iterator[tuple[str, int, torch.Tensor]]:
        for i, main in enumerate(self._mains):
            yield "main", i, main
        for i, exp_avg in self._exp_avg.items():
            yield "exp_avg", i, exp_avg
            yield "exp_avg_sq", i, self._exp_avg_sq[i]
        for i in self._muon:
            yield "momentum", i, self._momentum[i]

    def sharded_state(self) -> dict[str, OwnedRange]:
        """Every FP32 main weight and optimizer state of this rank, and the step counter.

        Keys: ``main/<param>``, ``exp_avg/<param>``, ``exp_avg_sq/<param>``,
        ``momentum/<param>``, ``step``. Each ``OwnedRange`` is a 1-D run of its logical
        tensor (the parameter's global shape) at ``flat_offset``; ``local`` is the
        live tensor.
        """
        out = {}
        for kind, i, tensor in self._states():
            lay = self._layouts[i]
            out[f"{kind}/{lay.name}"] = OwnedRange(tensor, tuple(lay.placement.global_shape), lay.flat_offset)
        out["step"] = OwnedRange(self._step, (1,), 0)
        return out

    @torch.no_grad()
    def load_sharded_state(self, state: Mapping[str, OwnedRange]) -> None:
        """Copy every state tensor from ``state`` (same keys and regions as
        ``sharded_state()``), then rebuild the compute weights. Collective: call on
        every rank."""
        own = self.sharded_state()
        missing = sorted(set(own) - set(state))
        extra = sorted(set(state) - set(own))
        if missing or extra:
            raise KeyError(f"optimizer state keys differ: missing {missing[:5]}, unexpected {extra[:5]}")
        for key, target in own.items():
            src = state[key]
            if (tuple(src.global_shape) != target.global_shape or src.flat_offset != target.flat_offset
                    or src.local.numel() != target.local.numel()):
                raise ValueError(
                    f"state {key!r}: got global shape {tuple(src.global_shape)} at offset "
                    f"{src.flat_offset} with {src.local.numel()} elements, expected "
                    f"{target.global_shape} at {target.flat_offset} with {target.local.numel()}"
                )
            if src.local is not target.local:
                target.local.copy_(src.local.reshape(target.local.shape))
        self.rebuild_weights()

    @property
    def step_count(self) -> torch.Tensor:
        """Steps taken (skipped steps excluded), a device tensor."""
        return self._step
