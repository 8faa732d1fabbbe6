"""Starting from existing weights: ``model.init_from`` (a Hugging Face Qwen3-MoE folder) and
``checkpoint.init_from`` (one of our checkpoints, any layout), and their refusals.

Oracles: ``transformers``' own loss on the run's first global batch (FP32, the folder's
weights), and the source checkpoint's stored FP32 main weights read whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_ckpt import read_tensor
from moe_model import MoETransformer
from moe_testing import run_distributed
from pretrain.cli import main
from pretrain.config import load_config, validate_layout
from pretrain.data import BatchReader, open_data, resolve_vocab_size
from pretrain.export import model_config
from pretrain.init_from import adopt_source_model, load_initial_weights
from pretrain.mesh import build_mesh
from pretrain.train import train
from pretrain.trainer import Trainer

transformers = pytest.importorskip("transformers")

REL = 1e-5
TIMEOUT_S = 240
# one step at a constant LR: the first step's loss is the folder's weights' loss
ONE_STEP = ["train.steps=1", "optim.schedule=constant"]


def _hf_folder(path: Path, **kw) -> Path:
    """A random ``transformers`` Qwen3-MoE: GQA (4 query, 2 KV heads), head_dim 12 != 32 / 4,
    top-2 of 4 experts, a vocabulary above the embedded corpus's 256 bytes."""
    torch.manual_seed(0)
    config = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                  moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, initializer_range=0.2, rope_theta=20000.0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**config, **kw}))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _hf_folder(tmp_path_factory.mktemp("hf") / "qwen3moe")


def _first_batch(overrides: list[str]) -> torch.Tensor:
    """The run's global batch of step 1, ``[global_batch, seq_len + 1]``, on one reader."""
    cfg = load_config("tiny", overrides)
    adopt_source_model(cfg)
    resolve_vocab_size(cfg)
    t, seed = cfg.train, cfg.seed if cfg.data.seed is None else cfg.data.seed
    source = open_data(cfg.data, t.seq_len, cfg.model.vocab_size, seed)
    return BatchReader(source, seed, t.global_batch, t.global_batch, 0, 1).microbatch(1, 0)


def _transformers_loss(folder: Path, tokens: torch.Tensor) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


def _train_rank(overrides: list[str]) -> list[dict]:
    return train(load_config("tiny", overrides))


TWO_RANKS = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.mark.parametrize("n_procs, layout", [
    (1, []),
    pytest.param(2, ["parallel.ep=2"], marks=TWO_RANKS),  # each rank reads its experts
    pytest.param(2, ["parallel.pp=2"], marks=TWO_RANKS),  # each stage reads its layers
], ids=["one-process", "ep2", "pp2"])
def test_first_loss_equals_transformers(tmp_path, folder, n_procs, layout):
    overrides = [f"model.init_from={folder}", *ONE_STEP, *layout, f"run_dir={tmp_path / 'run'}"]
    if n_procs == 1:
        records = train(load_config("tiny", overrides))
    else:
        records = run_distributed(_train_rank, n_procs, overrides, timeout=TIMEOUT_S)[0]
    expected = _transformers_loss(folder, _first_batch([f"model.init_from={folder}"]))
    assert records[0]["step"] == 1
    assert records[0]["loss"] == pytest.approx(expected, rel=REL)


def test_a_wrong_mapping_changes_the_first_loss(tmp_path, folder, monkeypatch):
    """The loss comparison catches a mapping that swaps two expert projections."""
    import moe_model.hf as hf

    swapped = {**hf._EXPERTS, "mlp.experts.w1": "up_proj", "mlp.experts.w3": "gate_proj"}
    monkeypatch.setattr(hf, "_EXPERTS", swapped)
    records = train(load_config("tiny", [f"model.init_from={folder}", *ONE_STEP,
                                         f"run_dir={tmp_path / 'run'}"]))
    expected = _transformers_loss(folder, _first_batch([f"model.init_from={folder}"]))
    assert abs(records[0]["loss"] - expected) > 100 * REL * expected


# -- checkpoint.init_from ---------------------------------------------------------------


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory) -> Path:
    """A one-process run's checkpoint after 2 steps, with the routers' selection bias."""
    run = tmp_path_factory.mktemp("source") / "run"
    train(load_config("tiny", ["model.bias_update_rate=0.01", "checkpoint.every=2",
                               "train.stop_after=2", f"run_dir={run}"]))
    return run / "checkpoints" / "step_0000000002"


