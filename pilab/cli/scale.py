"""``pilab scale``: the strong-scaling study (measured MPI runs + simulated sweep + report).

Interrupted (Ctrl-C, SIGTERM, a failed run), the study keeps its finished np points, writes study.json
with ``complete: false`` and ``missing``, and exits 130/143 (1 for a failed run); ``--resume`` with the
same command runs only the missing points. An ``--out`` holding another study is refused unless
``--overwrite``."""
from __future__ import annotations

import glob
import os
import sys
from dataclasses import replace

from ..config import ConfigError
from ..engine import exit_code_for, sigterm_as_interrupt
from .common import (UsageError, add_batch_arguments, add_config_arguments, add_int_list, add_launch_arguments,
                     batch_options, config_from_args, fit_nps)



def defaults(args=None):
    """The study's own defaults: the demo's, with its subsets on the embedded data only (config.demo)."""
    from ..config import demo
    return replace(demo(getattr(args, "data", None) or "embedded"), out="runs/scale")


# what --help and the reference say of the defaults that follow --data
SUBSETS_SHOWN = {"train_subset": "2000 on the embedded data; 0 (all) on any other --data",
                 "test_subset": "1000 on the embedded data; 0 (all) on any other --data"}
SIMULATED = [8, 48]  # the accuracy sweep's default, fitted to the data (fit_nps)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "scale", help="strong-scaling study: measured MPI runs + simulated accuracy sweep + report",
        description="Run the same training at several process counts (real mpiexec jobs), add a "
                    "simulated accuracy sweep at larger np (each row says its mode), and write study.json/.csv and a "
                    "self-contained report.html. Defaults are a ~6-minute demo on the embedded data.")
    add_int_list(p, "--nps", default=[1, 2], help="measured process counts ('' for none)")
    add_int_list(p, "--simulate-nps", default=None,
                 help="simulated process counts for the accuracy sweep ('' for none)",
                 shown="8,48, or those your data can hold: np=48 needs 48 batches of training images")
    p.add_argument("--baseline", type=int, default=0,
                   help="baseline np p0 for speedup/efficiency (default: smallest measured)")
    p.add_argument("--target-fraction", type=float, default=0.9,
                   help="target accuracy as a fraction of the baseline's final test accuracy")
    p.add_argument("--wrong-gap", type=float, default=0.10,
                   help="fast-but-wrong if this far below the baseline's final test accuracy")
    p.add_argument("--wrong-floor", type=float, default=0.20,
                   help="fast-but-wrong if final test accuracy is under this")
    p.add_argument("--preset", choices=("demo", "pi"), default="demo",
                   help="demo: this machine; pi: 2..48 ranks, baseline 2, 2 threads/rank")
    p.add_argument("--target", default="pi4b_cluster",
                   help="machine the speedup and time to target are for: pi4b_cluster (24 Raspberry Pi "
                        "4B x 2 ranks, predicted by the performance model; speed baseline one node = np 2), "
                        "another Pi preset (pi5_cluster, pi4b_1250_cluster) or a mixed Pi cluster "
                        "(BOARD:NODES,..., e.g. pi4b:12,pi5:12: its ranks wait for the slowest board), "
                        "this (this machine: measured, simulated points predicted here), or a calibration "
                        "/ cluster JSON (default: pi4b_cluster; this machine's times are shown beside it)")
    add_launch_arguments(p, what="the measured runs")
    add_batch_arguments(p, "each measured point")
    p.add_argument("--resume", dest="resume_study", action="store_true",
                   help="continue the interrupted study in --out: keep its finished np points, run only "
                        "the missing ones")
    p.add_argument("--reuse", default="",
                   help="comma-separated other study directories: take their finished points where "
                        "they are the same training (e.g. the np=1 point every LR rule shares)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace another study's results in --out (default: refuse)")
    add_config_arguments(p, defaults(), skip=("resume",), shown=SUBSETS_SHOWN, of_args=defaults)
    p.set_defaults(func=run)


