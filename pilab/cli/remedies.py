"""``pilab remedies --np N``: which settings stay accurate at N ranks, and what they cost in time.

Each candidate's run is kept in ``--out``/<candidate>/result.json as it finishes; ``--resume`` keeps the
finished ones, so candidates can run as separate processes (``--only``) and one last ``--resume`` puts
the search together: remedies.json, report.html and report.png (the Pareto front)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import replace

from .common import (UsageError, add_batch_arguments, add_config_arguments, add_launch_arguments, batch_options,
                     config_from_args, fit_nps)


def defaults(args=None):
    """The demo's settings, with its subsets on the embedded data only (config.demo)."""
    from ..config import demo
    return replace(demo(getattr(args, "data", None) or "embedded"), out="runs/remedies")


DEFAULT_NP = 48  # the Pi cluster's ranks; fitted to the data where it holds fewer (fit_nps)


def add_parser(sub) -> None:
    p = sub.add_parser("remedies", help="search settings that stay accurate at large np (simulated)",
                       description="Simulate the baseline and candidate remedies at --np ranks and "
                                   "print accuracy, predicted time and the Pareto front.")
    p.add_argument("--np", type=int, default=None,
                   help=f"process count to find remedies for (default: {DEFAULT_NP}, or the most your data can "
                        "hold: a batch for each rank)")
    p.add_argument("--candidates", default="default", metavar="SET|FILE",
                   help="the candidates: default (pilab's, listed below), toolbox (those, then local SGD, the few-step "
                        "recipe, SyncBatchNorm and the other BatchNorm variants at small global batches, batch-size "
                        "ramps), or a Python file whose candidates(cfg, np_) gives them (a study's own list)")
    p.add_argument("--only", default="", help="comma-separated candidates to run, each by its label or its folder "
                                              "name (sqrt-lr-warmup); default: all (the labels at these settings "
                                              "are listed below)")
    p.add_argument("--recipes-of", type=int, default=None, metavar="NP",
                   help="run the candidates as they are at NP ranks (their global batch, their labels) at --np: "
                        "--np 1 --recipes-of 48 is np=48's recipes on one process, the same-recipe comparison")
    p.add_argument("--reference-acc", type=float, default=None,
                   help="accuracy to aim at (default: the baseline simulated at np=1)")
    p.add_argument("--target", default="pi4b_cluster",
                   help="machine the times are predicted for: pi4b_cluster (the default, as for scale), "
                        "another Pi preset (pi5_cluster, pi4b_1250_cluster) or a mixed Pi cluster "
                        "(BOARD:NODES,..., e.g. pi4b:12,pi5:12), this (calibrated here from the np=1 reference run and a short MPI "
                        "micro-benchmark), a calibration or cluster JSON file, or none")
    add_launch_arguments(p, what="the micro-benchmark of --target this (on this machine)", hostfile=False)
    p.add_argument("--resume", dest="resume_search", action="store_true",
                   help="keep the candidates already finished in --out (same training), run the others")
    p.add_argument("--reuse", default="",
                   help="comma-separated study directories (pilab scale --out) whose np point is a "
                        "candidate's training: taken instead of run again")
    add_batch_arguments(p, "each candidate (and the np=1 reference)")
    from .scale import SUBSETS_SHOWN
    add_config_arguments(p, defaults(), skip=("resume",), shown=SUBSETS_SHOWN, of_args=defaults)
    p.set_defaults(precheck=check)
    p.set_defaults(func=run)
    # The candidate labels depend on the settings and np: worked out only when this command's help is
    # printed, so building the parsers (`pilab --help`) does not run the remedies module.
    plain_help = p.format_help

    def format_help():
        if p.epilog is None:
            from ..study import candidate_labels, slug
            p.epilog = ("the default candidates (--only), at the default settings and --np 48, by label and folder "
                        "name; they follow --np and the settings (the batch sizes and epochs in them); "
                        "--candidates toolbox adds its own:\n  "
                        + "\n  ".join(f"{label}  ({slug(label)})" for label in candidate_labels(defaults(), 48)))
            p.formatter_class = argparse.RawDescriptionHelpFormatter  # one label a line
        return plain_help()
    p.format_help = format_help


def command_line(argv: list[str]) -> str:
    """The command as recorded in remedies.json: shell-quoted, so it pastes back as the same arguments
    (``--only "sqrt lr + warmup"``)."""
    return shlex.join(["python", "-m", "pilab", "remedies", *argv])


