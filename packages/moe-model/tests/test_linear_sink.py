"""Dense linear layers' weight gradients into a gradient sink (``moe_model.linear``), on CPU.

The route is taken on CUDA only (cuBLAS's FP32-output GEMM); here ``sink_takes_dense`` is
forced so that the same autograd Function, the accumulation into flat and owner-major
targets and the split-backward rule run against autograd's own gradients."""

import dataclasses

import pytest
import torch
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, wire_model
from moe_model import linear as linear_module
from moe_model.linear import Linear, dense_grad_accumulate_


def _reference(start: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return start.double() + (dy.double().t() @ x.double()).reshape(-1)


def _owner_major(start: torch.Tensor, owners: int, gap: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """``start`` split into ``owners`` rows of a wider buffer (an owner-major bucket)."""
    piece = start.numel() // owners
    bucket = torch.zeros(owners, piece + gap)
    rows = bucket[:, :piece]
    rows.copy_(start.view(owners, piece))
    return bucket, rows


@pytest.mark.parametrize(("n_out", "n_in", "owners"), [(12, 8, 1), (12, 8, 2), (12, 8, 3), (12, 8, 8)])
def test_dense_grad_accumulate_into_flat_and_owner_major_targets(n_out, n_in, owners):
    """owners 8: pieces of 12 elements cut the weight's 8-wide rows (the fallback path)."""
    gen = torch.Generator().manual_seed(n_out * owners)
    x, dy = torch.randn(19, n_in, generator=gen), torch.randn(19, n_out, generator=gen)
    start = torch.randn(n_out * n_in, generator=gen)
    want = _reference(start, x, dy)
    if owners == 1:
        flat = start.clone()
        dense_grad_accumulate_(flat, x, dy)
        torch.testing.assert_close(flat.double(), want, rtol=1e-6, atol=1e-6)
        return
    bucket, rows = _owner_major(start, owners)
    dense_grad_accumulate_(rows, x, dy)
    torch.testing.assert_close(rows.reshape(-1).double(), want, rtol=1e-6, atol=1e-6)
    assert (bucket[:, rows.shape[1]:] == 0).all(), "wrote past a piece"


def test_dense_grad_accumulate_of_bf16_operands_on_cpu_rounds_like_the_hook():
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(16, 8, generator=gen).bfloat16(), torch.randn(16, 4, generator=gen).bfloat16()
    start = torch.randn(32, generator=gen)
    got = start.clone()
    dense_grad_accumulate_(got, x, dy)
    torch.testing.assert_close(got, start + (dy.t() @ x).float().reshape(-1), rtol=0, atol=0)


def test_dense_grad_accumulate_names_bad_targets():
    x, dy = torch.randn(4, 8), torch.randn(4, 3)
    with pytest.raises(ValueError, match="float32"):
        dense_grad_accumulate_(torch.zeros(24, dtype=torch.float64), x, dy)
    with pytest.raises(ValueError, match="25 elements"):
        dense_grad_accumulate_(torch.zeros(25), x, dy)
    with pytest.raises(ValueError, match="rows"):
        dense_grad_accumulate_(torch.zeros(24), x, torch.randn(5, 3))


class _Sink:
    def __init__(self, params, owners: int = 1):
        self.targets = {p: _owner_major(torch.zeros(p.numel()), owners)[1] if owners > 1
                        else torch.zeros(p.numel()) for p in params}
        self.added = {p: 0 for p in params}

    def accepts(self, p):
        return p in self.targets

    def add_gradient(self, p, add):
        add(self.targets[p])
        self.added[p] += 1

    def grad(self, p):
        return self.targets[p].reshape(p.shape)


CFG = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                n_experts=4, top_k=2, expert_hidden=16, n_dense_layers=1, grouped_mm_backend="loop")


@pytest.mark.parametrize(("recompute", "owners"), [("none", 1), ("none", 2), ("selective", 1), ("block", 2)])
def test_model_dense_weight_gradients_into_a_sink_equal_autograd(monkeypatch, recompute, owners):
    """Every dense linear weight (attention, the dense block's SwiGLU, the head) lands in
    the sink once with autograd's gradient; ``param.grad`` stays ``None`` for them; the
    other parameters' gradients are unchanged."""
    monkeypatch.setattr(linear_module, "sink_takes_dense", lambda x: True)
    cfg = dataclasses.replace(CFG, recompute=recompute)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    runs = []
    for use_sink in (False, True):
        model = MoETransformer(cfg)
        init_weights(model, cfg, seed=0)
        dense = [m.weight for m in model.modules() if isinstance(m, Linear)]
        sink = _Sink(dense, owners)
        wire_model(model, ModelWiring(gradient_sink=sink if use_sink else None))
        model(tokens).float().pow(2).mean().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if use_sink:
            assert len(dense) == 4 + 3 + 4 + 1  # two attention blocks, the dense SwiGLU, the head
            assert all(sink.added[p] == 1 and p.grad is None for p in dense)
            grads.update({n: sink.grad(p) for n, p in model.named_parameters() if p in sink.targets})
        runs.append(grads)
    for name, want in runs[0].items():
        torch.testing.assert_close(runs[1][name], want, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_input_gradient_pass_adds_nothing(monkeypatch):
    """A pipeline's input-gradient pass (a backward that does not run the weight's
    AccumulateGrad node) must not add; the weight pass then adds exactly once."""
    monkeypatch.setattr(linear_module, "sink_takes_dense", lambda x: True)
    layer = Linear(8, 5, bias=False)
    sink = _Sink([layer.weight])
    layer.grad_sink = sink
    x = torch.randn(3, 8, requires_grad=True)
    loss = layer(x).pow(2).sum()
    (dx,) = torch.autograd.grad(loss, [x], retain_graph=True)
    assert sink.added[layer.weight] == 0
    loss.backward(inputs=[layer.weight])
    assert sink.added[layer.weight] == 1 and layer.weight.grad is None
    plain = Linear(8, 5, bias=False)
    plain.weight.data.copy_(layer.weight.data)
    x2 = x.detach().clone().requires_grad_()
    plain(x2).pow(2).sum().backward()
    torch.testing.assert_close(sink.grad(layer.weight), plain.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, x2.grad, rtol=0, atol=0)


def test_layers_without_the_route_stay_nn_linear(monkeypatch):
    """A bias, no sink, or a device without the route (the default on CPU): the plain
    ``nn.Linear`` path; a tied head keeps autograd's."""
    sink_calls = []

    class Recorder:
        def accepts(self, p):
            return True

        def add_gradient(self, p, add):
            sink_calls.append(p)

    with_bias = Linear(4, 3, bias=True)
    with_bias.grad_sink = Recorder()
    monkeypatch.setattr(linear_module, "sink_takes_dense", lambda x: True)
    with_bias(torch.randn(2, 4)).sum().backward()
    assert with_bias.weight.grad is not None and not sink_calls
    monkeypatch.undo()
    plain = Linear(4, 3, bias=False)
    plain.grad_sink = Recorder()
    plain(torch.randn(2, 4)).sum().backward()  # CPU: sink_takes_dense is False
    assert plain.weight.grad is not None and not sink_calls
    tied = MoETransformer(dataclasses.replace(CFG, tie_embeddings=True))
    wire_model(tied, ModelWiring(gradient_sink=Recorder()))
    assert tied.head.grad_sink is None and tied.embed.grad_sink is None
    assert tied.blocks["0"].attn.wq.grad_sink is not None
    untied = MoETransformer(CFG)
    wire_model(untied, ModelWiring(gradient_sink=Recorder()))
    assert untied.head.grad_sink is not None
    wire_model(untied, ModelWiring(gradient_sink=None))
    assert all(m.grad_sink is None for m in untied.modules() if isinstance(m, Linear))


class _SharedInput(torch.nn.Module):
    """A projection whose class runs layers sharing one input together (as moe_mxfp8's
    FP8Linear does): records the calls."""

    calls: list = []

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    @staticmethod
    def shared_input_forward(x: torch.Tensor, layers: tuple) -> tuple[torch.Tensor, ...]:
        _SharedInput.calls.append(len(layers))
        return tuple(layer(x) for layer in layers)


def test_shared_input_linears_hands_layers_to_their_class():
    """Attention's q, k and v go through ``shared_input_forward`` where their class has one
    (not the ``Linear`` path); plain modules are called one by one."""
    from moe_model.linear import shared_input_linears

    x = torch.randn(5, 8)
    layers = (_SharedInput(8, 6), _SharedInput(8, 4), _SharedInput(8, 4))
    _SharedInput.calls = []
    ys = shared_input_linears(x, layers)
    assert _SharedInput.calls == [3]
    assert all(torch.equal(y, layer(x)) for y, layer in zip(ys, layers, strict=True))
    plain = (torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 4, bias=False))
    ys = shared_input_linears(x, plain)
    assert _SharedInput.calls == [3] and all(torch.equal(y, m(x)) for y, m in zip(ys, plain, strict=True))