def check_study_dir(cfg, *, overwrite: bool, resume: bool) -> None:
    """Refuse (UsageError) an ``--out`` holding another study (other settings) unless ``overwrite``,
    and an unfinished study of these settings unless ``resume`` (or ``overwrite``)."""
    import json

    from ..engine import RESUMABLE
    from .common import differences
    out = cfg.out
    path = os.path.join(out, "study.json") if out else ""
    points = sorted(glob.glob(os.path.join(glob.escape(out), "np*", "result.json"))) if out else []
    if overwrite or not (os.path.exists(path) or points):
        return
    try:
        with open(path if os.path.exists(path) else points[0]) as f:
            old = json.load(f)
        theirs = old["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"--out {out} holds a study pilab cannot read; give another --out, or "
                         "--overwrite to replace it") from None
    diff = differences(cfg.to_dict(), theirs, RESUMABLE)
    if diff:
        raise UsageError(f"--out {out} holds another study ({'; '.join(diff[:3])}); give another --out, "
                         "or --overwrite to replace it")
    unfinished = not os.path.exists(path) or old.get("complete") is False
    if unfinished and not resume:
        missing = f" (np {old['missing']} missing)" if old.get("missing") else ""
        raise UsageError(f"--out {out} holds an unfinished study of these settings{missing}; the same "
                         "command with --resume runs only the missing points, --overwrite starts over")


def _progress(ev) -> None:
    """One line per finished point; the other events feed a notebook's bar."""
    from ..study import analysis
    if ev.get("kind") != "run":
        return
    r = ev["result"]
    acc = analysis.final_value(r, "test_acc")
    took = (f"reused from {r['reused_from']}" if r.get("reused_from") else "kept from the earlier run") \
        if ev.get("kept") else f"{r['wall_time']:.0f}s"
    print(f"  np={ev['np']:<3} {'simulated' if ev['simulated'] else 'measured '} "
          f"global batch {r['global_batch']:<5} final test acc {acc:.3f}  ({took})", file=sys.stderr, flush=True)


def _batch_progress(ev) -> None:
    """As :func:`_progress`, a measured point showing its job's training time (it ran now, as a job)."""
    _progress({**ev, "kept": False} if ev.get("kind") == "run" and not ev["simulated"] else ev)


def _batch_options(args, cfg, nps):
    """(batch.Options, the jobs' cfg) for --launcher slurm after Slurm's checks; (None, cfg) for mpiexec."""
    if args.launcher == "slurm" and args.hostfile:
        raise UsageError("--hostfile is for --launcher mpiexec; Slurm places a batch point's ranks itself")
    if args.hostfile:  # every host a plain name or address, before anything is written (launch.hosts)
        from ..launch.hosts import HostsError, read_hostfile
        try:
            read_hostfile(args.hostfile)
        except HostsError as e:
            raise UsageError(str(e)) from None
    if args.launcher == "slurm" and not nps:
        raise UsageError("--launcher slurm submits the measured points, and --nps is empty; give --nps")
    return batch_options(args, cfg, nps, resume=args.resume_study)


def _run_batch(cfg, args, opts, nps, sims, criteria, argv) -> int:
    """--launcher slurm: the measured points as batch jobs, then the simulated points and the study here."""
    import time

    from ..study import batch, report, tables
    from ..study import Interrupted, partial_study, study
    out = cfg.out
    if not out:
        raise UsageError("--launcher slurm keeps the study's state in --out; give --out DIR")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.dry_run:
        batch.dry_run(batch.scale_points(cfg, nps, out, opts, opts.ranks_per_node), out,
                      resume=args.resume_study, log=log)
        if sims:
            log(f"then simulated np {sims} here, and the study in {out}")
        return 0
    log(f"pilab scale: measured np {nps} as Slurm jobs (partition {opts.partition}, --time {opts.time}, "
        f"{opts.ranks_per_node} rank(s) per node), simulated np {sims} here; writing {out}")
    command = ("python -m pilab scale " + " ".join(argv)).strip()
    t0 = time.time()
    try:
        with sigterm_as_interrupt():
            done, failed = batch.run_points(batch.scale_points(cfg, nps, out, opts, opts.ranks_per_node), out,
                                            opts, resume=args.resume_study, log=log)
        runs = {int(i): r for i, r in sorted(done.items(), key=lambda kv: int(kv[0]))}
    except batch.Stopped as e:
        what = ", ".join(f"job {j} ({name})" for name, j in e.cancelled) or "no job (none was queued)"
        log(f"pilab: scale interrupted; cancelled {what}; the same command with --resume submits "
            "the unfinished points again and keeps the finished ones")
        cause = e.cause
        return exit_code_for(15 if cause.args and cause.args[0] == "SIGTERM" else 2)
    if failed:
        for f in failed:
            log(f"pilab: {f['name']}: job {f['job']} ended {f['state']}; the end of its log:\n{f['log']}")
        partial = partial_study(cfg, criteria, nps, sims, runs, sorted(runs), t0, command,
                                 RuntimeError(f"{len(failed)} point(s) failed"))
        partial["slurm_failed"] = [{"np": int(f["id"]), "job": f["job"], "state": f["state"]} for f in failed]
        report.write_partial(partial, out)
        log(f"pilab: scale finished np {sorted(runs)}; failed "
            + ", ".join(f"{f['name']} (job {f['job']} {f['state']})" for f in failed)
            + "; the same command with --resume submits only those again")
        return 1
    try:
        with sigterm_as_interrupt():
            res = study(cfg, nps, simulate_nps=sims, criteria=criteria, out=out, callbacks=[_batch_progress],
                        command=command, target=args.target, resume=True,
                        reuse=[d for d in args.reuse.split(",") if d])
    except Interrupted as e:
        log(f"pilab: scale {e.study['stopped']}; missing np {e.study['missing']}; the same command with "
            "--resume runs only those")
        return 1 if not isinstance(e.cause, KeyboardInterrupt) else exit_code_for(2)
    print(tables.table(res))
    print(f"report: {os.path.join(out, 'report.html')}")
    return 0


