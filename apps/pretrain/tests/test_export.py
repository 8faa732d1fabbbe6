"""``pretrain export-hf``: a tiny run's checkpoint loads in transformers with our logits."""

from __future__ import annotations

import pytest
import torch
from moe_ckpt import read_tensors
from moe_model import MoETransformer
from pretrain.cli import main
from pretrain.export import model_config

transformers = pytest.importorskip("transformers")


def test_export_hf_loads_in_transformers_with_the_same_logits(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["--config", "tiny", f"run_dir={run}", "checkpoint.every=4"]) == 0
    checkpoint = run / "checkpoints" / "step_0000000004"
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export-hf", str(checkpoint), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out.absolute())

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"

    # Our model from the checkpoint's FP32 main weights, rounded as the export stores them.
    cfg = model_config(checkpoint)
    ours = MoETransformer(cfg)
    names = list(ours.state_dict())
    weights = dict(read_tensors(checkpoint, [f"main/{n}" for n in names]))
    ours.load_state_dict({n: weights[f"main/{n}"].bfloat16().float() for n in names})
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(tokens)
        got = hf.eval()(tokens).logits
    assert (got - expected).abs().max().item() < 1e-4


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export-hf", str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretrain: error: ") and "\n" not in err
    assert "is not a checkpoint directory" in err
