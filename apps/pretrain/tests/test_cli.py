"""The command line itself: subcommands, the default training command, suggestions for a
mistyped command, --version, and a --help that answers without loading torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from pretrain.cli import COMMANDS, main


@pytest.mark.parametrize("word, suggestion", [("export", "export-hf"), ("exprt-hf", "export-hf"),
                                              ("prepare", "prepare-data"), ("plto", "plot")])
def test_a_mistyped_command_is_refused_with_the_closest_name(word, suggestion, capsys):
    assert main([word, "x"]) == 2
    err = capsys.readouterr().err
    assert err == f"pretrain: error: unknown command {word!r}; did you mean {suggestion!r}?\n"


def test_a_word_close_to_no_command_lists_them(capsys):
    assert main(["zzz"]) == 2
    assert capsys.readouterr().err.strip().endswith(f"(commands: {', '.join(COMMANDS)})")


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("pretrain 0.")


def test_every_command_has_help(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        assert f"usage: pretrain {name}" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_help_answers_without_importing_torch():
    """``pretrain --help`` (and each command's) imports no heavy module: under a second."""
    code = ("import sys; from pretrain.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['plan', '--help']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'moe_model', 'matplotlib') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.perf_counter() - start < 5  # the import check is the real test; this bounds it


def test_explicit_train_command_equals_the_default(tmp_path):
    common = ["--config", "tiny", "train.steps=3"]
    assert main(["train", *common, f"run_dir={tmp_path / 'a'}"]) == 0
    assert main([*common, f"run_dir={tmp_path / 'b'}"]) == 0
    a, b = ((tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in "ab")
    assert [json.loads(x)["loss"] for x in a] == [json.loads(x)["loss"] for x in b]


@pytest.mark.parametrize("world, teardown", [("1", True), ("2", False)])
def test_a_rank_of_several_ends_its_process_without_the_teardown(world, teardown):
    """As the command on one rank of several, main() exits with the command's status and
    skips the interpreter's teardown (an atexit hook does not run); on one rank it returns."""
    script = ("import atexit, sys\n"
              "atexit.register(lambda: print('teardown ran', flush=True))\n"
              "from pretrain.cli import main\n"
              "sys.argv = ['pretrain', 'no-such-command']\n"
              "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "WORLD_SIZE": world})
    assert done.returncode == 2, done.stderr
    assert ("teardown ran" in done.stdout) == teardown
    assert "no-such-command" in done.stderr  # the command's own message still got out
