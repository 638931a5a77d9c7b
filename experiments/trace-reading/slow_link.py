"""A slow-link trace on the testbed, read by `pilab trace`: N nodes x 1 rank, the last node's link
shaped to RATE (the others at 1 Gbit/s), a short traced run, then the straggler table.

    sudo flock /run/pilab-testbed.lock python experiments/trace-reading/slow_link.py --nodes 4 \
        --rate 10mbit --out runs/slow-link          # then: python -m pilab trace runs/slow-link

Needs root (network namespaces, tc) and `train --trace`. Brings its own testbed up (name "trr",
10.91.0.0/24) and always takes it down.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pilab import testbed
from pilab.launch import find_mpiexec

NAME, SUBNET = "trr", "10.91.0.0/24"
RUN = ["--width", "0.25", "--train-subset", "640", "--test-subset", "60", "--batch-size", "16", "--threads", "1",
       "--quiet", "--epochs", "1", "--bucket-mb", "0.25", "--trace", "--straggler-threshold", "0"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rate", default="10mbit", help="the last node's link rate (tc), e.g. 100mbit")
    ap.add_argument("--out", default="runs/slow-link")
    args = ap.parse_args()
    testbed.down(NAME)  # whatever an interrupted run left
    tb = testbed.up(testbed.Testbed(nodes=args.nodes, slots=1, rate="1gbit", subnet=SUBNET, name=NAME))
    try:
        nodes = [f"node{i + 1:02d}" for i in range(args.nodes)]
        testbed.shape(tb, nodes[-1], args.rate)
        hosts = ",".join(f"{tb.address(h)}:1" for h in nodes)
        env = tb.env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        p = subprocess.run([find_mpiexec(), *tb.mpiexec_args(), "-hosts", hosts, "-n", str(args.nodes),
                            sys.executable, "-m", "pilab", "train", *RUN, "--out", args.out], env=env, timeout=600)
    finally:
        testbed.down(NAME)
    if p.returncode:
        return p.returncode
    return subprocess.run([sys.executable, "-m", "pilab", "trace", args.out, "--top", "10"]).returncode


if __name__ == "__main__":
    sys.exit(main())
