"""Command line: ``python -m pilab {train,simulate,scale,compare,remedies,perfmodel,data} ...``.

    python -m pilab train --np 2 --epochs 2            # launches mpiexec itself
    mpiexec -n 2 python -m pilab train --epochs 2      # or under your own launcher
    python -m pilab simulate --np 48 --epochs 2        # 48 virtual ranks in one process
    python -m pilab scale --out runs/demo              # the strong-scaling study + report
    python -m pilab data fetch                         # official CIFAR-10 (needs torchvision + internet)

Bad input gets one line on stderr naming the problem and the fix, and exit code 2.

This package is the only place with argparse: one module per subcommand, each with ``add_parser(sub)``;
nothing below the front-ends imports it. The command modules import the library inside their
``run`` functions so that ``--help`` answers at once and works without torch's start-up cost.
"""
from __future__ import annotations

import sys

from ..config import ConfigError
from ..launch import LaunchError, launcher_rank
from . import compare, data, perfmodel, remedies, scale, simulate, train
from .common import EXIT_USAGE, Parser, UsageError

__all__ = ["main", "build_parser", "UsageError", "EXIT_USAGE"]

COMMANDS = (train, simulate, scale, compare, remedies, perfmodel, data)


def build_parser() -> Parser:
    p = Parser(prog="pilab", description=__doc__.split("\n\n")[0],
               formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=Parser, required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _library_errors() -> tuple:
    # The data layer's error type lives beside numpy/torch imports; load it only once a command runs.
    from ..data import DataError
    from ..dist import LauncherError
    return UsageError, ConfigError, LaunchError, DataError, LauncherError


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra:  # argparse would blame the top-level parser; name the subcommand's help instead
            raise UsageError(f"unrecognized arguments: {' '.join(extra)} "
                             f"(see `python -m pilab {args.command} --help`)")
    except UsageError as e:
        print(f"pilab: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args, argv[1:])
    except _library_errors() as e:
        if launcher_rank() == 0:
            print(f"pilab: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pilab: interrupted", file=sys.stderr)
        return 130
