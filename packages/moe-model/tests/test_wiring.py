"""wire_model on another package's layer that declares the sink slots."""

import torch
from moe_model import ExpertWeightGradient, ModelWiring, wire_model
from moe_model import wiring as wiring_module
from moe_model.linear import DenseWeightGradient
from torch import nn


class ForeignExperts(nn.Module):
    """Declares ``grad_sink`` and ``weight_gradient`` as moe_mxfp8's FP8 experts do."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(2, 4, 4))
        self.grad_sink = None
        self.weight_gradient = None


class Sink:
    def accepts(self, param):
        return True

    def add_gradient(self, param, add):
        add(torch.zeros(param.numel()))


def test_a_foreign_layer_gets_the_sink_and_the_kernel_weight_gradient_where_kernels_run(monkeypatch):
    layer, sink = ForeignExperts(), Sink()
    wire_model(layer, ModelWiring(gradient_sink=sink))  # a CPU without the fused kernels
    assert layer.grad_sink is sink and layer.weight_gradient is None
    monkeypatch.setattr(wiring_module, "fused_kernels_enabled", lambda device: True)
    wire_model(layer, ModelWiring(gradient_sink=sink))
    assert layer.weight_gradient == ExpertWeightGradient.from_rows
    wire_model(layer, ModelWiring())  # unwired: autograd's gradients, nothing made
    assert layer.grad_sink is None and layer.weight_gradient is None
    plain = nn.Linear(2, 2)
    plain.grad_sink = None  # a sink slot alone: nothing else is set
    wire_model(plain, ModelWiring(gradient_sink=sink))
    assert "weight_gradient" not in vars(plain)


class ForeignDense(nn.Module):
    """Declares ``grad_sink`` and ``dense_weight_gradient`` as moe_mxfp8's FP8Linear does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4))
        self.grad_sink = None
        self.dense_weight_gradient = None


def test_a_foreign_dense_layer_gets_the_dense_weight_gradient_where_a_sink_is_wired():
    layer, sink = ForeignDense(), Sink()
    wire_model(layer, ModelWiring(gradient_sink=sink))
    assert layer.grad_sink is sink and layer.dense_weight_gradient is DenseWeightGradient
    wire_model(layer, ModelWiring())  # unwired: autograd's gradient, nothing made
    assert layer.grad_sink is None and layer.dense_weight_gradient is None
