"""The network section's "one step on the wire" points alone, at chosen link rates (root; the section's
testbed, ``plbench``, brought up and always taken down)::

    sudo python scripts/wire_points.py 1gbit             # 2 nodes x 1 rank and 4 nodes x 2 ranks, ~10 min
    sudo python scripts/wire_points.py 1gbit --quick     # CI-sized settings

Prints the rows of BENCHMARKS.md's wire table (``network_model.wire_table``) for those rates and writes
the measurements to ``--out`` (JSON), for re-running a point after a change to GradSync without the whole
section (``python -m pilab bench --sections network``, ~15 min more).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pilab import testbed  # noqa: E402
from pilab.bench import network as net  # noqa: E402
from pilab.perfmodel import check as nm  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rates", nargs="+", help="link rates, e.g. 1gbit 200mbit")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/wire_points.json")
    a = p.parse_args(argv)
    why = testbed.available()
    if why:
        print(f"wire_points: {why}", file=sys.stderr)
        return 2
    data = {"bench": [], "rates": [], "wire": []}
    testbed.down(net.NAME)
    tb = testbed.up(testbed.Testbed(nodes=4, slots=2, rate=a.rates[0], subnet=net.SUBNET, name=net.NAME))
    try:
        for rate in a.rates:
            tb = net.shaped(tb, rate)
            run = net.bench(tb, 2, 2, print)  # the link rate of the bound
            run["rate"] = rate
            data["bench"].append(run)
            for np_, nodes in net.WIRE_LAYOUTS:
                data["wire"].append(net.wire(tb, np_, nodes, rate, print, quick=a.quick))
    finally:
        testbed.down(net.NAME)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1, default=float)
    print(nm.wire_table(nm.wire_rows(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
