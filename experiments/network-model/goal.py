"""The performance model's network half against the testbed's shaped links, judged against this project's
goals (the tolerances are ours, not pilab's: ``pilab.perfmodel.check`` reports how far the model is, and this
script counts the points within them)::

    python experiments/network-model/goal.py benchmarks/results/bench_network-2026-12-02-1419.json
    python experiments/network-model/goal.py runs/bench/bench.json       # a fresh `pilab bench --sections network`
"""
from __future__ import annotations

import sys

from pilab.perfmodel import check as network_model
from pilab.files import load_json

# communication-bound multi-node points: the model's Allreduce time per step and epoch within 20%
NET_WITHIN = 0.20
# issue 23 item 4: one step on the wire, the step and its exposed exchange within 15% at every point
WIRE_WITHIN = 0.15


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python experiments/network-model/goal.py BENCH_NETWORK.json", file=sys.stderr)
        return 2
    try:
        data = load_json(args[0])
    except (OSError, ValueError) as e:
        print(f"goal.py: {args[0]}: {e}", file=sys.stderr)
        return 2
    print(network_model.report(data, within=NET_WITHIN, wire_within=WIRE_WITHIN))
    return 0


if __name__ == "__main__":
    sys.exit(main())
