"""The ``pretrain`` command.

    uv run pretrain                                   # the embedded default on CPU or one GPU
    uv run pretrain --config tiny train.steps=10      # a preset plus dotted overrides
    uv run pretrain --config my_run.toml run_dir=runs/a
    torchrun --nproc-per-node 8 -m pretrain --config my_run.toml   # several GPUs
"""

from __future__ import annotations

import argparse
import sys

from pretrain.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pretrain",
        description="Train a mixture-of-experts language model.",
        epilog="Overrides are dotted KEY=VALUE pairs, e.g. train.steps=10 model.n_experts=16.",
    )
    parser.add_argument("--config", default=None, help="built-in preset name or TOML file")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"pretrain: error: {e}", file=sys.stderr)
        return 2
    from pretrain.train import train

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
