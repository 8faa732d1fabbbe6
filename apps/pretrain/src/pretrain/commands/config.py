"""Print the resolved config: every key with its type, default and description, as TOML.

    pretrain config [--config FILE_OR_NAME] [KEY=VALUE ...]

The output is a config file (``pretrain config > my_run.toml``, edit, then
``pretrain --config my_run.toml``) and the full reference of the keys: each line is
``key = value  # type, default D: description``, read from the config dataclasses.
"""

from __future__ import annotations

import argparse

from pretrain.commands.train import add_config_arguments

HELP = "print every config key with its value, type, default and description"


def configure(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from pretrain.config import config_toml, load_config
    from pretrain.data import resolve_vocab_size
    from pretrain.data.files import DataError

    cfg = load_config(args.config, args.overrides)
    try:
        note = resolve_vocab_size(cfg)
    except DataError as e:  # the data is not there (yet): show the config as given
        note = f"model.vocab_size not taken from the data: {e}"
    text = config_toml(cfg)
    print(text if note is None else f"# {note}\n{text}", end="")
    return 0