def _as_jobs(cfg, args, opts, cands, only, target, log):
    """--launcher slurm: each candidate's simulated run (and the np=1 reference, where the search needs
    it) as a batch job. Returns (None, the results the search is given: the reference) when every job
    finished, else (the exit code, []): 0 after --dry-run, 1 where a job failed, 130/143 interrupted."""
    from ..engine import exit_code_for, sigterm_as_interrupt
    from ..study import batch, remedies
    if args.reuse:
        raise UsageError("--reuse is for --launcher mpiexec; a batch search runs every candidate as a job")
    points = batch.remedies_points(cfg, args.np, cands, only, args.recipes_of, opts,
                                   reference=args.reference_acc is None or target == "this")
    if args.dry_run:
        batch.dry_run(points, cfg.out, resume=args.resume_search, log=log)
        return 0, []
    log(f"pilab remedies: {len(points)} job(s) at np={args.np} (partition {opts.partition}, --time {opts.time}); "
        f"writing {cfg.out}")
    try:
        with sigterm_as_interrupt():
            done, failed = batch.run_points(points, cfg.out, opts, resume=args.resume_search, log=log)
    except batch.Stopped as e:
        what = ", ".join(f"job {j} ({name})" for name, j in e.cancelled) or "no job (none was queued)"
        log(f"pilab: remedies interrupted; cancelled {what}; the same command with --resume submits the "
            "unfinished ones again and keeps the finished ones")
        return exit_code_for(15 if e.cause.args and e.cause.args[0] == "SIGTERM" else 2), []
    for f in failed:
        log(f"pilab: {f['name']}: job {f['job']} ended {f['state']}; the end of its log:\n{f['log']}")
    if failed:
        log("pilab: remedies failed " + ", ".join(f"{f['name']} (job {f['job']} {f['state']})" for f in failed)
            + "; the same command with --resume submits only those again")
        return 1, []
    return None, [done["reference"]] if "reference" in done else []


def check(args, np_: int | None = None) -> None:
    """What can be refused before anything runs, and without the data: --only's candidates at these settings
    (the manual's command checker asks it too)."""
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if only:
        from ..study import remedies
        at = args.recipes_of or np_ or args.np or DEFAULT_NP
        cands = remedies.load_candidates(args.candidates or "default")
        remedies.chosen(cands(config_from_args(args, defaults(args)), at), only, at)


def run(args, argv) -> int:
    from ..study import remedies, report, tables
    from ..config import ConfigError
    from ..files import save_json
    cfg = config_from_args(args, defaults(args))
    if args.np is None:  # the default, fitted to the data: your own may hold fewer than 48 ranks' batches
        from .. import data
        n_train = data.train_size(cfg.data, train_subset=cfg.train_subset, test_subset=cfg.test_subset,
                                  seed=cfg.seed, image_size=cfg.image_size)
        args.np = (fit_nps(cfg, [DEFAULT_NP], n_train, flag="--np", command="remedies") or [1])[-1]
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    if args.recipes_of is not None and args.recipes_of < 1:
        raise ConfigError(f"--recipes-of {args.recipes_of} must be >= 1 (the np whose candidates to run)")
    check(args)
    target = None if args.target == "none" else args.target
    from ..perfmodel import is_board_spec, is_pi_cluster, resolve_cluster
    if is_board_spec(target):
        resolve_cluster(target)  # a mixed cluster's boards: ConfigError naming what is wrong
    elif target not in (None, "this") and not is_pi_cluster(target) and not os.path.isfile(target):
        raise ConfigError(f"--target {target!r} is neither this, a Pi preset (pi4b_cluster, pi5_cluster, "
                          "pi4b_1250_cluster), a mixed Pi cluster (e.g. pi4b:12,pi5:12), none nor a JSON file")
    only = [s.strip() for s in args.only.split(",") if s.strip()] or None
    reuse = [d for d in args.reuse.split(",") if d]
    for d in reuse:
        if not os.path.isdir(d):
            raise ConfigError(f"--reuse {d}: no such study directory; give a pilab scale --out directory")
    opts, cfg = batch_options(args, cfg, [1], resume=args.resume_search)  # one process a job (simulated)
    from ..engine import ownmodel as preflight
    preflight.check_model(cfg, mpi=True)  # your own model on your data, before any candidate runs
    cands = remedies.load_candidates(args.candidates or "default")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    known = []
    if opts is not None:
        code, known = _as_jobs(cfg, args, opts, cands, only, target, log)
        if code is not None:
            return code
    res = remedies.search(cfg, args.np, candidates=cands, only=only, recipes_of=args.recipes_of,
                          reference_acc=args.reference_acc, calibration=target,
                          mpiexec=args.mpiexec, log=log, out=cfg.out or None,
                          resume=args.resume_search or opts is not None, reuse=reuse, known=known)
    res["command"] = command_line(argv)
    print(tables.remedies_table(res))
    if cfg.out:
        save_json(res, os.path.join(cfg.out, "remedies.json"))
        paths = report.write_remedies(res, cfg.out)
        print(f"result: {os.path.join(cfg.out, 'remedies.json')}"
              + (f", {paths['png']}" if paths.get("png") else ""))
    return 0
