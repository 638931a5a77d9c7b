"""Issue 39's validation on the testbed: a traced run and the performance model's prediction of it, from
the testbed's own calibration, at 1 Gbit/s and 200 Mbit/s; 2 nodes x 1 rank (one rank per core on a
2-core machine). Goals from validate_trace.py beside this file.

    sudo flock /run/pilab-testbed.lock python experiments/perfmodel/validate_testbed.py --out runs/validate
    # a setting whose exposed tail is milliseconds (width 1.0, the last 0.40 MB bucket not re-cut; LOG.md):
    sudo flock /run/pilab-testbed.lock python experiments/perfmodel/validate_testbed.py --out runs/validate-w1 \
        --width 1.0 --bucket-mb 1 --bucket-tail-mb 0
    # ... with links that behave like a wire after an idle spell (an 80 KB token bucket, not 250 KB):
    sudo flock /run/pilab-testbed.lock python experiments/perfmodel/validate_testbed.py --out runs/validate-wire \
        --width 1.0 --bucket-mb 1 --bucket-tail-mb 0 --burst 81920

Brings its own testbed up (name "trv", 10.92.0.0/24) and always takes it down. Per rate: the Allreduce
micro-benchmark with one rank on each node (the inter-node link), then the traced run; once, on node01:
the micro-benchmark with 2 ranks (the intra-node link) and an np=1 run (compute). Writes OUT/validation.json
and each run's trace (OUT/RATE/trace.json) beside its prediction (OUT/RATE/predicted.json), with the
load average and the cores each job got (a miss on a shared machine is often that).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from pilab import perfmodel as pm
from pilab import testbed
from pilab.trace import format as tf
from pilab.bench import network
from pilab.files import save_json
from pilab.trace.predict import table, validate

from validate_trace import STEP_GOAL, TAIL_GOAL  # this directory: the goals live in one place

NAME, SUBNET = "trv", "10.92.0.0/24"
RATES = ("1gbit", "200mbit")
# MobileNetV2 width 0.25: 1.0 MB of gradients in 0.25 MiB buckets, 40 steps of 16 images per rank
SETTINGS = dict(width=0.25, batch_size=16, train_subset=1280, test_subset=100, epochs=1, threads=1,
                bucket_mb=0.25)


def _rebucket(tb, burst: int) -> None:
    """Every tbf qdisc in the testbed's namespaces: the same rate, ``burst`` bytes of bucket. Why: the
    testbed's default bucket (250 KB at 1 Gbit/s) lets a message that follows an idle spell through
    2.0 ms early, which a wire (the model's link, a Pi's) does not (experiments/perfmodel/LOG.md)."""
    for h in tb.hosts:
        ns = ["ip", "netns", "exec", tb.netns(h)]
        shown = subprocess.run(ns + ["tc", "-j", "qdisc", "show"], check=True, capture_output=True, text=True)
        for q in json.loads(shown.stdout or "[]"):
            if q.get("kind") == "tbf":
                bps = int(q["options"]["rate"]) * 8  # tc -j gives bytes per second
                subprocess.run(ns + ["tc", "qdisc", "replace", "dev", q["dev"], "root", "tbf", "rate", f"{bps}bit",
                                     "burst", str(burst), "limit", str(burst + int(bps / 8 * 0.020))], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/validate")
    ap.add_argument("--rates", nargs="+", default=list(RATES), help="link rates, in order (default: %(default)s)")
    ap.add_argument("--burst", type=int, default=0,
                    help="bytes of each shaped link's token bucket (default 0: the testbed's own, "
                         "testbed.burst_bytes; at least 65536, one GSO super-packet): 81920 makes a link "
                         "after an idle spell behave like a wire (LOG.md)")
    for key, typ in (("width", float), ("bucket_mb", float), ("bucket_tail_mb", float), ("batch_size", int),
                     ("train_subset", int)):
        ap.add_argument("--" + key.replace("_", "-"), type=typ, default=SETTINGS.get(key),
                        help="overrides the setting above (default: %(default)s; None: Config's)")
    args = ap.parse_args()
    out = args.out
    for rate in args.rates:  # before the testbed comes up: a bad rate is one line, exit 2
        try:
            testbed.parse_rate(rate)
        except testbed.TestbedError as e:
            ap.error(str(e))
    if args.burst and args.burst < 65536:
        ap.error(f"--burst {args.burst}: at least 65536 bytes (one GSO super-packet on a veth), or TCP stalls")
    settings = dict(SETTINGS, **{k: getattr(args, k) for k in ("width", "bucket_mb", "batch_size", "train_subset")})
    if args.bucket_tail_mb is not None:
        settings["bucket_tail_mb"] = args.bucket_tail_mb
    testbed.down(NAME)  # whatever an interrupted run left
    tb = testbed.up(testbed.Testbed(nodes=2, slots=1, rate="1gbit", subnet=SUBNET, name=NAME))
    rows = {}
    try:
        intra = network.bench(tb, 2, 1, print)
        load = os.getloadavg()[0]
        np1, _, cores = network.train_run(tb, 1, f"{tb.address('node01')}:1", os.path.join(out, "np1"),
                                          settings=settings)
        # the machine's other load and the cores each job got: what a miss on a shared box comes from
        machine = {"np1": {"load_before": load, "load_after": os.getloadavg()[0], "cores_got": cores}}
        cal = pm.calibrate(np1, [intra], source="testbed node01 np=1")
        for rate in args.rates:
            for h in tb.hosts:
                tb = testbed.shape(tb, h, rate)
            if args.burst:
                _rebucket(tb, args.burst)
            inter = network.bench(tb, 2, 2, print)
            # the two nodes share this machine's cores
            cl = pm.cluster_from_calibration(cal, nodes=2, ranks_per_node=1, inter_bench=[inter],
                                             available_cores=(os.cpu_count() or 2) / 2)
            run = os.path.join(out, rate)
            load = os.getloadavg()[0]
            _, _, got = network.train_run(tb, 2, network.hosts_arg(tb, 2, 2), run,
                                          settings=dict(settings, trace=True))
            v = validate(tf.read(os.path.join(run, "trace.json")), cl)
            tf.write(os.path.join(run, "predicted.json"), v["predicted"]["traceEvents"],
                     meta=v["predicted"]["otherData"])
            print(f"\n{rate}, 2 nodes x 1 rank")
            print(table(v, step_goal=STEP_GOAL, tail_goal=TAIL_GOAL))
            rows[rate] = {k: v[k] for k in ("np", "buckets", "step", "tail")}
            rows[rate]["machine"] = {"load_before": load, "load_after": os.getloadavg()[0], "cores_got": got}
            print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; the job got {got:.2f} cores "
                  f"(np=1 calibration: {cores:.2f} cores at load {machine['np1']['load_before']:.1f})")
    finally:
        testbed.down(NAME)
    save_json({"settings": settings, "goals": {"step": STEP_GOAL, "tail": TAIL_GOAL}, "rates": rows,
               "burst_bytes": {r: args.burst or testbed.burst_bytes(r) for r in args.rates},
               "machine": machine},
              os.path.join(out, "validation.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
