"""``pilab compare DIR…``: several scaling studies side by side (e.g. one per learning-rate rule)."""
from __future__ import annotations

import os
import sys

from ..config import ConfigError


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="put several scaling studies side by side",
                       description="Read study.json from each directory and write compare.json, "
                                   "compare.html (and .png) with accuracy curves per np, titled by the "
                                   "settings that differ between the studies (a warning when more than "
                                   "one kind differs).")
    c.add_argument("studies", nargs="+", help="study directories (or study.json files)")
    c.add_argument("--labels", default="", help="comma-separated labels, one per study")
    c.add_argument("--out", required=True, help="output directory")
    c.set_defaults(func=run)


def run(args, argv) -> int:
    from .. import scaling
    from ..files import atomic_write_text, load_json, save_json
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else \
        [os.path.basename(os.path.normpath(d)) for d in args.studies]
    if len(labels) != len(args.studies):
        raise ConfigError(f"{len(labels)} labels for {len(args.studies)} studies; give one label each")
    studies = {}
    for label, d in zip(labels, args.studies):
        path = os.path.join(d, "study.json") if os.path.isdir(d) else d
        if not os.path.exists(path):
            raise ConfigError(f"{path} does not exist; run `python -m pilab scale --out {d}` first")
        studies[label] = load_json(path)
    cmp = scaling.compare(studies)
    if cmp["warning"]:
        print(f"pilab compare: warning: {cmp['warning']}", file=sys.stderr)
    save_json(cmp, os.path.join(args.out, "compare.json"))
    html_path = os.path.join(args.out, "compare.html")
    atomic_write_text(html_path, scaling.compare_html(cmp))
    scaling.export_png(html_path, os.path.join(args.out, "compare.png"))
    print(f"compared {scaling.compare_title(cmp)}")
    print(scaling.compare_markdown(cmp))
    print(f"report: {html_path}")
    return 0
