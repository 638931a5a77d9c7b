"""Issue 39's validation on the testbed: a traced run and the performance model's prediction of it, from
the testbed's own calibration, at 1 Gbit/s and 200 Mbit/s; 2 nodes x 1 rank (one rank per core on a
2-core machine). Goals from validate_trace.py beside this file.

    sudo flock /tmp/pilab-testbed.lock python experiments/perfmodel/validate_testbed.py --out runs/validate

Brings its own testbed up (name "trv", 10.92.0.0/24) and always takes it down. Per rate: the Allreduce
micro-benchmark with one rank on each node (the inter-node link), then the traced run; once, on node01:
the micro-benchmark with 2 ranks (the intra-node link) and an np=1 run (compute). Writes OUT/validation.json
and each run's trace (OUT/RATE/trace.json) beside its prediction (OUT/RATE/predicted.json).
"""
from __future__ import annotations

import argparse
import os
import sys

from pilab import perfmodel as pm
from pilab import testbed
from pilab import tracefile as tf
from pilab.bench import network
from pilab.files import save_json
from pilab.study.trace_validation import table, validate

from validate_trace import STEP_GOAL, TAIL_GOAL  # this directory: the goals live in one place

NAME, SUBNET = "trv", "10.92.0.0/24"
RATES = ("1gbit", "200mbit")
# MobileNetV2 width 0.25: 1.0 MB of gradients in 0.25 MiB buckets, 40 steps of 16 images per rank
SETTINGS = dict(width=0.25, batch_size=16, train_subset=1280, test_subset=100, epochs=1, threads=1,
                bucket_mb=0.25)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/validate")
    out = ap.parse_args().out
    testbed.down(NAME)  # whatever an interrupted run left
    tb = testbed.up(testbed.Testbed(nodes=2, slots=1, rate="1gbit", subnet=SUBNET, name=NAME))
    rows = {}
    try:
        intra = network.bench(tb, 2, 1, print)
        np1, _, cores = network.train_run(tb, 1, f"{tb.address('node01')}:1", os.path.join(out, "np1"),
                                          settings=SETTINGS)
        cal = pm.calibrate(np1, [intra], source="testbed node01 np=1")
        for rate in RATES:
            for h in tb.hosts:
                tb = testbed.shape(tb, h, rate)
            inter = network.bench(tb, 2, 2, print)
            # the two nodes share this machine's cores
            cl = pm.cluster_from_calibration(cal, nodes=2, ranks_per_node=1, inter_bench=[inter],
                                             available_cores=(os.cpu_count() or 2) / 2)
            run = os.path.join(out, rate)
            network.train_run(tb, 2, network.hosts_arg(tb, 2, 2), run, settings=dict(SETTINGS, trace=True))
            v = validate(tf.read(os.path.join(run, "trace.json")), cl)
            tf.write(os.path.join(run, "predicted.json"), v["predicted"]["traceEvents"],
                     meta=v["predicted"]["otherData"])
            print(f"\n{rate}, 2 nodes x 1 rank")
            print(table(v, step_goal=STEP_GOAL, tail_goal=TAIL_GOAL))
            rows[rate] = {k: v[k] for k in ("np", "buckets", "step", "tail")}
    finally:
        testbed.down(NAME)
    save_json({"settings": SETTINGS, "goals": {"step": STEP_GOAL, "tail": TAIL_GOAL}, "rates": rows},
              os.path.join(out, "validation.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
