"""Train a mixture-of-experts language model (the default command).

    pretrain [train] [--config FILE_OR_NAME] [KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import signal

from pretrain.presets import PRESETS

HELP = "train a model (the default command)"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and the dotted overrides, as every command that reads a run config takes them."""
    parser.add_argument("--config", default=None, metavar="FILE_OR_NAME",
                        help=f"built-in preset ({', '.join(PRESETS)}) or TOML file "
                             "(default: default)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="dotted config override, e.g. train.steps=10, applied in order")


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pretrain.config import load_config
    from pretrain.train import train

    train(load_config(args.config, args.overrides))
    # the run is over (its teardown under train's stop flag): a stop signal from here to
    # the exit has nothing left to stop, and must not turn a finished run into a killed one
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0
