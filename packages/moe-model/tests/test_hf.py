"""Hugging Face interop: Qwen3-MoE checkpoints load with equal logits, both directions."""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from moe_model import MoEConfig, MoETransformer, init_weights  # noqa: E402
from moe_model.hf import (  # noqa: E402
    Qwen3MoeFolder,
    convert_to_hf,
    from_pretrained,
    hf_config,
    save_pretrained,
)
from safetensors.torch import load_file  # noqa: E402

TOKENS = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(0))


def hf_model(**kw):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=6, num_experts_per_tok=3, initializer_range=0.2, rope_theta=20000.0, **kw)
    cfg._attn_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("kw", [dict(norm_topk_prob=True, mlp_only_layers=[0]),
                                dict(norm_topk_prob=False, tie_word_embeddings=True)])
def test_transformers_checkpoint_loads_with_equal_logits(tmp_path, kw):
    hf = hf_model(**kw)
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path).eval()
    assert ours.config.n_dense_layers == len(kw.get("mlp_only_layers", []))
    assert (ours.head.weight is ours.embed.weight) == ours.config.tie_embeddings
    with torch.no_grad():
        diff = (hf(TOKENS).logits - ours(TOKENS)).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize(("tie", "experts"), [(False, 6), (True, 6), (False, 1)])
def test_our_checkpoint_loads_in_transformers_with_equal_logits(tmp_path, tie, experts):
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=experts, top_k=min(3, experts), expert_hidden=16, n_dense_layers=1,
                    dense_hidden=40, norm_topk_weights=not tie, tie_embeddings=tie, rope_theta=5e5,
                    init_std=0.2)
    ours = MoETransformer(cfg)
    init_weights(ours, cfg, seed=1)
    save_pretrained(ours.eval(), tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, output_loading_info=True, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    saved = load_file(tmp_path / "model.safetensors")
    w1 = ours.state_dict()["blocks.2.mlp.experts.w1"]
    for e in range(experts):  # one [F, D] tensor per expert, also with a single expert
        assert torch.equal(saved[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"], w1[e])
    with torch.no_grad():
        diff = (hf.eval()(TOKENS).logits - ours(TOKENS)).abs().max().item()
    assert diff < 1e-4
    back = from_pretrained(tmp_path)  # and our own loader reads it back exactly
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_fused_expert_layout_loads(tmp_path):
    """transformers 5's in-memory layout (gate_up_proj [E, 2F, D]) is also accepted on disk."""
    from safetensors.torch import save_file

    hf = hf_model()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # fused in memory
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    ours = from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert (hf(TOKENS).logits - ours(TOKENS)).abs().max().item() < 1e-4


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_folder_reads_any_box_of_a_logical_tensor(tmp_path, fused):
    """What one rank of a parallel run reads: an expert range, a run of rows, a column block."""
    from safetensors.torch import save_file

    hf = hf_model()
    if fused:  # transformers 5's in-memory layout written as it is
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                  str(tmp_path / "model.safetensors"))
        (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    else:
        hf.save_pretrained(tmp_path)
    # the oracle: transformers' own tensors (fused in memory, gate rows before up rows, as
    # the logits tests above confirm)
    hf_state, f = hf.state_dict(), hf.config.moe_intermediate_size
    whole = {"blocks.1.mlp.experts.w1": hf_state["model.layers.1.mlp.experts.gate_up_proj"][:, :f],
             "blocks.1.mlp.experts.w3": hf_state["model.layers.1.mlp.experts.gate_up_proj"][:, f:],
             "blocks.2.mlp.experts.w2": hf_state["model.layers.2.mlp.experts.down_proj"],
             "blocks.0.attn.wq.weight": hf_state["model.layers.0.self_attn.q_proj.weight"]}
    folder = Qwen3MoeFolder(tmp_path)
    cfg = folder.model_config()
    folder.check(cfg)
    for name, offset, shape in [("blocks.1.mlp.experts.w1", (2, 3, 5), (3, 9, 20)),
                                ("blocks.1.mlp.experts.w3", (1, 0, 0), (2, 16, 32)),
                                ("blocks.2.mlp.experts.w2", (5, 7, 2), (1, 20, 11)),
                                ("blocks.0.attn.wq.weight", (4, 0), (6, 32))]:
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        assert torch.equal(folder.read(name, cfg, offset, shape), whole[name][index]), name


def test_pure_conversion_functions():
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16, tie_embeddings=True)
    w1 = torch.randn(4, 16, 32)
    pairs = convert_to_hf("blocks.1.mlp.experts.w1", w1, cfg)
    assert [n for n, _ in pairs] == [f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(4)]
    assert all(torch.equal(t, w1[e]) for e, (_, t) in enumerate(pairs))
    assert convert_to_hf("blocks.0.mlp.router.weight", torch.zeros(4, 32), cfg)[0][0] == "model.layers.0.mlp.gate.weight"
    assert convert_to_hf("head.weight", torch.zeros(64, 32), cfg) == []  # tied
    with pytest.raises(ValueError, match="full logical tensor"):
        convert_to_hf("blocks.1.mlp.experts.w2", torch.zeros(2, 32, 16), cfg)
    one = dataclasses.replace(cfg, n_experts=1, top_k=1)
    w3 = torch.randn(1, 16, 32)
    (name, t), = convert_to_hf("blocks.0.mlp.experts.w3", w3, one)  # [F, D], not [1, F, D]
    assert name == "model.layers.0.mlp.experts.0.up_proj.weight" and torch.equal(t, w3[0])
    config = hf_config(cfg)
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4
    assert config["tie_word_embeddings"] is True and config["mlp_only_layers"] == []


@pytest.mark.parametrize(("field", "value"), [("n_shared_experts", 1), ("router_score", "sigmoid"),
                                              ("bias_update_rate", 0.01), ("qk_norm", False)])
def test_unrepresentable_configs_are_refused(tmp_path, field, value):
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16, **{field: value})
    with pytest.raises(ValueError, match=field):
        hf_config(cfg)
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        save_pretrained(MoETransformer(cfg), tmp_path)


def test_partial_models_and_unsupported_checkpoints_are_refused(tmp_path):
    cfg = MoEConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                    n_experts=4, top_k=2, expert_hidden=16)
    model = MoETransformer(cfg)
    model.blocks["1"].mlp.experts.narrow_(0, 2)
    with pytest.raises(ValueError, match="whole model"):
        save_pretrained(model, tmp_path)
    hf = hf_model(mlp_only_layers=[1])  # a dense layer that is not a leading one
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="leading"):
        from_pretrained(tmp_path)
