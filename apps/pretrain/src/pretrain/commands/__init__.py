"""One module per ``pretrain`` subcommand.

Each module defines ``HELP`` (the one line ``pretrain --help`` shows),
``configure(parser)`` (its arguments) and ``run(args) -> int`` (its exit status).
Importing a command module is cheap (argparse and the standard library only): the
heavy modules (torch, the packages) are imported inside ``run``, so that
``pretrain --help`` and a mistyped command answer at once.
"""
