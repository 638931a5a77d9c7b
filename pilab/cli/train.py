"""``pilab train``: synchronous data-parallel training over MPI.

    python -m pilab train --np 2 --epochs 2            # launches mpiexec itself
    mpiexec -n 2 python -m pilab train --epochs 2      # every rank runs this command
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..config import Config, ConfigError
from ..launch import pilab_command, under_mpi
from .common import EXIT_USAGE, add_config_arguments, config_from_args, progress_callbacks, strip_flags

DEFAULTS = Config(out="runs/train")


def add_parser(sub) -> None:
    t = sub.add_parser("train", help="synchronous data-parallel training over MPI",
                       description="Train one model on np MPI ranks. Under mpiexec, every rank runs "
                                   "this command; with --np N it launches mpiexec itself.")
    t.add_argument("--np", type=int, default=None,
                   help="launch this many MPI ranks with mpiexec (omit under your own mpiexec)")
    t.add_argument("--mpiexec", default=None,
                   help="launcher to use with --np (default: $PILAB_MPIEXEC, the mpiexec next to this "
                        "Python, then PATH)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_arguments(t, DEFAULTS)
    t.set_defaults(func=run)


def run(args, argv) -> int:
    cfg = config_from_args(args, DEFAULTS)
    if args.np is not None and not under_mpi():
        return _launch(cfg, args, argv)
    if not under_mpi():
        return _report(_train_alone(cfg, args.quiet), cfg)
    return _train_rank(cfg, args)


def _launch(cfg: Config, args, argv) -> int:
    """``--np N`` outside mpiexec: validate what can be checked before any rank starts, then launch."""
    from ..engine import load_data
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    cfg.check_world(args.np, len(load_data(cfg).y_train))
    cmd = pilab_command(args.np, ["train", *strip_flags(argv, ("--np", "--mpiexec"))], mpiexec=args.mpiexec)
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def _train_alone(cfg: Config, quiet: bool) -> dict:
    """One process without mpiexec: no MPI library needed."""
    from .. import train
    return train.run(cfg, None, callbacks=progress_callbacks(quiet))


def _train_rank(cfg: Config, args) -> int:
    """One rank of an mpiexec job."""
    from mpi4py import MPI

    from .. import train
    from ..data import DataError
    from ..dist import abort_on_error, check_launcher
    from ..engine import load_data
    comm = MPI.COMM_WORLD
    check_launcher(comm)
    # Validate on every rank, then vote: a bad setting stops all ranks cleanly (exit 2) before any
    # collective of the training itself, instead of leaving some ranks waiting.
    error, ds = None, None
    try:
        if args.np is not None and args.np != comm.Get_size():
            raise ConfigError(f"--np {args.np} but this job has {comm.Get_size()} ranks; "
                              "drop --np under mpiexec")
        ds = load_data(cfg)
        cfg.check_world(comm.Get_size(), len(ds.y_train))
    except (ConfigError, DataError) as e:
        error = e
    first = comm.allreduce(comm.Get_rank() if error is not None else comm.Get_size(), op=MPI.MIN)
    if first < comm.Get_size():
        if comm.Get_rank() == first:  # the lowest failing rank speaks for all
            print(f"pilab: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    with abort_on_error(comm):
        result = train.run(cfg, comm, callbacks=progress_callbacks(args.quiet), data=ds)
    return _report(result, cfg) if comm.Get_rank() == 0 else 0


def _report(result: dict, cfg: Config) -> int:
    last = result["epochs"][-1] if result["epochs"] else {}
    print(f"np={result['np']} threads/rank={result['threads']} global batch={result['global_batch']} "
          f"wall {result['wall_time']:.1f}s  {result['images_per_s'] or 0:.0f} img/s  "
          f"final test acc {last.get('test_acc')}")
    if cfg.out:
        print(f"result: {os.path.join(cfg.out, 'result.json')}")
    return 0
