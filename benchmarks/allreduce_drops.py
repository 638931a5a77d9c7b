"""Which Allreduce MPICH runs over 4 testbed nodes, and what the nodes' queues drop while it runs.

    sudo python benchmarks/allreduce_drops.py --out benchmarks/results/allreduce_drops.json   # ~5 min

A 4-node testbed (one rank each, links shaped to ``--rate``), MPICH's Allreduce algorithm forced with
``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` (auto, ring, reduce-scatter + allgather, recursive doubling),
alternated round by round; per job the mean seconds of 1 and 4 MiB Allreduces (pilab's comm benchmark)
and the packets the nodes' ``tbf`` queues dropped during it (``tc -s qdisc``). docs/perfmodel.md reads it:
the model's schedule against the testbed's queue. Brings up and always removes its own testbed.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess

from pilab import testbed
from pilab.bench import network
from pilab.perfmodel.calibrate import run_comm_bench

NAME, SUBNET = "pldrops", "10.87.0.0/24"
ALGORITHMS = ("auto", "ring", "reduce_scatter_allgather", "recursive_doubling")
SIZES = (1 << 20, 1 << 22)


def dropped(tb) -> int:
    """Packets dropped so far by the qdiscs inside the testbed's nodes (their links' egress)."""
    total = 0
    for host in tb.hosts:
        out = subprocess.run(["ip", "netns", "exec", tb.netns(host), "tc", "-s", "qdisc"], capture_output=True,
                             text=True).stdout
        total += sum(int(x) for x in re.findall(r"dropped (\d+)", out))
    return total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON of every job (default: print only)")
    a = ap.parse_args(argv)
    if why := testbed.available():
        raise SystemExit(f"allreduce_drops: {why}")
    testbed.down(NAME)
    tb = testbed.up(testbed.Testbed(nodes=4, slots=1, rate=a.rate, subnet=SUBNET, name=NAME))
    jobs = []
    try:
        for rnd in range(a.rounds):
            for algo in ALGORITHMS:
                env = dict(network.base_env(tb), MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=algo)
                before = dropped(tb)
                run = run_comm_bench((4,), sizes=SIZES, env=env, timeout=600,
                                     extra_args=[*tb.mpiexec_args(), "-hosts", network.hosts_arg(tb, 4, 4)])["runs"][0]
                jobs.append({"round": rnd, "algorithm": algo, "sizes_bytes": run["sizes_bytes"],
                             "seconds": run["seconds"], "dropped": dropped(tb) - before})
                print(f"round {rnd} {algo:26s} " + ", ".join(
                    f"{s >> 20} MiB {t * 1e3:.0f} ms" for s, t in zip(run["sizes_bytes"], run["seconds"]))
                    + f"; {jobs[-1]['dropped']} packets dropped", flush=True)
    finally:
        testbed.down(NAME)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rate": a.rate, "nodes": 4, "ranks_per_node": 1, "jobs": jobs}, f, indent=1)


if __name__ == "__main__":
    main()
