"""``pilab bench``: side-by-side benchmarks of pilab against what a user would pick instead.

    python -m pilab bench                  # the default set (<= 20 min on a 2-core machine), BENCHMARKS.md
    python -m pilab bench --quick          # CI-sized settings (~3 min); --markdown '' writes none
    python -m pilab bench --sections memory --before benchmarks/results/memory/before-05bde58-eval50.json
    sudo python -m pilab bench --sections network --quick   # the testbed section (needs root)
"""
from __future__ import annotations

import os

from .common import UsageError


def add_parser(sub) -> None:
    from ..bench.suite import EXTRA_SECTIONS, SECTIONS  # names only: pilab.bench.suite loads no torch at import
    p = sub.add_parser("bench", help="benchmarks: ratios against baselines measured in the same run",
                       description="One rank vs a bare PyTorch loop, images/s per model, the data path vs "
                                   "a DataLoader, decoding vs the cached reload, GradSync vs a raw Allreduce "
                                   "and the other ways to average gradients, np=2 vs DDP-gloo and the "
                                   "sync-only floor, memory, the simulator's fast mode; on request the "
                                   "performance model against real runs and on a testbed (root). Writes "
                                   "<out>/bench.json and a markdown table.")
    p.add_argument("--quick", action="store_true", help="tiny settings for CI (not the recorded figures)")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all of them), or "
                        f"{','.join(EXTRA_SECTIONS)}, only when named: the simulator's fast mode after 100 "
                        "steps at np=48 (~7 min); the performance model against held-out real runs (~4 min); "
                        "its network half on a testbed of shaped links it brings up and removes (root, "
                        "~15 min; skipped otherwise)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json (default: runs/bench)")
    p.add_argument("--markdown", default="BENCHMARKS.md",
                   help="markdown report to write (default: BENCHMARKS.md; '' for none)")
    p.add_argument("--mpiexec", default=None, help="launcher for the rank jobs (default: pilab.launch's)")
    p.add_argument("--goals", default=None, metavar="JSON",
                   help="the goals to judge figures against, a JSON of {key: [op, value]} (default: "
                        "benchmarks/goals.json where it exists, as in pilab's source repository; else none, and the "
                        "figures are shown unjudged)")
    p.add_argument("--before", default="",
                   help="memory section: comma-separated JSONs of earlier `python -m pilab.bench.memory` runs "
                        "(e.g. at an older commit), shown as a 'before' column beside the same settings")
    p.add_argument("--simulator-models", default="", metavar="MODEL:WIDTH,...",
                   help="simulator section: the models of its grid (b 4-64 x np 8, 48), e.g. "
                        "mobilenetv2_cifar:0.25,squeezenet1_1:1.0 (default: those two and mobilenetv2_cifar:1.0)")
    p.add_argument("--simulator-rounds", type=int, default=0,
                   help="simulator section: alternated rounds per cell (default 5, --quick 3)")
    p.set_defaults(func=run)


GOALS = os.path.join("benchmarks", "goals.json")  # pilab's source repository's goals, where run from there


def _goals(path: str | None) -> dict:
    """The goals file's {key: [op, value]}: ``--goals``, else benchmarks/goals.json where it exists."""
    import json
    if path is None:
        path = GOALS if os.path.isfile(GOALS) else ""
    if not path:
        return {}
    try:
        with open(path) as f:
            goals = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--goals {path}: {e}; give a JSON file of {{key: [op, value]}}") from None
    bad = [k for k, v in goals.items() if not (isinstance(v, list) and len(v) == 2 and v[0] in (">=", "<=", "<", ">")
                                               and isinstance(v[1], (int, float)))]
    if bad:
        raise UsageError(f"--goals {path}: {', '.join(bad)} must be [op, value] with op one of >=, <=, <, >")
    return goals


def _models(spec: str) -> list[tuple[str, float]] | None:
    """``--simulator-models``' "model:width,..." as [(model, width)]; None for the default grid."""
    from ..models.names import MODEL_NAMES
    out = []
    for item in [x for x in spec.split(",") if x]:
        name, _, width = item.partition(":")
        try:
            w = float(width)
        except ValueError:
            w = 0.0
        if name not in MODEL_NAMES or not w > 0:
            raise UsageError(f"--simulator-models {item}: give MODEL:WIDTH with MODEL one of {', '.join(MODEL_NAMES)} "
                             "and WIDTH > 0, e.g. mobilenetv2_cifar:0.25")
        out.append((name, w))
    return out or None


def run(args, argv) -> int:
    from ..bench import suite as bench
    sections = tuple(args.sections.split(",")) if args.sections else bench.SECTIONS
    known = bench.SECTIONS + bench.EXTRA_SECTIONS
    unknown = sorted(set(sections) - set(known))
    if unknown:
        raise UsageError(f"--sections {','.join(unknown)} unknown; choose from {','.join(known)}")
    command = "python -m pilab bench" + (" " + " ".join(argv) if argv else "")
    before = [x for x in args.before.split(",") if x]
    missing = [x for x in before if not os.path.isfile(x)]
    if missing:
        raise UsageError(f"--before {','.join(missing)}: no such file; give JSONs written by "
                         "`python -m pilab.bench.memory OUT.json ...`")
    if args.simulator_rounds < 0:
        raise UsageError(f"--simulator-rounds {args.simulator_rounds}: give a positive count (or 0 for the default)")
    res = bench.run(quick=args.quick, sections=sections, out=args.out, markdown=args.markdown or None,
                    mpiexec=args.mpiexec, command=command, before=before, goals=_goals(args.goals),
                    simulator_models=_models(args.simulator_models), simulator_rounds=args.simulator_rounds or None)
    print(f"bench: {res['wall_s']:.0f} s; {args.out}/bench.json" + (f", {args.markdown}" if args.markdown else ""))
    return 0
