"""``pilab scale``: the strong-scaling study (measured MPI runs + simulated sweep + report)."""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from ..config import ConfigError
from .common import add_config_arguments, config_from_args, ints



def _defaults():
    from ..scaling import DEMO  # the study's own defaults; imported when the parser is built
    return replace(DEMO, out="runs/scale")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "scale", help="strong-scaling study: measured MPI runs + simulated accuracy sweep + report",
        description="Run the same training at several process counts (real mpiexec jobs), add an "
                    "exact simulated accuracy sweep at larger np, and write study.json/.csv and a "
                    "self-contained report.html. Defaults are a ~6-minute demo on the embedded data.")
    p.add_argument("--nps", default="1,2", help="measured process counts (default: 1,2)")
    p.add_argument("--simulate-nps", default="8,48",
                   help="simulated process counts for the accuracy sweep ('' for none; default: 8,48)")
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
    p.add_argument("--hostfile", default=None, help="MPI hostfile for the measured runs (Pi cluster)")
    p.add_argument("--mpiexec", default=None, help="launcher (default: next to this Python, then PATH)")
    add_config_arguments(p, _defaults())
    p.set_defaults(func=run)


def run(args, argv) -> int:
    from .. import scaling
    from ..engine import load_data
    from ..perfmodel import PI_BASELINE_NP, PI_STUDY_NPS, PI_THREADS_PER_RANK
    cfg = config_from_args(args, _defaults())
    nps, sims, baseline = ints(args.nps), ints(args.simulate_nps), args.baseline
    if args.preset == "pi":
        if args.nps == "1,2":  # the Pi cluster preset: 2..48 ranks (2 per node), baseline one node
            nps = list(PI_STUDY_NPS)
        baseline = baseline or PI_BASELINE_NP
        if cfg.threads == 0:
            cfg = replace(cfg, threads=PI_THREADS_PER_RANK)
    if any(p < 1 for p in nps + sims):
        raise ConfigError("process counts must be >= 1")
    ds = load_data(cfg)
    for p in nps + sims:
        cfg.check_world(p, len(ds.y_train))
    criteria = scaling.Criteria(baseline_np=baseline, target_fraction=args.target_fraction,
                                wrong_gap=args.wrong_gap, wrong_floor=args.wrong_floor)
    if baseline and baseline not in nps:
        raise ConfigError(f"--baseline {baseline} is not among --nps {args.nps}; add it")
    print(f"pilab scale: measured np {nps}, simulated np {sims}, writing {cfg.out}", file=sys.stderr)

    def progress(ev):
        r = ev["result"]
        acc = scaling.final_value(r, "test_acc")
        print(f"  np={ev['np']:<3} {'simulated' if ev['simulated'] else 'measured '} "
              f"global batch {r['global_batch']:<5} final test acc {acc:.3f}  "
              f"({r['wall_time']:.0f}s)", file=sys.stderr, flush=True)

    command = "python -m pilab scale " + " ".join(argv)
    res = scaling.study(cfg, nps, simulate_nps=sims, criteria=criteria, out=cfg.out, mpiexec=args.mpiexec,
                        hostfile=args.hostfile, callbacks=[progress], command=command.strip())
    print(scaling.table(res))
    print(f"report: {os.path.join(cfg.out, 'report.html')}")
    return 0
