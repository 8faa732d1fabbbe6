"""Swap a model's modules for low-precision ones by name pattern, and refresh their caches.

Structural: with ``recipe="mxfp8"`` an ``nn.Linear`` becomes ``MXFP8Linear`` and any
module with parameters ``w1``, ``w3``, ``w2`` (grouped experts) ``MXFP8GroupedExperts``;
with an FP8 recipe (``fp8_rowwise``, ``fp8_rowwise_gw_hp``, ``fp8_blockwise``,
``fp8_blockwise_gw_fp8``) they become
``FP8Linear`` and ``FP8GroupedExperts``. The new modules hold the same ``nn.Parameter``
objects under the same names, so parameter names, optimizer state, gradient buckets and
checkpoints are untouched.

Order in a training setup: build, initialise and partition the model (expert
narrowing replaces parameters), ``apply_mxfp8``, wrap for data parallelism, build
the optimizer, then register ``lambda: refresh_weight_caches(model)`` as its
weights-updated hook and call it once (wrapping may move parameter storage).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from moe_mxfp8.experts import MXFP8GroupedExperts
from moe_mxfp8.fp8_experts import FP8_RECIPES, FP8GroupedExperts, check_fast_accum
from moe_mxfp8.fp8_gemm import FAST_ACCUM_DEFAULT, FP8_GEMMS
from moe_mxfp8.fp8_linear import FP8Linear
from moe_mxfp8.linear import GEMMS, MXFP8Linear

RECIPES = ("mxfp8", *FP8_RECIPES)
_CONVERTED = (MXFP8Linear, MXFP8GroupedExperts, FP8Linear, FP8GroupedExperts)


@dataclass
class MXFP8Config:
    targets: tuple[str, ...] = ("experts",)  # module-name globs; each matches any dotted suffix
    save_mxfp8_activations: bool = False  # keep tensors saved for backward in MXFP8 (mxfp8 only)
    # mxfp8: dense layers emulated | native (sm_100 only), experts emulated;
    # fp8_rowwise(_gw_hp): emulated | native (sm_90) | triton (sm_89 and up);
    # fp8_blockwise(_gw_fp8): emulated | triton
    gemm: str = "emulated"
    # mxfp8 | fp8_rowwise | fp8_rowwise_gw_hp | fp8_blockwise | fp8_blockwise_gw_fp8
    recipe: str = "mxfp8"
    # FP8 recipes: the dense targets' (nn.Linear) GEMM, gemm's choices; None: gemm. On Hopper
    # native is the faster dense GEMM while the experts want triton (measured by
    # tools/bench_fp8_experts.py --parts gemms)
    dense_gemm: str | None = None
    # FP8 recipes, gemm native or triton: the GEMM roles (output, grad_input, grad_weight) run with
    # the tensor cores' fast accumulation, the others promote to FP32; default: torchao's
    # float8 rowwise choice (output only)
    fp8_fast_accum: tuple[str, ...] = FAST_ACCUM_DEFAULT

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if isinstance(self.targets, str) or not all(isinstance(t, str) and t for t in self.targets):
            raise ValueError(f"MXFP8Config.targets must be a tuple of non-empty globs, got {self.targets!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"MXFP8Config.recipe must be one of {RECIPES}, got {self.recipe!r}")
        gemms = GEMMS if self.recipe == "mxfp8" else FP8_GEMMS
        if self.gemm not in gemms:
            raise ValueError(f"MXFP8Config.gemm must be one of {gemms} for recipe {self.recipe}, "
                             f"got {self.gemm!r}")
        if self.recipe != "mxfp8":
            if self.save_mxfp8_activations:
                raise ValueError(f"MXFP8Config.save_mxfp8_activations applies to recipe mxfp8, "
                                 f"not {self.recipe}")
            if self.dense_gemm is not None and self.dense_gemm not in FP8_GEMMS:
                raise ValueError(f"MXFP8Config.dense_gemm must be one of {FP8_GEMMS} or None, "
                                 f"got {self.dense_gemm!r}")
            for field, gemm in (("gemm", self.gemm), ("dense_gemm", self.dense_gemm)):
                if gemm == "native" and not FP8_RECIPES[self.recipe].native:
                    raise ValueError(f"MXFP8Config.{field}: recipe {self.recipe} has no native "
                                     f"FP8 GEMM; use {field}='triton' or 'emulated'")
            check_fast_accum(self.fp8_fast_accum, self.recipe, "MXFP8Config.fp8_fast_accum")
        else:
            if tuple(self.fp8_fast_accum) != FAST_ACCUM_DEFAULT:
                raise ValueError(f"MXFP8Config.fp8_fast_accum applies to the FP8 recipes, not "
                                 f"{self.recipe}")
            if self.dense_gemm is not None:
                raise ValueError("MXFP8Config.dense_gemm applies to the FP8 recipes; recipe "
                                 "mxfp8's gemm already is its dense layers' (its experts are "
                                 "emulated)")

    @property
    def resolved_dense_gemm(self) -> str:
        """The GEMM the dense targets run on: ``dense_gemm``, or ``gemm`` where it is None."""
        return self.gemm if self.dense_gemm is None else self.dense_gemm


def name_matches(fqn: str, pattern: str) -> bool:
    """True when ``pattern`` matches ``fqn`` or one of its dotted suffixes.

    ``"experts"`` matches ``blocks.0.mlp.experts``; ``"attn.w?"`` matches
    ``blocks.3.attn.wq``; ``"blocks.0.*"`` matches everything under block 0.
    """
    parts = fqn.split(".")
    return any(fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


def _is_grouped_experts(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    return all(n in params and params[n].dim() == 3 for n in ("w1", "w3", "w2"))


def _replaceable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_grouped_experts(module)


def unmatched_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The globs of ``targets`` that match no module ``apply_mxfp8`` would replace in
    ``model`` (a whole model: a pipeline stage lacks other stages' modules). A misspelt
    glob otherwise leaves MXFP8 off without a word; a caller can refuse it up front."""
    names = [fqn for fqn, module in model.named_modules()
             if fqn and (_replaceable(module) or isinstance(module, _CONVERTED))]
    return [t for t in targets if not any(name_matches(fqn, t) for fqn in names)]


