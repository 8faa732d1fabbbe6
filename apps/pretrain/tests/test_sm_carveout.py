"""``parallel.sm_carveout``: torch's SM carveout set from trainer build to close, then restored."""

import pytest
import torch
from pretrain.config import ConfigError, load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.runtime import distributed
from pretrain.sm_carveout import sm_carveout
from pretrain.trainer import Trainer

carveout = torch._C._get_sm_carveout_experimental


def _cfg(tmp_path, *overrides: str):
    cfg = load_config("tiny", [f"run_dir={tmp_path}", *overrides])
    cfg.parallel.sm_carveout = 8  # the key is refused on a CPU run; the trainer's handling is not
    return cfg


def test_the_trainer_holds_the_carveout_until_close_and_restores_the_previous_one(tmp_path):
    assert carveout() is None
    with sm_carveout(3), distributed("cpu"):
        cfg = _cfg(tmp_path)
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
        assert carveout() == 8
        trainer.train_step(1)  # the interpreter-sized grids run with it
        trainer.close()
        assert carveout() == 3
    assert carveout() is None


def test_a_trainer_whose_build_fails_leaves_the_carveout_as_it_found_it(tmp_path):
    cfg = _cfg(tmp_path, "mxfp8.targets=experts", "mxfp8.recipe=fp8_rowwise",
               "mxfp8.gemm=native")  # refused while building (no FP8 GPU)
    with distributed("cpu"), pytest.raises(ConfigError, match="mxfp8.gemm=native"):
        Trainer(cfg, build_mesh(validate_layout(cfg, 1), "cpu"), torch.device("cpu"))
    assert carveout() is None


def test_none_leaves_the_setting_alone():
    with sm_carveout(5):
        with sm_carveout(None):
            assert carveout() == 5
        assert carveout() == 5
    assert carveout() is None
