"""The ``network`` section: the performance model's network half against multi-node runs over shaped TCP
links, on a testbed of network namespaces this section brings up and always removes again::

    sudo python -m pilab bench --sections network            # ~15 min on 2 busy cores (needs root)
    sudo python -m pilab bench --sections network --quick    # 2 nodes, one rate, np=2 (~3 min)

Without root it is skipped with one line saying why. Its testbed has a name and range of its own
(``plbench``, 10.84.0.0/24; see ``pilab.testbed``), so it never touches another session's, and it is
taken down after an error or Ctrl-C too. On the nodes' namespaces:

1. the Allreduce micro-benchmark (``perfmodel.run_comm_bench``) on one node (np 2 and 4: the intra-node
   link, MPICH's shared memory; np 4 is oversubscribed), and at each link rate with one rank on each of
   2 nodes (the inter-node link), 4 nodes, and 2 ranks on each of 2 and 4 nodes (held out);
2. an np=1 training run on node01 (the compute calibration);
3. real training runs (``pilab.engine.harness`` jobs, as ``pilab train`` runs them) at np = 2, 4, 8 on 1, 2 and
   4 nodes (block placement, ranks 0.. on node01) at each rate, the rates alternating so that the
   machine's load hits each alike;
   and, at LOCAL_RATE, local-SGD runs (LOCAL_H steps between parameter averages) at np 2, 4, 8 on 2-4 nodes;
4. alpha and beta fitted from 1. *only* (``fit_alpha_beta(..., min_bytes=16 KiB)``, the sizes a
   gradient bucket has: intra from the one-node runs, inter from the 2-node one-rank-per-node run at
   that rate), the Cluster built with ``cluster_from_calibration``, and ``perfmodel.predict`` against
   each run: the Allreduce time per step (measured: rank 0's median of ``comm_exposed - comm_wait`` over
   the steps after the first -- the network's part of the exposed communication; at width 0.25 the
   gradients are one 1 MB bucket, ready at the end of backward, so none of it is hidden) and the
   training time of the epoch.

5. one synchronous step on the wire (``pilab.bench.wire``): pilab (default buckets, fp16, one
   bucket) against DDP-gloo (its defaults and 1 MiB buckets) and the no-exchange ceiling, alternated round
   by round, on 2 nodes x 1 rank and 4 nodes x 2 ranks at WIRE_RATES, beside the bound (``wire_rows``).

All nodes of the testbed share this machine's cores: a node gets ``cores / nodes`` of them
(``Cluster.available_cores``), and np = 4 and 8 are oversubscribed (more ranks than the 2 cores).
"share-aware" also scales by the cores each job actually got on a machine shared with other work (CPU
seconds over wall seconds, as in the ``perfmodel`` section). "+ tbf credit" takes off each multi-node
step the first ``testbed.burst_bytes(rate)`` of its transfer, which tc's token bucket lets through at
once after the step's compute (a testbed effect, not a wire's: see docs/perfmodel.md). Nothing here
asserts on timings. The model's side (:mod:`pilab.perfmodel.check`) works from the stored measurements
only: the recorded run's tables again, without root or runs::

    python -c "from pilab.perfmodel import check; print(check.report('benchmarks/results/bench_network.json'))"
"""
from __future__ import annotations

import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time

from .. import perfmodel as pm, testbed
from ..config import Config
from ..perfmodel.check import LOCAL_RATE, LOCAL_TRAIN, TRAIN, train as harness_train

NAME, SUBNET = "plbench", "10.84.0.0/24"
SIZES = (4, 1024, 16 * 1024, 128 * 1024, 2 ** 20, 4 * 2 ** 20)
# (np, nodes): block placement, np / nodes ranks on each node
POINTS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]
RATES, QUICK_RATES = ("100mbit", "1gbit"), ("100mbit",)
LOCAL_POINTS = [(2, 2), (4, 2), (8, 4)]
# One synchronous step on the wire (pilab.bench.wire): the contenders on 2 nodes x 1 rank and on
# 4 nodes x 2 ranks (the Pi layout), at each WIRE_RATES rate, beside the physical bound.
WIRE_RATES, QUICK_WIRE_RATES = ("200mbit", "1gbit"), ("200mbit",)
WIRE_LAYOUTS = [(2, 2), (8, 4)]  # (np, nodes)


def unavailable() -> str | None:
    """None when this section can run here, else why not (one line: root, Linux, ip/tc/unshare)."""
    return testbed.available()


def hosts_arg(tb, np_: int, nodes: int) -> str:
    rpn = np_ // nodes
    return ",".join(f"{tb.address(h)}:{rpn}" for h in tb.hosts[:nodes])


