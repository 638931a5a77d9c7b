"""``pilab remedies --np N``: which settings stay accurate at N ranks, and what they cost in time.

Each candidate's run is kept in ``--out``/<candidate>/result.json as it finishes; ``--resume`` keeps the
finished ones, so candidates can run as separate processes (``--only``) and one last ``--resume`` puts
the search together: remedies.json, report.html and report.png (the Pareto front)."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from .common import add_config_arguments, config_from_args


def _defaults():
    from ..config import DEMO
    return replace(DEMO, out="runs/remedies")


def add_parser(sub) -> None:
    p = sub.add_parser("remedies", help="search settings that stay accurate at large np (simulated)",
                       description="Simulate the baseline and candidate remedies at --np ranks and "
                                   "print accuracy, predicted time and the Pareto front.")
    p.add_argument("--np", type=int, default=48, help="process count to find remedies for (default 48)")
    p.add_argument("--only", default="", help="comma-separated candidate labels to run (default: all)")
    p.add_argument("--reference-acc", type=float, default=None,
                   help="accuracy to aim at (default: the baseline simulated at np=1)")
    p.add_argument("--target", default="this",
                   help="machine the times are predicted for: this (calibrated here from the np=1 "
                        "reference run and a short MPI micro-benchmark), pi4b_cluster, a calibration "
                        "or cluster JSON file, or none (default: this)")
    p.add_argument("--mpiexec", default=None, help="launcher for the micro-benchmark")
    p.add_argument("--resume", dest="resume_search", action="store_true",
                   help="keep the candidates already finished in --out (same training), run the others")
    p.add_argument("--reuse", default="",
                   help="comma-separated study directories (pilab scale --out) whose np point is a "
                        "candidate's training: taken instead of run again")
    add_config_arguments(p, _defaults(), skip=("resume",))
    p.set_defaults(func=run)


def run(args, argv) -> int:
    from .. import remedies
    from ..config import ConfigError
    from ..files import save_json
    cfg = config_from_args(args, _defaults())
    if args.np < 1:
        raise ConfigError(f"--np {args.np} must be >= 1")
    target = None if args.target == "none" else args.target
    if target not in (None, "this", "pi4b_cluster") and not os.path.isfile(target):
        raise ConfigError(f"--target {target!r} is neither this, pi4b_cluster, none nor a JSON file")
    only = [s.strip() for s in args.only.split(",") if s.strip()] or None
    reuse = [d for d in args.reuse.split(",") if d]
    for d in reuse:
        if not os.path.isdir(d):
            raise ConfigError(f"--reuse {d}: no such study directory; give a pilab scale --out directory")
    res = remedies.search(cfg, args.np, only=only, reference_acc=args.reference_acc, calibration=target,
                          mpiexec=args.mpiexec, log=lambda s: print(s, file=sys.stderr, flush=True),
                          out=cfg.out or None, resume=args.resume_search, reuse=reuse)
    res["command"] = "python -m pilab remedies " + " ".join(argv)
    print(remedies.table(res))
    if cfg.out:
        save_json(res, os.path.join(cfg.out, "remedies.json"))
        paths = remedies.write_report(res, cfg.out)
        print(f"result: {os.path.join(cfg.out, 'remedies.json')}"
              + (f", {paths['png']}" if paths.get("png") else ""))
    return 0
