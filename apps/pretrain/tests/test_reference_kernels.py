"""``train.reference_kernels``: every package's switch on from trainer build to close."""

import moe_ddp
import moe_ep_transport
import moe_model
import moe_mxfp8
import pytest
import torch
from pretrain.config import ConfigError, load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.runtime import distributed
from pretrain.trainer import Trainer

PACKAGES = (moe_model, moe_mxfp8, moe_ddp, moe_ep_transport)


def _switches() -> list[bool]:
    return [p.reference_kernels_enabled() for p in PACKAGES]


def _trainer(tmp_path, on: bool) -> Trainer:
    cfg = load_config("tiny", [f"run_dir={tmp_path}", f"train.reference_kernels={str(on).lower()}"])
    assert cfg.train.reference_kernels is on
    return Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))


def test_the_key_turns_every_switch_on_until_close_and_a_second_trainer_starts_clean(tmp_path):
    assert _switches() == [False] * 4
    with distributed("cpu"):
        trainer = _trainer(tmp_path / "a", True)
        assert _switches() == [True] * 4
        trainer.train_step(1)
        trainer.close()
        assert _switches() == [False] * 4
        second = _trainer(tmp_path / "b", False)
        assert _switches() == [False] * 4
        second.close()


def test_close_restores_a_switch_that_was_on_before(tmp_path):
    with moe_model.use_reference_kernels(True), distributed("cpu"):
        trainer = _trainer(tmp_path, True)
        trainer.close()
        assert _switches() == [True, False, False, False]


def test_a_trainer_whose_build_fails_leaves_the_switches_as_it_found_them(tmp_path):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", "train.reference_kernels=true",
                               "mxfp8.targets=experts", "mxfp8.recipe=fp8_rowwise",
                               "mxfp8.gemm=native"])  # refused while building (no FP8 GPU)
    with distributed("cpu"), pytest.raises(ConfigError, match="mxfp8.gemm=native"):
        Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
    assert _switches() == [False] * 4