def base_env(tb) -> dict:
    env = tb.env()
    env.pop("HYDRA_HOST_FILE", None)  # each job names its hosts (-hosts)
    env.pop("PILAB_HOSTFILE", None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def bench(tb, np_: int, nodes: int, log, mpiexec=None) -> dict:
    t = time.monotonic()
    res = pm.run_comm_bench((np_,), sizes=SIZES, env=base_env(tb), timeout=600, mpiexec=mpiexec,
                            extra_args=[*tb.mpiexec_args(), "-hosts", hosts_arg(tb, np_, nodes)])
    run = res["runs"][0]
    run.update(nodes=nodes, rate=None, wall_s=round(time.monotonic() - t, 1))
    log(f"  bench np={np_} nodes={nodes}: " + ", ".join(
        f"{s}B {v * 1e3:.3g}ms" for s, v in zip(run["sizes_bytes"], run["seconds"])))
    return run


def train_run(tb, np_: int, hosts: str, out: str, mpiexec=None, settings=TRAIN) -> tuple[dict, float, float]:
    """One training run on ``hosts`` of the testbed: (result, wall seconds, cores the job got)."""
    shutil.rmtree(out, ignore_errors=True)  # a run of its own in out
    t0 = time.perf_counter()
    r, cores = harness_train(np_, Config(out=out, **settings), mpiexec, hang_s=120, env=base_env(tb),
                             extra=[*tb.mpiexec_args(), "-hosts", hosts], timeout=900)
    return r, time.perf_counter() - t0, cores


def train(tb, np_: int, nodes: int, out: str, log, mpiexec=None, settings=TRAIN) -> dict:
    r, wall, cores = train_run(tb, np_, hosts_arg(tb, np_, nodes), out, mpiexec, settings)
    st = r["steps"]
    net = [e - w for e, w in zip(st["comm_exposed"], st["comm_wait"])][1:]
    comp = st["compute"][1:]
    ep = r["epochs"][0]
    row = {"np": np_, "nodes": nodes, "local_steps": settings.get("local_steps", 1),
           "cores_got": round(cores, 3), "wall_s": round(wall, 1),
           "steps": len(st["compute"]), "hostnames": r["env"]["hostnames"],
           "net_step_median": statistics.median(net), "net_step_mean": statistics.fmean(net),
           "comm_step_median": statistics.median(st["comm"][1:]),
           "wait_step_mean": statistics.fmean(st["comm_wait"][1:]),
           "compute_step_median": statistics.median(comp),
           "step_median": statistics.median(st["time"][1:]),
           "epoch_time": ep["time"], "epoch_compute": ep["compute"], "epoch_comm_exposed": ep["comm_exposed"],
           "bytes_per_step": r.get("bytes_per_step"), "result": r}
    log(f"  train np={np_} nodes={nodes}{' local H=%d' % row['local_steps'] if row['local_steps'] > 1 else ''}: epoch {ep['time']:.2f} s, net/step {row['net_step_median'] * 1e3:.1f} "
        f"ms, compute/step {row['compute_step_median'] * 1e3:.0f} ms, cores got {cores:.2f}")
    return row


def section(quick: bool = False, *, work: str | None = None, mpiexec: str | None = None, repeat: int = 1,
            command: str = "python -m pilab bench --sections network", log=print) -> dict:
    """Bring up the testbed, measure, take it down; the measurements (their analysis, the model's side:
    :func:`pilab.perfmodel.check.analyse`). ``work``:
    where the runs' results go (their step logs stay there; the dict keeps the figures; None: a
    temporary folder)."""
    if work is None:
        with tempfile.TemporaryDirectory(prefix="pilab-bench-network-") as tmp:
            return section(quick, work=tmp, mpiexec=mpiexec, repeat=repeat, command=command, log=log)
    rates = list(QUICK_RATES if quick else RATES)
    nodes_n = 2 if quick else 4
    nps = {2} if quick else {2, 4, 8}
    points = [(np_, nodes, False) for np_, nodes in POINTS if np_ in nps and nodes <= nodes_n]
    data = {"command": command, "quick": quick,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cores": os.cpu_count(), "load_before": os.getloadavg(),
            "rates": rates, "train_config": TRAIN, "sizes": list(SIZES), "testbed": {"name": NAME, "subnet": SUBNET},
            "bench": [], "train": [], "np1": None}
    testbed.down(NAME)  # what an earlier run of this section may have left
    tb = testbed.up(testbed.Testbed(nodes=nodes_n, slots=2, rate=rates[0], subnet=SUBNET, name=NAME))
    try:
        log(f"bench: network: testbed {NAME} up ({SUBNET}); load {os.getloadavg()[0]:.1f}")
        tb = _links(tb, data, rates, nps, nodes_n, log, mpiexec)
        r, _, cores = train_run(tb, 1, f"{tb.address('node01')}:1", os.path.join(work, "np1"), mpiexec)
        data["np1"] = {"result": r, "cores_got": cores}
        log(f"  np=1: epoch {r['epochs'][0]['time']:.2f} s, cores got {cores:.2f}")
        for rep in range(1, repeat + 1):
            order = rates if rep % 2 else rates[::-1]  # alternate: neither rate always runs first
            for rate in order:
                tb = shaped(tb, rate)
                log(f"bench: network: rep {rep}, links {rate}; load {os.getloadavg()[0]:.1f}")
                _train_points(tb, data, rate, rep, points + [(p, n, True) for p, n in LOCAL_POINTS
                                                             if rate == LOCAL_RATE and p in nps and n <= nodes_n],
                              work, log, mpiexec)
        data["wire"] = []
        for rate in (QUICK_WIRE_RATES if quick else WIRE_RATES):
            tb = shaped(tb, rate)
            log(f"bench: network: one step on the wire, links {rate}; load {os.getloadavg()[0]:.1f}")
            if not any(b["rate"] == rate and b["nodes"] == 2 and b["np"] == 2 for b in data["bench"]):
                run = bench(tb, 2, 2, log, mpiexec)  # the link rate of the bound
                run["rate"] = rate
                data["bench"].append(run)
            for np_, nodes in WIRE_LAYOUTS:
                if nodes <= nodes_n:
                    data["wire"].append(wire(tb, np_, nodes, rate, log, mpiexec, quick))
    finally:
        testbed.down(NAME)
        log(f"bench: network: testbed {NAME} down")
    data["load_after"] = os.getloadavg()
    for r in data["train"]:
        r.pop("result", None)  # the step logs stay in work; the dict keeps the figures
    return data


def shaped(tb, rate: str):
    """The testbed with every node's link at ``rate``."""
    for h in tb.hosts:
        tb = testbed.shape(tb, h, rate)
    return tb


def _links(tb, data: dict, rates, nps, nodes_n: int, log, mpiexec):
    """The Allreduce micro-benchmark on one node (shared memory, whatever the rate), then at each rate
    across nodes, into ``data["bench"]``; the testbed as the last rate left it."""
    for np_ in sorted(n for n in (2, 4) if n in nps):
        data["bench"].append(bench(tb, np_, 1, log, mpiexec))
    for rate in rates:
        tb = shaped(tb, rate)
        log(f"bench: network: links {rate}")
        for np_, nodes in ((2, 2), (4, 4), (4, 2), (8, 4)):
            if nodes <= nodes_n and (np_ in nps or (np_, nodes) == (2, 2)):
                run = bench(tb, np_, nodes, log, mpiexec)
                run["rate"] = rate
                data["bench"].append(run)
    return tb


def _train_points(tb, data: dict, rate: str, rep: int, points, work: str, log, mpiexec) -> None:
    """One training run per (np, nodes, local SGD?) point at ``rate`` into ``data["train"]``: the
    synchronous ones (one-node runs too: the same load, and a check), then local SGD on the same links."""
    for np_, nodes, local in points:
        name = f"{rate}-np{np_}-n{nodes}" + ("-local" if local else "") + f"-{rep}"
        row = train(tb, np_, nodes, os.path.join(work, name), log, mpiexec, LOCAL_TRAIN if local else TRAIN)
        row.update(rate=rate, rep=rep)
        data["train"].append(row)


# ----------------------------------------------------------------------------------------------
# one step on the wire: pilab vs DDP-gloo vs the ceiling vs the bound
# ----------------------------------------------------------------------------------------------
def wire(tb, np_: int, nodes: int, rate: str, log, mpiexec=None, quick=False) -> dict:
    """The contenders of ``pilab.bench.wire`` on ``nodes`` of the testbed (block placement)."""
    from ..launch import run_job

    env = dict(base_env(tb), GLOO_SOCKET_IFNAME=testbed.NODE_IFACE)
    t = time.monotonic()
    res = run_job(np_, "pilab.bench.wire", {"master": tb.address(tb.hosts[0]), "quick": quick},
                  name=f"the wire job (np={np_}, {nodes} nodes, {rate})", mpiexec=mpiexec, env=env,
                  extra=[*tb.mpiexec_args(), "-hosts", hosts_arg(tb, np_, nodes)], timeout=1800)
    res.update(nodes=nodes, rate=rate, wall_s=round(time.monotonic() - t, 1))
    log(f"  wire np={np_} nodes={nodes} {rate}: " + ", ".join(
        f"{k} {v['median']:.3f}s" for k, v in res["step_s"].items()))
    return res
