"""Command line: python -m pilab COMMAND ... (every command below; `python -m pilab COMMAND --help` for its options).

    python -m pilab train --np 2 --epochs 2            # launches mpiexec itself
    mpiexec -n 2 python -m pilab train --epochs 2      # or under your own launcher
    python -m pilab simulate --np 48 --epochs 2        # 48 virtual ranks in one process
    python -m pilab scale --out runs/demo              # the strong-scaling study + report
    python -m pilab compare runs/a runs/b --out runs/ab  # studies side by side
    python -m pilab remedies --np 48 --out runs/r      # settings that stay accurate at np=48
    python -m pilab perfmodel table                    # the performance model's Pi-cluster table
    python -m pilab trace runs/x                       # a run's trace: stragglers, critical path, swim lanes
    python -m pilab data fetch                         # official CIFAR-10 (needs torchvision + internet)
    python -m pilab testbed up --help                  # a Pi cluster on one machine (network namespaces)
    python -m pilab bench --help                       # benchmarks against baselines of the same run
    python -m pilab doctor --hostfile hosts            # preflight: every host checked before a cluster run

Bad input gets one line on stderr naming the problem and the fix, and exit code 2. A file that cannot
be written (disk full, no permission) gets one line and exit code 74; an interrupted command exits 130
(SIGINT) or 143 (SIGTERM) after writing what it did (see the manual's docs/failures.md).

This package is the only place with argparse: one module per subcommand, each with ``add_parser(sub)``;
nothing below the front-ends imports it. The command modules import the library inside their
``run`` functions so that ``--help`` answers at once and works without torch's start-up cost.
"""
from __future__ import annotations

import errno
import sys

from ..config import ConfigError
from ..engine import EXIT_WRITE
from ..launch import LaunchError, launcher_rank
from . import bench, compare, data, doctor, perfmodel, remedies, scale, simulate, testbed, trace, train
from .common import EXIT_USAGE, Parser, UsageError

__all__ = ["main", "build_parser", "UsageError", "EXIT_USAGE"]

COMMANDS = (train, simulate, scale, compare, remedies, perfmodel, trace, data, testbed, bench, doctor)


def build_parser() -> Parser:
    # the examples too: `pilab --help` shows a line for every command (COMMANDS), not only the list
    p = Parser(prog="pilab", description=__doc__.split("\n\nBad input")[0],
               formatter_class=__import__("argparse").RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=Parser, required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def _library_errors() -> tuple:
    # pilab.data and pilab.dist.helpers import torch (seconds): an error of theirs can only have been raised once
    # they were imported, so look their types up instead of importing them for a one-line message.
    errors = [UsageError, ConfigError, LaunchError]
    for module, name in (("pilab.data.dataset", "DataError"), ("pilab.dist.helpers", "LauncherError"),
                         ("pilab.models.names", "ModelError"), ("pilab.launch.slurm", "SlurmError"),
                         ("pilab.resultfile", "ResultFileError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


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
    # Your own model is built only where you named it here (--model): never from a builder string that a
    # result, trace or study file names (pilab.models.names.only_named)
    from ..models import only_named
    try:
        with only_named([getattr(args, "model", None)]):  # for this command only (main may be called again)
            return args.func(args, argv[1:])
    except _library_errors() as e:
        if launcher_rank() == 0:
            print(f"pilab: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # results, reports, checkpoints: earlier files are left as they were
        if not _is_write_fault(e):
            raise
        if launcher_rank() == 0:
            what = f"cannot write {e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
            print(f"pilab: error: {what}", file=sys.stderr)
        return EXIT_WRITE
    except KeyboardInterrupt:  # a second Ctrl-C, or a command without a stop point of its own
        print("pilab: interrupted", file=sys.stderr)
        return 130


def _is_write_fault(e: OSError) -> bool:
    """Disk full, quota, read-only file system, no permission: the machine's fault, one line."""
    from ..engine import WriteError
    return isinstance(e, WriteError) or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                    errno.EPERM)
