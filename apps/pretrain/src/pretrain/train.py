"""A training run from a config: process group, layout, run directory, loop.

    with the process group (one process, torchrun, or a test harness):
        layout  = validate_layout(cfg, world)     # fails before any allocation
        mesh    = build_mesh(layout)              # PP x DP, EP inside DP
        run_dir = chosen on rank 0, broadcast     # every rank writes to the same place
        trainer = Trainer(cfg, mesh, device)      # data opened and checked, model built
        the logging rank writes run_dir/config.toml and opens the trackers
        trainer.fit(...) under a SIGTERM flag
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from moe_model import total_params

from pretrain.config import ConfigError, Layout, PretrainConfig, config_toml, validate_layout
from pretrain.mesh import build_mesh
from pretrain.metrics import MetricsLog, open_trackers
from pretrain.runtime import distributed
from pretrain.signals import StopRequest
from pretrain.trainer import Trainer

CONFIG_FILE = "config.toml"


def _require_wired(cfg: PretrainConfig, layout: Layout) -> None:
    """Refuse settings whose machinery is not part of this build (rather than ignore them)."""
    missing = []
    if layout.pp > 1:
        missing.append(f"parallel.pp={layout.pp} (pipeline parallelism)")
    if layout.ep > 1:
        missing.append(f"parallel.ep={layout.ep} (expert parallelism)")
    if cfg.optim.name != "adamw":
        missing.append(f"optim.name={cfg.optim.name} (the distributed optimizer)")
    if missing:
        raise ConfigError(f"not available in this build yet: {', '.join(missing)}")


def _run_dir(cfg: PretrainConfig) -> Path:
    """``run_dir``, or a new timestamped folder chosen by rank 0 and broadcast."""
    choice = [cfg.run_dir or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))]
    dist.broadcast_object_list(choice, src=0)
    cfg.run_dir = choice[0]
    path = Path(cfg.run_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def train(cfg: PretrainConfig) -> list[dict[str, Any]]:
    """Train per ``cfg`` as one rank of the launcher's world; returns the step records."""
    with distributed(cfg.train.device) as rt:
        layout = validate_layout(cfg, rt.world_size)
        _require_wired(cfg, layout)
        mesh = build_mesh(layout, rt.device.type)
        run_dir = _run_dir(cfg)
        trainer = Trainer(cfg, mesh, rt.device)
        logging = mesh.is_logging_rank
        if logging:
            (run_dir / CONFIG_FILE).write_text(config_toml(cfg, layout))
            print(f"run_dir {run_dir}  device {rt.device}  dtype {str(trainer.dtype)[6:]}  "
                  f"params {total_params(cfg.model):,}  {layout.describe()}", flush=True)
            if cfg.checkpoint.every or cfg.checkpoint.resume not in ("auto", "none"):
                print("note: checkpoint.* is validated but checkpoints are not written or "
                      "loaded by this build yet", flush=True)
        log = MetricsLog(open_trackers(run_dir, cfg.metrics.tensorboard) if logging else [],
                         cfg.train.steps, echo=logging)
        try:
            with StopRequest() as stop:
                return trainer.fit(log, stop)
        finally:
            log.close()
