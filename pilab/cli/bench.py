"""``pilab bench``: side-by-side benchmarks of pilab against what a user would pick instead.

    python -m pilab bench                  # the default set (<= 20 min on a 2-core machine): runs/bench/
    python -m pilab bench --quick          # CI-sized settings (~3 min)
    python -m pilab bench --sections memory --before benchmarks/results/memory/before-05bde58-eval50.json
    sudo python -m pilab bench --sections network --quick   # the testbed section (needs root)
    python -m pilab bench --from benchmarks/results --out .  # pilab's BENCHMARKS.md, from its committed runs

A run writes ``<out>/bench.json`` and ``<out>/BENCHMARKS.md`` and nothing else: it never touches the
BENCHMARKS.md of the tree it runs in. ``--from`` runs nothing: it puts the report together from saved runs.
"""
from __future__ import annotations

import os

from .common import UsageError, add_launch_arguments


def add_parser(sub) -> None:
    from ..bench import EXTRA_SECTIONS, SECTIONS  # names only: pilab.bench.suite loads no torch at import
    p = sub.add_parser("bench", help="benchmarks: ratios against baselines measured in the same run",
                       description="One rank vs a bare PyTorch loop, images/s per model, the data path vs "
                                   "a DataLoader, decoding vs the cached reload, GradSync vs a raw Allreduce "
                                   "and the other ways to average gradients, np=2 vs DDP-gloo and the "
                                   "sync-only floor, memory, the simulator's fast mode; on request the "
                                   "performance model against real runs and on a testbed (root). Writes "
                                   "<out>/bench.json and <out>/BENCHMARKS.md.")
    p.add_argument("--quick", action="store_true", help="tiny settings for CI (not the recorded figures)")
    p.add_argument("--sections", default=None,
                   help=f"comma-separated subset of {','.join(SECTIONS)} (default: all of them), or "
                        f"{','.join(EXTRA_SECTIONS)}, only when named: the simulator's fast mode after 100 "
                        "steps at np=48 (~7 min); the performance model against held-out real runs (~4 min); "
                        "its network half on a testbed of shaped links it brings up and removes (root, "
                        "~15 min; skipped otherwise); uneven shares against a throttled node on a testbed "
                        "(balance: root, ~15 min) and their final accuracy against equal shares "
                        "(balance_accuracy: the simulator, 3 seeds, ~40 min)")
    p.add_argument("--out", default="runs/bench",
                   help="directory for bench.json and BENCHMARKS.md (default: runs/bench); a run of some sections "
                        "replaces theirs in a BENCHMARKS.md already there and keeps the others")
    p.add_argument("--from", dest="from_runs", default="", metavar="DIR",
                   help="run nothing: write <out>/BENCHMARKS.md from the bench.json files under DIR, each section "
                        "from the newest run that has it (pilab's own: --from benchmarks/results --out .)")
    add_launch_arguments(p, what="the benchmarks' rank jobs (on this machine)", hostfile=False)
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
    from ..models import MODEL_NAMES
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
    if args.from_runs:
        return _from_runs(bench, args, argv)
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
    if not args.out:
        raise UsageError("--out '': give the directory for bench.json and BENCHMARKS.md (default: runs/bench)")
    markdown = os.path.join(args.out, "BENCHMARKS.md")
    res = bench.run(quick=args.quick, sections=sections, out=args.out, markdown=markdown,
                    mpiexec=args.mpiexec, command=command, before=before, goals=_goals(args.goals),
                    simulator_models=_models(args.simulator_models), simulator_rounds=args.simulator_rounds or None)
    print(f"bench: {res['wall_s']:.0f} s; {os.path.join(args.out, 'bench.json')}, {markdown}")
    return 0


def _from_runs(bench, args, argv) -> int:
    """``--from DIR``: BENCHMARKS.md from saved runs, nothing measured (the options of a run are refused)."""
    given = [o for o in ("--quick", "--sections", "--before", "--simulator-models", "--simulator-rounds", "--mpiexec",
                         "--goals") if any(a == o or a.startswith(o + "=") for a in argv)]
    if given:
        raise UsageError(f"{', '.join(given)} go with a run; --from {args.from_runs} runs nothing (it writes "
                         "BENCHMARKS.md from the runs saved there)")
    if not os.path.isdir(args.from_runs):
        raise UsageError(f"--from {args.from_runs}: no such directory; give one holding bench.json files")
    from ..bench import collected_report
    command = "python -m pilab bench " + " ".join(argv)
    text, used = collected_report(args.from_runs, command=command, sections=bench.SECTIONS)
    if not used:
        raise UsageError(f"--from {args.from_runs}: no bench.json of `pilab bench` there")
    from ..files import atomic_write_text
    os.makedirs(args.out or ".", exist_ok=True)
    path = os.path.join(args.out or ".", "BENCHMARKS.md")
    atomic_write_text(path, text)
    print(f"bench: {path} from {len(used)} run(s) under {args.from_runs}")
    return 0