def mxfp8_modules(
    model: nn.Module,
) -> Iterator[tuple[str, MXFP8Linear | MXFP8GroupedExperts | FP8Linear | FP8GroupedExperts]]:
    """Every converted module (any recipe): the holders of weight caches."""
    for name, module in model.named_modules():
        if isinstance(module, _CONVERTED):
            yield name, module


def apply_mxfp8(model: nn.Module, config: MXFP8Config | None = None) -> list[str]:
    """Replace every matching ``nn.Linear`` / grouped-experts module in place.

    Returns the names replaced (empty when nothing matched, e.g. a pipeline stage
    without MoE layers). Modules that match but are of neither kind are left alone.
    """
    config = config or MXFP8Config()
    config.validate()
    matched = [(fqn, module) for fqn, module in model.named_modules()
               if fqn and not isinstance(module, _CONVERTED)
               and any(name_matches(fqn, t) for t in config.targets)]
    replaced = []
    fast = tuple(config.fp8_fast_accum)
    for fqn, module in matched:
        if config.recipe != "mxfp8" and isinstance(module, nn.Linear):
            new: nn.Module = FP8Linear.from_module(module, config.recipe,
                                                   config.resolved_dense_gemm, fast)
        elif config.recipe != "mxfp8":
            if not _is_grouped_experts(module):
                continue
            new = FP8GroupedExperts.from_module(module, config.recipe, config.gemm, fast)
        elif isinstance(module, nn.Linear):
            new = MXFP8Linear.from_module(module, config.save_mxfp8_activations, config.gemm)
        elif _is_grouped_experts(module):
            new = MXFP8GroupedExperts.from_module(module, config.save_mxfp8_activations)
        else:
            continue
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        replaced.append(fqn)
    return replaced


def refresh_weight_caches(model: nn.Module, in_place: bool = False) -> int:
    """Re-derive every weight cache (MXFP8 and FP8) in ``model`` (the weights-updated hook);
    returns the count. ``in_place`` keeps the caches' tensors (for captured CUDA graphs;
    see ``WeightCache.refresh``)."""
    count = 0
    for _, module in mxfp8_modules(model):
        module.refresh_weight_cache(in_place)
        count += 1
    return count
