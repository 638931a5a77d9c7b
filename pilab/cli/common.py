"""What every subcommand shares: the one-line usage error, Config <-> flags, the progress display.

Only the CLI imports this module; library code raises its own errors (``ConfigError``, ``DataError``,
``LaunchError`` …) and ``pilab.cli.main`` turns them into one line and exit code 2.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import fields

from .. import resultfile
from ..config import CHOICES, Config, ConfigError, allowed
from ..engine import EXIT_HANG, EXIT_WRITE, print_stragglers

EXIT_USAGE = 2
EXIT_FAILED = 1
# Every exit status a command gives, with what it means: the manual's exit-code reference is made from it.
EXIT_CODES = (
    (0, "done; every check passed (`doctor`)"),
    (EXIT_FAILED, "a check failed (`doctor`), a study's point or a launched job failed (`scale`, `remedies`, "
                  "`perfmodel bench`); the finished points are kept and `--resume` runs the rest"),
    (EXIT_USAGE, "bad input: one line on stderr naming the problem and the fix; nothing written, no rank "
                 "started"),
    (EXIT_HANG, "a rank made no step for --hang-s seconds: the watchdog ended the job, naming the "
                "unreachable or stuck rank"),
    (EXIT_WRITE, "a result, report or checkpoint could not be written (disk full, no permission): one line, "
                 "the earlier files intact"),
    (130, "stopped by Ctrl-C (SIGINT) after the step every rank agreed on; result.json says stopped_early "
          "and `--resume` continues"),
    (143, "stopped by SIGTERM (a scheduler's end of job), as for 130"),
    ("128 + N", "stopped by signal N; any other status of `train --np` is mpiexec's (a rank crashed)"),
)


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its error; we want one line naming the fix.
    def error(self, message):
        words = self.prog.split()
        hint = "python -m pilab" + ("" if len(words) < 2 else " " + " ".join(words[1:]))
        raise UsageError(f"{message} (see `{hint} --help`)")


def ints(text: str, what: str = "process counts") -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything else is a one-line error."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{text!r} is not a comma-separated list of {what}, e.g. 1,2,4") from None


# ----------------------------------------------------------------------------------------------
# options that several commands share: one definition each
# ----------------------------------------------------------------------------------------------
class IntList(argparse.Action):
    """A list of whole numbers, the same on every command: ``--nps 1,2,4`` (the form the manual writes)
    or ``--nps 1 2 4``; ``''`` is the empty list. A word that is not a number is a one-line error."""
    words = "integers, e.g. 1,2,4"  # the reference's "Value" column

    def __init__(self, option_strings, dest, **kw):
        kw.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            out = [int(t) for v in values for t in v.split(",") if t.strip()]
        except ValueError:
            parser.error(f"argument {option_string}: {' '.join(values)!r} is not a list of whole numbers; "
                         "write e.g. 1,2,4")
        setattr(namespace, self.dest, out)


def add_int_list(p, *flags: str, default: list[int] | None, help: str, shown: str = "", **kw) -> None:
    """``--flag 1,2,4`` (or ``--flag 1 2 4``) as a list of ints; the help ends with ``default`` (or the
    words ``shown``; a default of None lets the command tell an explicit list from none given)."""
    p.add_argument(*flags, action=IntList, default=None if default is None else list(default), metavar="N",
                   help=f"{help} (default: {shown or ','.join(map(str, default or [])) or 'none'})", **kw)


def fit_nps(cfg: Config, wanted: list[int], n_train: int, *, flag: str, command: str) -> list[int]:
    """The default process counts ``wanted`` that ``n_train`` training images can hold (each rank at
    least one batch), with the largest count that can in place of those that cannot; one line on stderr
    when a count changed. A user's small data set then runs with nothing else given::

        fit_nps(cfg, [8, 48], 450, flag="--simulate-nps", command="scale")   # [8, 14] at 32 a rank
    """
    def fits(p: int) -> bool:
        try:
            cfg.check_world(p, n_train)
            return True
        except ConfigError:
            return False
    kept = [p for p in wanted if fits(p)]
    if len(kept) == len(wanted):
        return list(wanted)
    top = next((p for p in range(max(wanted), 0, -1) if fits(p)), None)
    if top is not None and top not in kept:
        kept = sorted(kept + [top])
    print(f"pilab {command}: {n_train} training images hold at most {top or 0} ranks of {cfg.batch_size} "
          f"images: {flag} {','.join(map(str, kept)) or 'none'} instead of the default "
          f"{','.join(map(str, wanted))} (give {flag} to choose; a smaller --batch-size fits more ranks)",
          file=sys.stderr, flush=True)
    return kept


def add_launch_arguments(p, *, what: str = "the ranks", hostfile: bool = True, hostfile_group=None,
                         hostfile_default: str = "none: mpiexec's own ($HYDRA_HOST_FILE), else this machine"):
    """The options of every command that starts MPI ranks, defined once: ``--mpiexec`` and ``--hostfile``
    (``train --np``, ``scale``, ``doctor``, ``perfmodel bench``). ``hostfile=False`` for a command whose
    ranks are helpers that run here (``remedies``' and ``bench``'s micro-benchmarks);
    ``hostfile_group``: where ``--hostfile`` goes (``doctor``: beside ``--hosts``, one or the other)."""
    p.add_argument("--mpiexec", default=None, metavar="PATH",
                   help=f"the mpiexec that starts {what} (default: $PILAB_MPIEXEC, the mpiexec beside this "
                        "Python, then PATH)")
    if hostfile:
        (hostfile_group or p).add_argument(
            "--hostfile", default=None, metavar="FILE",
            help=f"MPICH hostfile (host:slots lines) placing {what} on a cluster's hosts (default: "
                 f"{hostfile_default})")


# ----------------------------------------------------------------------------------------------
# Config <-> argparse, one source of truth: the dataclass and its comments
# ----------------------------------------------------------------------------------------------
def add_config_arguments(p: argparse.ArgumentParser, defaults: Config | None = None,
                         skip: tuple = (), shown: dict | None = None, of_args=None) -> None:
    """One ``--flag`` per Config field, typed, with the field's help, allowed values and this command's
    default (``shown``: words instead of a default's value, e.g. one that depends on ``--data``).

    The flags default to None, so that ``config_from_args`` knows which were given; the command's own
    default is kept on the action as ``pilab_default`` for the manual's reference, and the defaults as
    ``args.config_defaults`` (what the manual's command checker builds the settings from; ``of_args``:
    a function of the parsed arguments giving them, where they depend on one, e.g. ``--data``)."""
    defaults, shown = defaults or Config(), shown or {}
    p.set_defaults(config_defaults=of_args or defaults)
    g = p.add_argument_group("training configuration (pilab.config.Config)")
    for f in fields(Config):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        rule = allowed(f.name) if f.name not in CHOICES else ""  # argparse lists the choices itself
        text = (f"{Config.help(f.name)} ({rule + '; ' if rule else ''}"
                f"default: {shown.get(f.name, repr(default))})").replace("%", "%%")
        if f.type == "bool":
            action = g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                    default=None, help=text)
        else:
            typ = {"int": int, "float": float, "str": str}[f.type]
            action = g.add_argument(flag, dest=f.name, type=typ, default=None,
                                    choices=CHOICES.get(f.name), metavar=f.name.upper(), help=text)
        action.pilab_default = shown.get(f.name, default)


def config_from_args(args: argparse.Namespace, defaults: Config | None = None) -> Config:
    """The Config the flags describe (flags not given keep ``defaults``); validated by Config."""
    values = (defaults or Config()).to_dict()
    for f in fields(Config):
        v = getattr(args, f.name, None)
        if v is not None:
            values[f.name] = v
    return Config(**values)


def add_batch_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """--launcher slurm and its flags (scale, remedies): ``what`` is what each job runs."""
    p.add_argument("--launcher", choices=("mpiexec", "slurm"), default="mpiexec",
                   help=f"how {what} runs: here (mpiexec; the default), or slurm: one sbatch job each "
                        "(<out>/<point>/job.sbatch), the queue shown while it waits")
    p.add_argument("--partition", default=None, help="--launcher slurm: the partition (sinfo lists them)")
    p.add_argument("--time", dest="time_limit", default=None,
                   help="--launcher slurm: each job's time limit as sbatch takes it (30, 01:30:00)")
    p.add_argument("--ranks-per-node", dest="batch_ranks_per_node", type=int, default=0, metavar="K",
                   help="--launcher slurm: ranks on each node (default: the partition's CPUs per node / "
                        "--threads); a job of np ranks asks for ceil(np / this) nodes")
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="--launcher slurm: one more #SBATCH line for every job, e.g. --sbatch=--account=proj")
    p.add_argument("--dry-run", action="store_true",
                   help="--launcher slurm: print each job's batch script; submit and write nothing")


def batch_options(args, cfg: Config, nps, *, resume: bool):
    """(pilab.study.batch.Options, cfg as the jobs run it) for --launcher slurm after Slurm's checks (a
    SlurmError, exit 2, before anything is written); (None, cfg) for mpiexec, where the Slurm-only flags
    are refused."""
    from dataclasses import replace

    from ..study import batch
    slurm_only = [f for f, v in (("--partition", args.partition), ("--time", args.time_limit),
                                 ("--dry-run", args.dry_run), ("--sbatch", args.sbatch),
                                 ("--ranks-per-node", args.batch_ranks_per_node)) if v]
    if args.launcher != "slurm":
        if slurm_only:
            raise UsageError(f"{slurm_only[0]} is for --launcher slurm; add it, or leave {slurm_only[0]} out")
        return None, cfg
    if not args.partition or not args.time_limit:
        raise UsageError("--launcher slurm needs --partition P and --time T (sinfo lists the partitions)")
    if not cfg.out:
        raise UsageError("--launcher slurm keeps the study's state in --out; give --out DIR")
    cfg = replace(cfg, threads=cfg.threads or 1)  # a job's rank has the CPUs it asked for
    opts = batch.Options(args.partition, args.time_limit, args.batch_ranks_per_node, tuple(args.sbatch))
    part = batch.check(opts, cfg, nps)
    batch.check_out(cfg.out, resume)
    return replace(opts, ranks_per_node=part["ranks_per_node"]), batch.job_config(cfg, opts)


def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
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


def batch_text(result: dict) -> str:
    """``global batch=64``, and where a batch ramp changed it, to what from which epoch (1-based)::

        batch_text(result)   # "global batch=16, ramped to 64 from epoch 2"
    """
    text = f"global batch={result['global_batch']}"
    plan = result.get("batch_plan") or []
    for before, p in zip(plan, plan[1:]):
        if p["per_rank_batch"] != before["per_rank_batch"]:
            text += f", ramped to {p['per_rank_batch'] * result['np']} from epoch {p['epoch']}"
    return text


def progress_callbacks(quiet: bool):
    """A tqdm bar over all steps and one line per epoch (rank 0 only: callbacks run there); straggler
    warnings (``pilab.trace.stragglers``) are printed with or without the bar."""
    if quiet:
        return [print_stragglers]
    from tqdm.auto import tqdm  # only when a bar is wanted: tqdm.auto probes for a notebook
    state = {}

    def cb(ev):
        kind = ev["kind"]
        if kind == "straggler":
            state["bar"].write(ev["line"], file=sys.stderr)
        elif kind == "start":
            print_stragglers(ev)
            done = ev.get("steps_done", ev["start_epoch"] * ev["steps_per_epoch"])
            state["bar"] = tqdm(total=ev["total_steps"], initial=done, unit="step",
                                desc=f"np={ev['np']}", dynamic_ncols=True, file=sys.stderr)
        elif kind == "step":
            bar = state["bar"]
            if ev.get("total_steps") and ev["total_steps"] != bar.total:  # a noise-driven ramp chose a batch
                bar.total = ev["total_steps"]
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


# A result or trace names the model builder it was trained with; pilab reads the model's FLOPs, activations,
# gradient layout and BatchNorm channels the run recorded, and builds the model (running its code) only
# where you name it on the command line (pilab.models.names.only_named).
TRUST_MODEL = ("your model builder (module:function or file.py:function) the run was trained with, to build "
               "it here, running its code: needed only for a run pilab recorded no model profile for (an "
               "older pilab); a builder the file names is never imported otherwise")


# ----------------------------------------------------------------------------------------------
# the output directory
# ----------------------------------------------------------------------------------------------
def _saved_config(out: str) -> tuple[dict | None, dict | None, str | None]:
    """(config, result) of the run in ``out``: from result.json, else from its checkpoint; the third
    value names what could not be read."""
    res_path = os.path.join(out, "result.json")
    if os.path.exists(res_path):
        try:
            res = resultfile.load(res_path)
            return res["config"], res, None
        except resultfile.OldFormError as e:
            raise UsageError(f"--out {out}: {e}") from None
        except (OSError, ValueError, KeyError, TypeError):
            return None, None, res_path
    ck = os.path.join(out, "checkpoint.pt")
    if os.path.exists(ck):
        from ..engine import checkpoint
        try:
            return checkpoint.read(ck)["config"], None, None
        except checkpoint.CheckpointError:
            return None, None, ck
    return None, None, None


def differences(mine: dict, theirs: dict, ignore: tuple) -> list[str]:
    return [f"{k}={theirs.get(k)!r} there, {mine[k]!r} now" for k in sorted(mine)
            if k not in ignore and theirs.get(k, mine[k]) != mine[k]]


def check_out_dir(cfg, *, overwrite: bool, command: str = "train") -> bool:
    """Refuse (UsageError) an ``--out`` that holds another run's results, unless ``overwrite``.

    The same settings again are a re-run and replace the old files (what re-running a README command
    does), except an unfinished run (a checkpoint and no complete result): that is continued with
    ``--resume``, or started over with ``--overwrite``. Resuming from a checkpoint in ``out`` is
    always allowed. Returns True when old run files are there to be cleared (``clear_out_dir``)."""
    out = cfg.out
    if not out or not os.path.isdir(out):
        return False
    from ..engine import checkpoint
    from ..engine import run_files
    if not run_files(out):
        return False
    if cfg.resume and os.path.dirname(os.path.abspath(cfg.resume)) == os.path.abspath(out):
        return False  # continuing the run that is there
    if overwrite:
        return True
    theirs, res, unreadable = _saved_config(out)
    if unreadable:
        raise UsageError(f"--out {out} holds {os.path.basename(unreadable)}, which pilab cannot read; "
                         "give another --out, or --overwrite to replace it")
    diff = differences(cfg.to_dict(), theirs, checkpoint.RESUMABLE)
    if diff:
        raise UsageError(f"--out {out} holds the results of another run ({'; '.join(diff[:3])}"
                         f"{'; …' if len(diff) > 3 else ''}); give another --out, or --overwrite to "
                         "replace them")
    ck = checkpoint.latest(out)
    unfinished = res is None or res.get("stopped_early") or \
        res.get("epochs_done", cfg.epochs) < res["config"].get("epochs", cfg.epochs)
    if ck and unfinished and not cfg.max_steps:
        done = f" ({res.get('epochs_done')} of {cfg.epochs} epochs done)" if res else ""
        raise UsageError(f"--out {out} holds an unfinished run of these settings{done}; continue it with "
                         f"`--resume {ck}`, or start over with --overwrite")
    return True


def clear_out_dir(out: str) -> None:
    """Remove the run files of an earlier run in ``out`` (``pilab.engine.records.RUN_FILES``: result.json,
    trace.json, checkpoints) before a new run writes there, so nothing of the old run is mistaken for the
    new one's."""
    from ..engine import run_files
    for p in run_files(out):
        with contextlib.suppress(FileNotFoundError):
            os.remove(p)


def mpi_or_error() -> None:
    """LaunchError with the way to get an MPI library, where mpi4py cannot load one."""
    from ..dist import MPI
    from ..launch import MPI_HINT, LaunchError
    if MPI is None:
        raise LaunchError(f"this command needs an MPI library and mpi4py cannot load one; install it "
                          f"with {MPI_HINT}")
