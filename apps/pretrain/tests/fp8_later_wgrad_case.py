"""FP8 and MXFP8 experts wired as the trainer wires them on CUDA, with the kernels under
the Triton interpreter (run by ``test_fp8_wiring.py`` with ``TRITON_INTERPRET=1``).

``wire_model`` hands moe_mxfp8's experts moe_model's ``ExpertWeightGradient`` as their
weight-gradient maker (here with moe_model's kernels on, as on CUDA): for the recipes
with compute-dtype weight gradients (MXFP8's among them) the sink gets those adds, two
microbatches' merged into one launch of the epilogue-accumulating kernel (its gate and up
operands are strided halves of dh13), and the FP32 targets hold what autograd computes
without a sink.
"""

from __future__ import annotations

import os

import torch
from moe_model import ExpertWeightGradient, ModelWiring, wire_model
from moe_model import wiring as model_wiring
from moe_mxfp8 import FP8_RECIPES, FP8GroupedExperts, MXFP8GroupedExperts

assert os.environ.get("TRITON_INTERPRET") == "1", "run by moe_testing.run_under_triton_interpreter"


class HoldingSink:
    """Holds every weight's adds (as moe_ddp does to merge microbatches) until ``flush``."""

    def __init__(self, params: tuple[torch.nn.Parameter, ...]) -> None:
        self.targets = {id(p): torch.zeros(p.numel()) for p in params}
        self.held: dict[int, list] = {}

    def accepts(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self.targets

    def add_gradient(self, param: torch.nn.Parameter, add) -> None:
        self.held.setdefault(id(param), []).append(add)

    def flush(self) -> None:
        for key, (first, second) in self.held.items():
            merged = first.merged(second)
            assert isinstance(merged, ExpertWeightGradient), type(first)
            merged(self.targets[key])


def layer_of(recipe: str, w1, w3, w2):
    if recipe == "mxfp8":
        return MXFP8GroupedExperts(w1, w3, w2)
    return FP8GroupedExperts(w1, w3, w2, recipe)


def check(recipe: str) -> None:
    E, D, F = 3, 128, 128
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = (torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1)
                  for s in ((E, F, D), (E, F, D), (E, D, F)))
    offsets = torch.tensor([9, 9, 40], dtype=torch.int32)  # expert 1 empty
    batches = [(torch.randn(40, D, generator=g), torch.randn(40, D, generator=g)) for _ in range(2)]
    plain = layer_of(recipe, w1, w3, w2)
    for rows, dy in batches:
        plain(rows, offsets).backward(dy)
    want = [w.grad.clone() for w in (w1, w3, w2)]
    for w in (w1, w3, w2):
        w.grad = None
    layer = layer_of(recipe, w1, w3, w2)
    sink = HoldingSink((w1, w3, w2))
    wire_model(layer, ModelWiring(gradient_sink=sink))
    assert layer.weight_gradient == ExpertWeightGradient.from_rows
    for rows, dy in batches:
        layer(rows, offsets).backward(dy)
    sink.flush()
    for name, w, ref in zip(("w1", "w3", "w2"), (w1, w3, w2), want, strict=True):
        assert w.grad is None, name
        torch.testing.assert_close(sink.targets[id(w)], ref.reshape(-1), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{recipe} {name}: {m}")


def main() -> None:
    model_wiring.fused_kernels_enabled = lambda device: True  # moe_model's kernels, as on CUDA
    later = [r for r, recipe in FP8_RECIPES.items() if not recipe.fp8_wgrad]
    assert later == ["fp8_rowwise_gw_hp", "fp8_blockwise"], later
    for recipe in ("mxfp8", *later):
        check(recipe)
    print("ok")


if __name__ == "__main__":
    main()
