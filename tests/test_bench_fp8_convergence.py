"""tools/bench_fp8_convergence.py on the CPU: BF16 and emulated FP8-rowwise experts on a
tiny model, trained in two chunks and then on for more steps, its report recomputed from
its own curves."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch
from moe_testing import load_script
from pretrain.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "bench_fp8_convergence.py"
CORPUS = ROOT / "packages" / "moe-model" / "src"  # real text: ~35 Python files
STEPS, CHUNK, MORE, TAIL = 6, 3, 8, 2


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fp8_convergence_reports_resumed_curves_and_their_differences(tmp_path, capsys):
    bench = load_script(TOOL)
    root, out = tmp_path / "runs", tmp_path / "conv.json"
    args = ["--config", "tiny", "--recipes", "bf16", "fp8_rowwise", "--gemm", "emulated",
            "--device", "cpu", "--steps", str(STEPS), "--chunk-steps", str(CHUNK),
            "--eval-every", "2", "--tail", str(TAIL), "--corpus", str(CORPUS),
            "--run-root", str(root), "--out", str(out), "eval.tokens=128"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    try:
        first = bench.main(args)
        assert json.loads(out.read_text()) == first
        with pytest.raises(SystemExit, match="not empty; add --resume"):
            bench.main(args)  # nothing overwritten without --resume
        second = bench.main([*args, "--resume"])
        # train on: more steps (the runs' schedule now spans them)
        third = bench.main([*args, "--resume", "--steps", str(MORE), "--chunk-steps", "0",
                            "--plot", str(tmp_path / "conv.png")])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == third
    assert not first["complete"] and second["complete"] and third["complete"]
    assert (tmp_path / "conv.png").read_bytes()[:4] == b"\x89PNG"
    assert first["data"]["train_files"] > 0 and first["data"]["held_out_files"] > 0
    data_tokens = bench.open_token_files(first["data"]["data"], 512, verify=False).n_tokens
    tiny = load_config("tiny").train
    assert first["data"]["epochs"] == pytest.approx(
        STEPS * tiny.global_batch * tiny.seq_len / data_tokens, rel=1e-12)

    for name in ("bf16", "fp8_rowwise"):
        curves = [r["recipes"][name] for r in (first, second, third)]
        # one record per step, every call continuing the one before unchanged
        for curve, last in zip(curves, (CHUNK, STEPS, MORE), strict=True):
            assert [p["step"] for p in curve["loss"]] == list(range(1, last + 1))
        assert curves[1]["loss"][:CHUNK] == curves[0]["loss"]
        assert curves[2]["loss"][:STEPS] == curves[1]["loss"]
        assert [r["loss"] for r in _records(root / name)] == [p["loss"] for p in curves[2]["loss"]]
        # held-out loss at every eval.every-th step, at the chunk's stop and at each end
        assert [v["step"] for v in curves[2]["val_loss"]] == [2, 3, 4, 6, 8]
        assert curves[2]["val_loss"][:4] == curves[1]["val_loss"]
        assert curves[2]["tokens_per_s"] > 0

    # the report's figures, recomputed from its curves
    runs = third["recipes"]
    final = {n: statistics.fmean(p["loss"] for p in r["loss"][-TAIL:]) for n, r in runs.items()}
    val = {n: r["val_loss"][-1]["val_loss"] for n, r in runs.items()}
    for name, r in runs.items():
        assert r["final_loss"] == pytest.approx(final[name], rel=1e-12)
        assert r["final_val_loss"] == val[name]
        assert r["rel_diff_loss"] == pytest.approx((final[name] - final["bf16"]) / final["bf16"],
                                                   rel=1e-12, abs=1e-15)
        assert r["rel_diff_val_loss"] == pytest.approx((val[name] - val["bf16"]) / val["bf16"],
                                                       rel=1e-12, abs=1e-15)
        assert r["pass"] == (abs(r["rel_diff_loss"]) <= bench.TARGET_REL_DIFF
                             and abs(r["rel_diff_val_loss"]) <= bench.TARGET_REL_DIFF)
    assert third["summary"]["tail_steps"] == [MORE - TAIL + 1, MORE]

    # the recipe really applied: FP8 experts round differently from the first step on
    bf16, fp8 = ([p["loss"] for p in runs[n]["loss"]] for n in ("bf16", "fp8_rowwise"))
    assert all(a != b for a, b in zip(bf16, fp8, strict=True))
    assert max(abs(a - b) / a for a, b in zip(bf16, fp8, strict=True)) < 0.01
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-2].split()[0] == "bf16" and table[-1].split()[0] == "fp8_rowwise"


def test_fp8_convergence_refuses_to_repeat_its_training_data(tmp_path):
    """More steps than the text holds would compare how fast the recipes memorise: refused
    in one line before anything trains, and nothing is left under the new run root."""
    bench = load_script(TOOL)
    root = tmp_path / "runs"
    args = ["--config", "tiny", "--recipes", "bf16", "--device", "cpu", "--steps", "2000",
            "--corpus", str(CORPUS), "--run-root", str(root)]
    with pytest.raises(SystemExit, match=r"2000 steps would read the training data [0-9.]+ "
                                         r"times: .* or --allow-repeat"):
        bench.main(args)
    assert not root.exists()


def test_fast_accum_and_targets_apply_to_the_low_precision_recipes_only(tmp_path):
    """``--fast-accum`` sets ``mxfp8.fp8_fast_accum`` of the FP8 recipes; the BF16 reference
    (no low-precision layers) keeps the defaults, which would refuse the key."""
    bench = load_script(TOOL)
    a = bench.parse_args(["--config", "tiny", "--device", "cpu", "--recipes", "bf16",
                          "fp8_rowwise_gw_hp", "--fast-accum", "output", "grad_input",
                          "--run-root", str(tmp_path)])
    fp8 = bench.recipe_config(a, "fp8_rowwise_gw_hp", "synthetic", None, None)
    assert tuple(fp8.mxfp8.fp8_fast_accum) == ("output", "grad_input")
    base = bench.recipe_config(a, "bf16", "synthetic", None, None)
    assert not base.mxfp8.targets and tuple(base.mxfp8.fp8_fast_accum) == ("output",)
    plain = bench.parse_args(["--config", "tiny", "--device", "cpu", "--run-root", str(tmp_path)])
    assert "fp8_fast_accum" not in " ".join(bench.recipe_overrides("fp8_rowwise", "native",
                                                                     plain.fast_accum))
    assert tuple(fp8.mxfp8.targets) == ("experts",)
    dense = bench.parse_args(["--config", "tiny", "--device", "cpu", "--run-root", str(tmp_path),
                              "--targets", "experts", "attn.w?", "head"])
    cfg = bench.recipe_config(dense, "fp8_rowwise_gw_hp", "synthetic", None, None)
    assert tuple(cfg.mxfp8.targets) == ("experts", "attn.w?", "head")
    assert not bench.recipe_config(dense, "bf16", "synthetic", None, None).mxfp8.targets
    assert cfg.mxfp8.dense_gemm is None


def test_dense_gemm_applies_to_the_fp8_recipes_only(tmp_path):
    """``--dense-gemm`` sets ``mxfp8.dense_gemm`` of the FP8 recipes; the BF16 reference and
    ``mxfp8`` (whose config refuses the key) keep the default."""
    bench = load_script(TOOL)
    a = bench.parse_args(["--config", "tiny", "--device", "cpu", "--run-root", str(tmp_path),
                          "--gemm", "emulated", "--dense-gemm", "emulated",
                          "--targets", "experts", "attn.w?"])
    fp8 = bench.recipe_config(a, "fp8_rowwise_gw_hp", "synthetic", None, None)
    assert (fp8.mxfp8.gemm, fp8.mxfp8.dense_gemm) == ("emulated", "emulated")
    for recipe in ("bf16", "mxfp8"):
        assert bench.recipe_config(a, recipe, "synthetic", None, None).mxfp8.dense_gemm is None
