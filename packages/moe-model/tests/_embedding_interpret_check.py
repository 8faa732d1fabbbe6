"""Run by test_embedding_sink.py in a subprocess with TRITON_INTERPRET=1 (set before Triton
is imported): the embedding-gradient kernel on CPU against an FP64 index_add, into a flat
FP32 target and into rows of an owner-major bucket whose pieces cut the weight's rows,
with repeated tokens, a column count that is not a multiple of the kernel's block, and
no tokens; then a model's untied embedding routed into a sink against autograd."""

import dataclasses

import torch
from moe_model import ModelWiring, MoEConfig, MoETransformer, init_weights, wire_model
from moe_model import embedding as embedding_module
from moe_model.embedding import embedding_grad_accumulate_ as public_accumulate_


def embedding_grad_accumulate_(target, tokens, dy, vocab):
    public_accumulate_(target, tokens, dy, vocab, backend="triton")


def reference(start: torch.Tensor, tokens: torch.Tensor, dy: torch.Tensor, V: int) -> torch.Tensor:
    dw = torch.zeros(V, dy.shape[-1], dtype=torch.float64).index_add_(
        0, tokens.reshape(-1), dy.reshape(-1, dy.shape[-1]).double())
    return start.double() + dw.reshape(-1)


def check_kernel(gen):
    for V, D, shape in ((11, 1030, (3, 7)), (50, 24, (2, 40)), (5, 8, (0, 4))):
        tokens = torch.randint(0, V, shape, generator=gen)
        tokens.view(-1)[: tokens.numel() // 2] = 3  # a long run of one id
        dy = torch.randn(*shape, D, generator=gen)
        start = torch.randn(V * D, generator=gen)
        flat = start.clone()
        embedding_grad_accumulate_(flat, tokens, dy, V)
        want = reference(start, tokens, dy, V)
        torch.testing.assert_close(flat.double(), want, rtol=1e-6, atol=1e-5, msg=lambda m, tag=f"V={V} D={D}": f"flat {tag}: {m}")
        # owner-major: two rows of piece elements, 13 apart beyond the piece (pieces cut rows)
        piece = (V * D + 1) // 2
        bucket = torch.zeros(2, piece + 13)
        rows = bucket[:, :piece]
        for r in range(2):
            n = min(piece, V * D - r * piece)
            rows[r, :n] = start[r * piece: r * piece + n]
        embedding_grad_accumulate_(rows, tokens, dy.bfloat16(), V)
        got = torch.cat([rows[r, : min(piece, V * D - r * piece)] for r in range(2)])
        want16 = reference(start, tokens, dy.bfloat16().float(), V)
        torch.testing.assert_close(got.double(), want16, rtol=1e-6, atol=1e-5, msg=lambda m, tag=f"V={V} D={D}": f"rows {tag}: {m}")
        assert (bucket[:, piece:] == 0).all(), "wrote past a piece"


class _Sink:
    def __init__(self, params):
        self.targets = {p: torch.zeros(p.numel()) for p in params}
        self.calls = 0

    def accepts(self, p):
        return p in self.targets

    def add_gradient(self, p, add):
        add(self.targets[p])
        self.calls += 1


def check_model():
    embedding_module.sink_adds_in_kernel = lambda rows: True
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    n_experts=4, top_k=2, expert_hidden=16, grouped_mm_backend="loop")
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for use_sink in (False, True):
        model = MoETransformer(cfg)
        init_weights(model, cfg, seed=0)
        sink = _Sink([model.embed.weight])
        wire_model(model, ModelWiring(gradient_sink=sink if use_sink else None))
        model(tokens).float().pow(2).mean().backward()
        if use_sink:
            assert model.embed.weight.grad is None and sink.calls == 1
            grads.append(sink.targets[model.embed.weight].view_as(model.embed.weight))
        else:
            grads.append(model.embed.weight.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    tied = MoETransformer(dataclasses.replace(cfg, tie_embeddings=True))
    wire_model(tied, ModelWiring(gradient_sink=_Sink([tied.embed.weight])))
    assert tied.embed.grad_sink is None, "a tied embedding must keep autograd's path"


def main():
    check_kernel(torch.Generator().manual_seed(0))
    check_model()
    print("ok")


if __name__ == "__main__":
    main()
