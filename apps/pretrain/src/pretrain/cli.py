"""The ``pretrain`` command line.

    uv run pretrain                                      # train: the embedded default (stdlib bytes)
    uv run pretrain --config tiny train.steps=10         # a preset plus dotted overrides
    uv run pretrain --config my_run.toml run_dir=runs/a  # a TOML file
    torchrun --nproc-per-node 8 -m pretrain --config my_run.toml
    uv run pretrain export-hf runs/a/checkpoints/step_0000000004 hf/a
    uv run pretrain generate runs/a/checkpoints/step_0000000004 --prompt "def "
    uv run pretrain prepare-data docs/ --out data/docs --tokenizer tokenizer.json
    uv run pretrain plot runs/a
    uv run pretrain plan --config my_run.toml
    uv run pretrain config --config tiny train.steps=10   # every key: value, type, default, description

Training is the default command: ``pretrain [train] [--config X] [KEY=VALUE ...]``.
The other commands are argparse subcommands, one module each in
``pretrain.commands``; a word that names none of them is refused with the closest
name (``pretrain export`` -> did you mean 'export-hf'?).

Exit status: 0 done (also after a clean stop on SIGTERM or SIGINT); 130 interrupted
(SIGINT) before training started; 2 a bad command line or
config (one line on stderr naming the key); 1 any other error the run foresees (bad
data, a checkpoint that cannot be loaded, too many non-finite steps), also one line
(``pretrain.errors``). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from importlib import metadata
from typing import NoReturn

from pretrain.errors import PretrainError

# subcommand -> module under pretrain.commands
COMMANDS = {
    "train": "train",
    "prepare-data": "prepare_data",
    "plot": "plot",
    "export-hf": "export_hf",
    "generate": "generate",
    "plan": "plan",
    "config": "config",
    "calibrate": "calibrate",
}
DEFAULT_COMMAND = "train"


def fail(message: str, status: int) -> int:
    """Print ``pretrain: error: <message>`` on stderr; return ``status``."""
    print(f"pretrain: error: {message}", file=sys.stderr, flush=True)
    return status


def version() -> str:
    try:
        return metadata.version("pretrain")
    except metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain",
        description="Pretrain mixture-of-experts language models. Without a command, trains: "
                    "pretrain [--config FILE_OR_NAME] [KEY=VALUE ...].",
        epilog="pretrain COMMAND --help describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"pretrain {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"pretrain.commands.{module_name}")
        command = sub.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0],
                                 prog=f"pretrain {name}")
        module.configure(command)
        command.set_defaults(run=module.run)
    return parser


def _with_command(argv: list[str]) -> list[str] | str:
    """``argv`` with the command made explicit (training when none is named), or the
    unknown word that stands where a command would."""
    if not argv:
        return [DEFAULT_COMMAND]
    first = argv[0]
    if first in COMMANDS or first in ("-h", "--help", "--version"):
        return argv
    if first.startswith("-") or "=" in first:  # the training command's options or overrides
        return [DEFAULT_COMMAND, *argv]
    return first


def _unknown_command(word: str) -> int:
    names = list(COMMANDS)
    close = [n for n in names if n.startswith(word)] or difflib.get_close_matches(word, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f" (commands: {', '.join(names)})"
    return fail(f"unknown command {word!r}{hint}", 2)


def _exit_status(error: BaseException) -> int | None:
    """The exit status of an error the run foresees; ``None`` for a bug."""
    if isinstance(error, PretrainError):
        return error.exit_status
    ckpt = sys.modules.get("moe_ckpt")  # the checkpoint library's own errors, if it is loaded
    if ckpt is not None and isinstance(error, ckpt.CheckpointError):
        return 1
    return None


def main(argv: list[str] | None = None) -> int:
    """The ``pretrain`` command (``argv``: its arguments; ``None``: ``sys.argv``); the exit
    status. As the command itself on one rank of several, it ends the process once the
    command returns (``end_rank_process``)."""
    status = _run(sys.argv[1:] if argv is None else list(argv))
    if argv is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        end_rank_process(status)
    return status


def end_rank_process(status: int) -> NoReturn:
    """Exit a rank's process with ``status`` without the interpreter's teardown.

    By then the command has closed what it opened (checkpoints committed and their
    writers joined, process groups destroyed, files closed, the tracker finished); what
    the teardown has left to free are the native libraries' threads (the communication
    backend's, the checkpoint store's). On CPU ranks under torchrun one of those aborted
    the process about once in 20-30 runs ("terminate called without an active
    exception", no Python frame on the stack), after a run that had succeeded."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def _run(argv: list[str]) -> int:
    explicit = _with_command(argv)
    if isinstance(explicit, str):
        return _unknown_command(explicit)
    args = build_parser().parse_args(explicit)
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C outside training's own stop handling (pretrain.signals)
        return fail("interrupted (SIGINT)", 130)
    except Exception as e:
        status = _exit_status(e)
        if status is None:
            raise
        return fail(str(e), status)


if __name__ == "__main__":
    sys.exit(main())
