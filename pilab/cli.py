"""Command line: ``python -m pilab {train,simulate,scale,remedies,perfmodel,data} ...``.

    python -m pilab train --np 2 --epochs 2            # launches mpiexec itself
    mpiexec -n 2 python -m pilab train --epochs 2      # or under your own launcher
    python -m pilab scale --out runs/demo               # the strong-scaling study + report
    python -m pilab data fetch                          # official CIFAR-10 (needs torchvision + internet)
    python -m pilab data cache --clear                  # delete the decoded copies pilab keeps

Bad input gets one line on stderr naming the problem and the fix, and exit code 2.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from .config import CHOICES, Config, ConfigError

EXIT_USAGE = 2


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its error; we want one line naming the fix.
    def error(self, message):
        raise UsageError(f"{message} (see `python -m pilab {self.prog.split()[-1]} --help`)")


# ----------------------------------------------------------------------------------------------
# Config <-> argparse, one source of truth: the dataclass and its comments
# ----------------------------------------------------------------------------------------------
def add_config_arguments(p: argparse.ArgumentParser, defaults: Config | None = None,
                         skip: tuple = ()) -> None:
    defaults = defaults or Config()
    g = p.add_argument_group("training configuration (pilab.config.Config)")
    for f in fields(Config):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = f"{Config.help(f.name)} (default: {default!r})".replace("%", "%%")
        if f.type == "bool":
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type]
            g.add_argument(flag, dest=f.name, type=typ, default=None,
                           choices=CHOICES.get(f.name), metavar=f.name.upper(), help=text)


def config_from_args(args: argparse.Namespace, defaults: Config | None = None) -> Config:
    values = (defaults or Config()).to_dict()
    for f in fields(Config):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return Config(**values)


def find_mpiexec(explicit: str | None = None) -> str:
    """The launcher: ``explicit``, else the one next to this Python (pip's MPICH), else PATH's."""
    if explicit:
        if not (os.path.isfile(explicit) and os.access(explicit, os.X_OK)):
            raise UsageError(f"--mpiexec {explicit} is not an executable file; give the path of mpiexec")
        return explicit
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise UsageError("no mpiexec found next to this Python or on PATH; "
                         "`pip install mpich` (or apt-get install mpich) or pass --mpiexec PATH")
    return found


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without ``--flag VALUE`` / ``--flag=VALUE`` for each flag (for re-launching ranks)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(fl + "=") for fl in flags):
            continue
        out.append(a)
    return out


def _under_mpi() -> bool:
    from .dist import launcher_size
    return launcher_size() > 0


# ----------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------
def _progress_callbacks(quiet: bool):
    """A tqdm bar over all steps and one line per epoch (rank 0 only: callbacks run there)."""
    if quiet:
        return []
    from tqdm.auto import tqdm
    state = {}

    def cb(ev):
        kind = ev["kind"]
        if kind == "start":
            done = ev["start_epoch"] * ev["steps_per_epoch"]
            state["bar"] = tqdm(total=ev["total_steps"], initial=done, unit="step",
                                desc=f"np={ev['np']}", dynamic_ncols=True, file=sys.stderr)
        elif kind == "step":
            bar = state["bar"]
            bar.update(1)
            bar.set_postfix(loss=f"{ev['loss']:.3f}", img_s=f"{ev['images_per_s']:.0f}", refresh=False)
        elif kind == "epoch":
            test = "" if ev["test_acc"] is None else \
                f"  test loss {ev['test_loss']:.3f} acc {ev['test_acc']:.3f}"
            state["bar"].write(f"epoch {ev['epoch']}: train loss {ev['train_loss']:.3f} "
                               f"acc {ev['train_acc']:.3f}{test}  {ev['time']:.1f}s "
                               f"(comm {ev['comm']:.1f}s, exposed {ev['comm_exposed']:.1f}s)")
        elif kind == "end":
            state["bar"].close()
    return [cb]


def _launch(argv: list[str], np_: int, mpiexec: str, command: str) -> int:
    cmd = [mpiexec, "-n", str(np_), sys.executable, "-m", "pilab", command, *argv]
    print("launching: " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.call(cmd)


def cmd_train(args, argv) -> int:
    cfg = config_from_args(args, Config(out="runs/train"))
    if args.np is not None and not _under_mpi():
        # Validate everything that can be checked before any rank starts.
        if args.np < 1:
            raise ConfigError(f"--np {args.np} must be >= 1")
        from .train import load_data
        ds = load_data(cfg)
        cfg.check_world(args.np, len(ds.y_train))
        mpiexec = find_mpiexec(args.mpiexec)
        return _launch(_strip(argv, ("--np", "--mpiexec")), args.np, mpiexec, "train")
    from mpi4py import MPI
    from .data import DataError
    from .dist import abort_on_error, check_launcher
    from . import train
    comm = MPI.COMM_WORLD
    check_launcher(comm)
    # Validate on every rank, then vote: a bad setting stops all ranks cleanly (exit 2) before any
    # collective of the training itself, instead of leaving some ranks waiting.
    error, ds = None, None
    try:
        if args.np is not None and args.np != comm.Get_size():
            raise ConfigError(f"--np {args.np} but this job has {comm.Get_size()} ranks; "
                              "drop --np under mpiexec")
        ds = train.load_data(cfg)
        cfg.check_world(comm.Get_size(), len(ds.y_train))
    except (ConfigError, DataError) as e:
        error = e
    first = comm.allreduce(comm.Get_rank() if error is not None else comm.Get_size(), op=MPI.MIN)
    if first < comm.Get_size():
        if comm.Get_rank() == first:  # the lowest failing rank speaks for all
            print(f"pilab: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    with abort_on_error(comm):
        result = train.run(cfg, comm, callbacks=_progress_callbacks(args.quiet), data=ds)
    if comm.Get_rank() == 0:
        last = result["epochs"][-1] if result["epochs"] else {}
        print(f"np={result['np']} threads/rank={result['threads']} global batch={result['global_batch']} "
              f"wall {result['wall_time']:.1f}s  {result['images_per_s'] or 0:.0f} img/s  "
              f"final test acc {last.get('test_acc')}")
        if cfg.out:
            print(f"result: {os.path.join(cfg.out, 'result.json')}")
    return 0


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
def cmd_data(args, argv) -> int:
    from . import data
    if args.action == "fetch":
        path = data.fetch(args.root)
        print(f"CIFAR-10 python batches in {path}; use --data cifar10 (or --data {path})")
        return 0
    if args.clear and args.action != "cache":
        raise UsageError(f"--clear goes with `pilab data cache`, not `pilab data {args.action}`")
    if args.action == "cache":
        entries = data.cache_entries()
        if args.clear:
            removed = data.clear_cache()
            print(f"removed {len(removed)} cached data set(s), "
                  f"{sum(e['bytes'] for e in entries) / 1e6:.0f} MB, from {data.default_cache_dir()}")
            return 0
        print(f"cache: {data.default_cache_dir()} ({len(entries)} data set(s), "
              f"{sum(e['bytes'] for e in entries) / 1e6:.0f} MB; `pilab data cache --clear` removes them)")
        for e in entries:
            print(f"{e['bytes'] / 1e6:8.1f} MB  {os.path.basename(e['path'])}  {e['source']}")
        return 0
    ds = data.load(args.data)
    print(f"source: {ds.source}\ntrain: {len(ds.y_train)}  test: {len(ds.y_test)}  "
          f"classes: {', '.join(ds.classes)}\nchecksum: {ds.checksum}\n"
          f"cache: {data.default_cache_dir()}")
    return 0


# ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pilab", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", parser_class=_Parser, required=True)

    t = sub.add_parser("train", help="synchronous data-parallel training over MPI",
                       description="Train one model on np MPI ranks. Under mpiexec, every rank runs "
                                   "this command; with --np N it launches mpiexec itself.")
    t.add_argument("--np", type=int, default=None,
                   help="launch this many MPI ranks with mpiexec (omit under your own mpiexec)")
    t.add_argument("--mpiexec", default=None,
                   help="launcher to use with --np (default: the mpiexec next to this Python, then PATH)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_arguments(t, Config(out="runs/train"))
    t.set_defaults(func=cmd_train)

    d = sub.add_parser("data", help="fetch, inspect or uncache CIFAR-10",
                       description="fetch: download the official CIFAR-10 (needs torchvision and "
                                   "internet); info: load a source and show counts and checksum; "
                                   "cache: list the decoded data sets pilab keeps ($PILAB_CACHE), "
                                   "--clear to delete them.")
    d.add_argument("action", choices=("fetch", "info", "cache"))
    d.add_argument("--clear", action="store_true", help="with cache: delete the cached data sets")
    d.add_argument("--root", default=None, help="where fetch stores it (default: the pilab cache)")
    d.add_argument("--data", default="embedded", help="source for info (default: embedded)")
    d.set_defaults(func=cmd_data)

    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


_EXTRA_COMMANDS: list = []


def _register_optional():
    # Each study module adds its own subcommand; they import lazily so `train` starts fast.
    if _EXTRA_COMMANDS:  # once per process: main() may be called again (tests, notebooks)
        return
    import importlib
    import importlib.util
    for name in ("simulate", "scaling", "remedies", "perfmodel"):
        if importlib.util.find_spec(f"pilab.{name}") is None:
            continue
        mod = importlib.import_module(f"pilab.{name}")
        if hasattr(mod, "add_cli"):
            _EXTRA_COMMANDS.append(mod.add_cli)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .data import DataError
    from .dist import LauncherError
    _register_optional()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return args.func(args, argv[1:])
    except (UsageError, ConfigError, DataError, LauncherError) as e:
        from .dist import launcher_rank
        if launcher_rank() == 0:
            print(f"pilab: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pilab: interrupted", file=sys.stderr)
        return 130