def _started_rank(overrides: list[str], source: str) -> dict:
    """This rank's state right after ``checkpoint.init_from`` (compared with the source's
    stored tensors here), then the first step's record."""
    cfg = load_config("tiny", overrides)
    adopt_source_model(cfg)
    resolve_vocab_size(cfg)
    mesh = build_mesh(validate_layout(cfg, dist.get_world_size()), "cpu")
    trainer = Trainer(cfg, mesh, torch.device("cpu"))
    try:
        load_initial_weights(cfg, trainer)
        state = trainer.optimizer.sharded_state()
        checked = []
        for key, shard in state.items():
            kind, _, name = key.partition("/")
            run = shard.local
            if kind == "main":
                stored = read_tensor(source, key).reshape(-1)
                start = shard.flat_offset
                assert torch.equal(run, stored[start:start + run.numel()]), key
                checked.append(key)
            else:  # exp_avg, exp_avg_sq, step: fresh
                assert not run.any(), key
        for name, buffer in trainer.model.named_buffers():
            assert torch.equal(buffer, read_tensor(source, f"buffer/{name}")), name
            checked.append(name)
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        record = trainer.train_step(1).record
    finally:
        trainer.close()
    return {"checked": checked, "params": params, "record": record}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_checkpoint_init_from_on_another_layout(tmp_path, source_checkpoint):
    overrides = ["model.bias_update_rate=0.01", f"checkpoint.init_from={source_checkpoint}",
                 "parallel.ep=2", f"run_dir={tmp_path / 'run'}"]
    ranks = run_distributed(_started_rank, 2, overrides, str(source_checkpoint), timeout=TIMEOUT_S)
    held = set(ranks[0]["checked"]) | set(ranks[1]["checked"])
    assert {k for k in held if k.startswith("main/")} == {
        k for k in _stored_names(source_checkpoint) if k.startswith("main/")}
    # the compute weights are the main weights (FP32 on CPU), expert rows at their EP offset
    for rank, result in enumerate(ranks):
        for name, value in result["params"].items():
            stored = read_tensor(source_checkpoint, f"main/{name}")
            if ".experts." in name:
                stored = stored[2 * rank:2 * rank + 2]
            assert torch.equal(value, stored), name
    # the first step reads the data stream's step-1 batch with the source's weights
    cfg = model_config(source_checkpoint)
    model = MoETransformer(cfg)
    params = dict(model.named_parameters())
    model.load_state_dict({
        n: read_tensor(source_checkpoint, f"{'main' if n in params else 'buffer'}/{n}")
        for n in model.state_dict()})
    tokens = _first_batch([f"checkpoint.init_from={source_checkpoint}",
                           "model.bias_update_rate=0.01"])
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
    assert ranks[0]["record"]["step"] == 1
    assert ranks[0]["record"]["loss"] == pytest.approx(expected, rel=REL)


def _stored_names(checkpoint: Path) -> set[str]:
    from moe_ckpt import open_checkpoint

    return set(open_checkpoint(checkpoint).tensors)


# -- refusals -----------------------------------------------------------------------------


def _refused(tmp_path: Path, capsys, args: list[str], status: int, *words: str) -> None:
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(["--config", "tiny", *args, f"run_dir={run}"]) == status
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("pretrain: error: ") and "\n" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not run.exists()


def test_a_folder_that_is_not_qwen3_moe_is_refused(tmp_path, capsys, folder):
    _refused(tmp_path, capsys, [f"model.init_from={tmp_path / 'absent'}"], 1, "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(tmp_path, capsys, [f"model.init_from={empty}"], 1, "config.json")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _refused(tmp_path, capsys, [f"model.init_from={llama}"], 1, "model_type 'llama'",
             str(llama / "config.json"))


def _copy_folder(folder: Path, to: Path, drop: str = "", **config) -> Path:
    from safetensors.torch import load_file, save_file

    to.mkdir()
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, str(to / "model.safetensors"))
    hf_config = json.loads((folder / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**hf_config, **config}))
    return to


def test_a_missing_or_misshapen_tensor_is_refused(tmp_path, capsys, folder):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    missing = _copy_folder(folder, tmp_path / "missing", drop=name)
    _refused(tmp_path, capsys, [f"model.init_from={missing}"], 1, repr(name), "missing")
    wider = _copy_folder(folder, tmp_path / "wider", moe_intermediate_size=24)
    _refused(tmp_path, capsys, [f"model.init_from={wider}"], 1,
             "model.layers.0.mlp.experts.0.gate_proj.weight", "shape (16, 32)", "(24, 32)")


def test_a_vocabulary_smaller_than_the_data_is_refused(tmp_path, capsys):
    small = _hf_folder(tmp_path / "small", vocab_size=200)
    _refused(tmp_path, capsys, [f"model.init_from={small}"], 1, "vocab_size 200",
             "data's 256")


def test_explicit_model_keys_that_contradict_the_source_are_refused(tmp_path, capsys, folder,
                                                                    source_checkpoint):
    _refused(tmp_path, capsys, [f"model.init_from={folder}", "model.n_experts=8"], 2,
             "model.n_experts=8 (the command line)", "has 4")
    _refused(tmp_path, capsys, [f"checkpoint.init_from={source_checkpoint}",
                                "model.bias_update_rate=0.01", "model.n_layers=3"], 2,
             "model.n_layers=3", "has 2")
    # agreeing keys are accepted, a preset's (tiny's d_model 64) give way
    cfg = load_config("tiny", [f"model.init_from={folder}", "model.n_experts=4"])
    adopt_source_model(cfg)
    assert (cfg.model.d_model, cfg.model.head_dim, cfg.model.vocab_size) == (32, 12, 320)


def test_checkpoint_init_from_refusals(tmp_path, capsys, folder, source_checkpoint):
    _refused(tmp_path, capsys, [f"checkpoint.init_from={tmp_path / 'absent'}"], 1,
             "is not a checkpoint directory")
    _refused(tmp_path, capsys, [f"checkpoint.init_from={source_checkpoint}",
                                f"model.init_from={folder}"], 2, "both set")
    _refused(tmp_path, capsys, [f"checkpoint.init_from={source_checkpoint}",
                                f"checkpoint.resume={source_checkpoint}"], 2, "checkpoint.resume")
    # the source's selection bias would be dropped without model.bias_update_rate
    _refused(tmp_path, capsys, [f"checkpoint.init_from={source_checkpoint}"], 1,
             "'buffer/blocks.0.mlp.router.expert_bias'", "model.bias_update_rate")


def test_a_model_qwen3_moe_cannot_hold_is_warned_about_at_the_start(tmp_path, capsys):
    assert main(["--config", "tiny", "model.router_score=sigmoid", *ONE_STEP,
                 f"run_dir={tmp_path / 'run'}"]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning")]
    assert len(warnings) == 1 and "export-hf" in warnings[0] and "router_score" in warnings[0]
