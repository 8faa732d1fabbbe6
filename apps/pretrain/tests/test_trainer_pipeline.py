"""The trainer's wiring of a pipeline: what reaches the stage views the schedule runs.

A stage view is a shallow copy of the model's root sharing its submodules
(moe_pp.stages): root attributes, such as the embedding's gradient sink, are the
view's own, so setting one on the rank's union module does not reach the views.
"""

from __future__ import annotations

import pytest
from moe_testing import run_distributed
from pretrain.config import load_config, validate_layout
from pretrain.mesh import build_mesh
from pretrain.runtime import distributed
from pretrain.trainer import Trainer


def _embedding_sinks(run_dir: str) -> dict[str, list[bool]]:
    """Per stage view holding the embedding: whether its sink is the DDP wrapper, after
    the trainer is built and after it is closed."""
    cfg = load_config("tiny", ["parallel.pp=2", f"run_dir={run_dir}"])
    with distributed("cpu") as rt:
        trainer = Trainer(cfg, build_mesh(validate_layout(cfg, rt.world_size), "cpu"), rt.device)
        stages = trainer.part.pipeline.stages.stages
        views = [s.module for s in stages if s.module.embed is not None]
        built = [v.embed.grad_sink is trainer.ddp for v in views]
        trainer.close()
        closed = [v.embed.grad_sink is None for v in views]
    return {"built": built, "closed": closed}


@pytest.mark.multiprocess
def test_the_embedding_stage_view_gets_the_gradient_sink(tmp_path):
    """Without it, stage 0 ran the embedding without the sink (numerics the same, the
    slower autograd path for its gradient on GPU)."""
    first, last = run_distributed(_embedding_sinks, 2, str(tmp_path), timeout=240)
    assert first == {"built": [True], "closed": [True]}
    assert last == {"built": [], "closed": []}