def run(args, argv) -> int:
    from ..perfmodel import PI_BASELINE_NP, PI_STUDY_NPS, PI_THREADS_PER_RANK
    cfg = config_from_args(args, defaults(args))
    nps, baseline = list(args.nps), args.baseline
    sims = list(SIMULATED if args.simulate_nps is None else args.simulate_nps)
    if args.preset == "pi":
        if args.nps == [1, 2]:  # the Pi cluster preset: 2..48 ranks (2 per node), baseline one node
            nps = list(PI_STUDY_NPS)
        baseline = baseline or PI_BASELINE_NP
        if cfg.threads == 0:
            cfg = replace(cfg, threads=PI_THREADS_PER_RANK)
    if any(p < 1 for p in nps + sims):
        raise ConfigError("process counts must be >= 1")
    batch_opts, cfg = _batch_options(args, cfg, nps)  # Slurm's refusals, before anything is written
    from ..study import analysis, tables  # these load torch (seconds): after the quick refusals
    from ..study import Interrupted, study
    from .. import data
    # the count alone (the cache's labels): every point loads the images itself
    n_train = data.train_size(cfg.data, train_subset=cfg.train_subset, test_subset=cfg.test_subset,
                              seed=cfg.seed, image_size=cfg.image_size)
    if args.simulate_nps is None:  # the default sweep, fitted to the data: your own may be small
        sims = fit_nps(cfg, sims, n_train, flag="--simulate-nps", command="scale")
    for p in nps + sims:
        cfg.check_world(p, n_train)
    from ..engine import ownmodel as preflight
    preflight.check_model(cfg, mpi=bool(nps))  # your own model on your data, before any point runs
    criteria = analysis.Criteria(baseline_np=baseline, target_fraction=args.target_fraction,
                                 wrong_gap=args.wrong_gap, wrong_floor=args.wrong_floor)
    if baseline and baseline not in nps:
        raise ConfigError(f"--baseline {baseline} is not among --nps {','.join(map(str, nps))}; add it")
    check_study_dir(cfg, overwrite=args.overwrite, resume=args.resume_study)
    for d in (d for d in args.reuse.split(",") if d):
        if not glob.glob(os.path.join(glob.escape(d), "np*", "result.json")):
            raise UsageError(f"--reuse {d}: no finished study points (np*/result.json) there; "
                             "give a study's --out directory")
    if nps:
        from .common import mpi_or_error
        mpi_or_error()
    if batch_opts is not None:
        return _run_batch(cfg, args, batch_opts, nps, sims, criteria, argv)
    print(f"pilab scale: measured np {nps}, simulated np {sims}, writing {cfg.out}", file=sys.stderr)

    command = "python -m pilab scale " + " ".join(argv)
    analysis.target_name(args.target)  # a bad --target is refused before any run
    try:
        with sigterm_as_interrupt():
            res = study(cfg, nps, simulate_nps=sims, criteria=criteria, out=cfg.out,
                        mpiexec=args.mpiexec, hostfile=args.hostfile, callbacks=[_progress],
                        command=command.strip(), target=args.target, resume=args.resume_study,
                        reuse=[d for d in args.reuse.split(",") if d])
    except Interrupted as e:
        st, cause = e.study, e.cause
        kept = sorted(int(p) for p in st["runs"])
        where = f"; kept np {kept} in {cfg.out}" if cfg.out and kept else ""
        print(f"pilab: scale {st['stopped']}{where}; missing np {st['missing']}"
              + ("; the same command with --resume runs only those" if cfg.out else ""), file=sys.stderr)
        if isinstance(cause, KeyboardInterrupt):
            return exit_code_for(15 if cause.args and cause.args[0] == "SIGTERM" else 2)
        return 1
    print(tables.table(res))
    print(f"report: {os.path.join(cfg.out, 'report.html')}")
    return 0
