"""``pilab compare DIR…``: several scaling studies side by side (e.g. one per learning-rate rule), and with
``--paper`` beside the published Pi-cluster figures (``pilab.study.compare``)."""
from __future__ import annotations

import os
import sys

from ..config import ConfigError
from .common import TRUST_MODEL


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="put several scaling studies side by side",
                       description="Read study.json from each directory (or, where `pilab scale` has not "
                                   "written one yet, its finished np*/result.json points) and write "
                                   "compare.json, compare.html (and .png) with accuracy curves per np, titled "
                                   "by the settings that differ between the studies (a warning when more "
                                   "than one kind differs). --paper adds the published speedups, the "
                                   "predicted Pi speedups and a paragraph on what reproduces.")
    c.add_argument("studies", nargs="+", help="study directories (or study.json files)")
    c.add_argument("--labels", default="", help="comma-separated labels, one per study")
    c.add_argument("--paper", action="store_true",
                   help="set the studies beside the published figures (np 1, 2, 4 ... 48; points not "
                        "finished are pending); the first study's settings are the ones predicted")
    c.add_argument("--out", required=True, help="output directory")
    c.add_argument("--model", default=None, metavar="BUILDER", help=TRUST_MODEL)
    c.set_defaults(func=run)


def run(args, argv) -> int:
    from ..study import compare, report
    from ..study import load_study
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else \
        [os.path.basename(os.path.normpath(d)) for d in args.studies]
    if len(labels) != len(args.studies):
        raise ConfigError(f"{len(labels)} labels for {len(args.studies)} studies; give one label each")
    planned = ()
    if args.paper:
        from ..study import compare as paper
        planned = paper.PAPER_NPS
    studies = {label: load_study(d, planned=planned) for label, d in zip(labels, args.studies)}
    cmp = compare.compare(studies)
    if cmp["warning"]:
        print(f"pilab compare: warning: {cmp['warning']}", file=sys.stderr)
    side = None
    if args.paper:
        side = paper.beside_paper(studies)
        cmp["paper"] = side
        cmp["pending"] = side["pending"]
    paths = report.write_compare(cmp, args.out, side)
    print(f"compared {compare.compare_title(cmp)}")
    if args.paper:
        print(paper.markdown(side))
        print()
        print(side["verdict"])
        print()
        print(paper.points_markdown(side))
        print()
    print(report.compare_markdown(cmp))
    print(f"report: {paths['html']}")
    return 0
