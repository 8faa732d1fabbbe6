"""Plot a run's loss, throughput and expert load as PNGs in RUN_DIR.

    pretrain plot RUN_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "plot a run's loss, throughput and expert load as PNGs"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a run directory holding metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    from pretrain.plot import plot_run

    for path in plot_run(args.run_dir):
        print(path)
    return 0
