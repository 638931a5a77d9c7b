"""``pilab remedies --np N``: which settings stay accurate at N ranks, and what they cost in time."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from .common import add_config_arguments, config_from_args


def _defaults():
    from ..scaling import DEMO
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
    add_config_arguments(p, _defaults())
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
    res = remedies.search(cfg, args.np, only=only, reference_acc=args.reference_acc, calibration=target,
                          mpiexec=args.mpiexec, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(remedies.table(res))
    if cfg.out:
        save_json(res, os.path.join(cfg.out, "remedies.json"))
        print(f"result: {os.path.join(cfg.out, 'remedies.json')}")
    return 0
