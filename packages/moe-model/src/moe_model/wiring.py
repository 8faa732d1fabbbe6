"""What a training loop attaches to a model it runs, in one call.

The model holds no parallelism; a trainer that runs it under data, expert or pipeline
parallelism plugs four things into its layers: the gradient weight of the auxiliary
losses (``1 / N``, the token-loss divisor), a gradient sink for the weight gradients
(``moe_model.sink``), the reduction of the routing counts over data-parallel ranks
(``global_batch`` load balancing) and a token dispatcher per MoE layer (expert
parallelism). ``wire_model`` sets all of them from one ``ModelWiring``, so what a model
runs with is stated in one place; it sets them on the modules that use them (the
experts, linear layers, embedding and MoE layers), which every view of the model that
shares those modules (a pipeline stage) sees too. A module of another package that
declares a ``grad_sink`` attribute of its own (moe_mxfp8's FP8 and MXFP8 layers) gets the sink too,
and, where it also declares ``weight_gradient`` (a maker of a sink's add from a grouped
weight gradient's operands, ``(x_RK, dy_RN, offsets, like_EKN) -> add``), this package's
``ExpertWeightGradient.from_rows`` when a sink is wired and its parameters' device runs
the fused kernels: the add then runs the Triton weight-gradient kernel that adds into the
FP32 main grad in its epilogue and merges microbatches, as for ``GroupedExperts``; where
it declares ``dense_weight_gradient`` (a maker of a sink's add from a dense weight
gradient's operands, ``(x_MK, dy_MN) -> add``: moe_mxfp8's ``FP8Linear`` and ``MXFP8Linear``), this
package's ``DenseWeightGradient`` when a sink is wired: on CUDA cuBLAS's GEMM with FP32
output adds into the main grad, as for ``Linear``; elsewhere its product is added.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from torch import nn

from moe_model._triton_support import fused_kernels_enabled
from moe_model.dispatch import TokenDispatcher
from moe_model.embedding import Embedding
from moe_model.experts import ExpertWeightGradient, GroupedExperts
from moe_model.linear import DenseWeightGradient, Linear
from moe_model.model import MoETransformer
from moe_model.moe import CountReducer, MoELayer
from moe_model.sink import GradientSink


@dataclass(frozen=True)
class ModelWiring:
    """The attachments of a model; the defaults are a model on its own.

    ``aux_loss_scale``: the gradient of each auxiliary loss (``1 / N`` for a token-loss
    sum divided by ``N``); ``gradient_sink``: where the routed experts', the dense linear
    layers' and the untied embedding's weight gradients go (tied embeddings keep
    autograd's path for the embedding and the head: their one parameter gets both
    gradients, summed by autograd); ``count_reducer``: sums the routing counts over the
    data-parallel ranks; ``dispatchers``: MoE layer name (as ``named_modules`` of the
    wired module gives it) -> its dispatcher; layers not named keep theirs.
    """

    aux_loss_scale: float = 1.0
    gradient_sink: GradientSink | None = None
    count_reducer: CountReducer | None = None
    dispatchers: Mapping[str, TokenDispatcher] = field(default_factory=dict)


def wire_model(model: nn.Module, wiring: ModelWiring) -> None:
    """Attach ``wiring`` to ``model`` (a whole model, a part of one, or a single layer).

    Refuses a dispatcher for a name that is not a MoE layer of ``model``.
    """
    modules = dict(model.named_modules())
    unknown = sorted(n for n in wiring.dispatchers if not isinstance(modules.get(n), MoELayer))
    if unknown:
        raise ValueError(f"dispatchers for {unknown}: not MoE layers of the model")
    tied = {id(m.head) for m in modules.values()
            if isinstance(m, MoETransformer) and m.config.tie_embeddings and m.head is not None}
    tied_embeddings = {id(m.embed) for m in modules.values()
                       if isinstance(m, MoETransformer) and m.config.tie_embeddings}
    for name, module in modules.items():
        if isinstance(module, GroupedExperts | Linear):
            module.grad_sink = None if id(module) in tied else wiring.gradient_sink
        elif isinstance(module, Embedding):
            module.grad_sink = None if id(module) in tied_embeddings else wiring.gradient_sink
        elif "grad_sink" in vars(module):  # another package's layer that takes the sink
            module.grad_sink = wiring.gradient_sink  # (e.g. moe_mxfp8's layers)
            if "weight_gradient" in vars(module):
                module.weight_gradient = _kernel_weight_gradient(module, wiring.gradient_sink)
            if "dense_weight_gradient" in vars(module):
                module.dense_weight_gradient = None if wiring.gradient_sink is None else DenseWeightGradient
        elif isinstance(module, MoELayer):
            module.aux_loss_scale = wiring.aux_loss_scale
            module.count_reducer = wiring.count_reducer
            if name in wiring.dispatchers:
                module.dispatcher = wiring.dispatchers[name]


def _kernel_weight_gradient(module: nn.Module, sink: GradientSink | None
                            ) -> Callable[..., ExpertWeightGradient] | None:
    """``ExpertWeightGradient.from_rows`` for a layer of another package whose weight
    gradients go into ``sink`` on a device with the fused kernels, else ``None``."""
    param = next(module.parameters(), None)
    if sink is None or param is None or not fused_kernels_enabled(param.device):
        return None
    return ExpertWeightGradient.from_rows

