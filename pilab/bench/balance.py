"""The ``balance`` section: uneven per-rank shares (``--balance``) against a slow node, on a testbed of 2 nodes
x 1 rank x 1 thread that this section brings up and always removes again::

    sudo python -m pilab bench --sections balance --out runs/bench    # ~15 min on 2 busy cores (needs root)
    sudo python -m pilab bench --sections balance --quick --out runs/bench   # 2 rounds, shorter runs

Each rank is pinned to a core of its own (``taskset``), so node01 is one core and node02 a core under its CPU
quota; both nodes' processes are weighted far above the machine's other work (``_own_core``), so that the
quota, not the load, sets a node's speed. In every round, one after the other (alternated, so that the machine's load hits each alike):

- ``ideal``: both nodes at 0.75 of a core, equal shares. The cluster of the same total speed (1.5 cores)
  with perfect sharing: with t the time of one image on a whole core and B the global batch, a step of the
  slow cluster with shares by speed can at best take B t / 1.5 (both ranks busy the whole step), which is
  what two ranks at 0.75 of a core with B / 2 each take: (B / 2) t / 0.75. Measured, not computed, so
  that the per-step work that does not shrink with the share (the optimizer, Python) and the exchange
  are in it as in the others.
- ``off``: node01 a whole core, node02 half a core, equal shares: every step waits for node02, at about
  (B / 2) t / 0.5 = 1.5x the ideal.
- ``static``: the same nodes, shares by the speeds measured over the first ``balance.WINDOW`` steps.
- ``dynamic``: both nodes start at a whole core; node02 is throttled to half a core (``testbed.throttle``,
  while the job runs) after ``THROTTLE_AT`` steps, and the run follows.

Figures: each run's median step (after its first 2 ``WINDOW`` steps: the static shares are in place), its
ratio to the same round's ideal, the median and the spread (min..max) over the rounds; for ``dynamic``, the
steps after the throttle until the median over ``WINDOW`` steps is back within 1.15x the ideal, with the
shares the run took (result.json's ``balance``). Beside them the performance model's 12 Pi 4B + 12 Pi 5
cluster with and without balancing. Nothing here asserts on timings.

The accuracy of uneven shares is the section ``balance_accuracy`` (``accuracy``): the simulator, given
speeds 2:1 against equal shares, 3 seeds each. It times nothing and runs apart from this one, so that
the timed runs hold a quiet machine only as long as they take::

    python -m pilab bench --sections balance_accuracy --out runs/bench
"""
from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
import threading
import time

from .. import resultfile, testbed

NAME, SUBNET = "plbal", "10.86.0.0/24"
# the timed runs: a step of ~0.5 s on a whole core, ranks compute-bound (the 1 GbE veth moves 0.9 MB of
# gradients in ~10 ms); the reshuffle policy, which uneven shares need
SETTINGS = ["--model", "mobilenetv2_cifar", "--width", "0.5", "--batch-size", "32", "--threads", "1",
            "--sharding", "reshuffle", "--eval-every", "1000", "--epochs", "1", "--quiet", "--hang-s", "0",
            "--straggler-threshold", "0"]
CASES = {  # quotas (cores) per node, balance
    "ideal": ({"node01": 0.75, "node02": 0.75}, "off"),
    "off": ({"node02": 0.5}, "off"),
    "static": ({"node02": 0.5}, "static"),
    "dynamic": ({}, "dynamic"),
}
THROTTLE_AT = 24  # dynamic: about this many steps in, node02 is throttled (timed from the round's ideal step)
GOAL = 1.15  # balanced step / ideal step


def unavailable() -> str | None:
    """None when this section can run here, else why not (one line)."""
    return testbed.available() or (None if shutil.which("taskset") else "`taskset` not found (util-linux)")


def _run(tb, case: str, steps: int, out: str, mpiexec=None, delay: float = 0.0) -> dict:
    """One run of ``case`` (quotas set before the job starts; dynamic's throttle ``delay`` seconds after
    it started, while it runs): its result.json, with ``throttled_at_step``."""
    import subprocess
    import sys

    from ..launch import find_mpiexec
    quotas, mode = CASES[case]
    for h in tb.hosts:
        _own_core(tb, h, quotas.get(h, 1.0))
    shutil.rmtree(out, ignore_errors=True)
    rank = [sys.executable, "-m", "pilab", "train", *SETTINGS, *(["--balance", mode] if mode != "off" else []),
            "--train-subset", str(64 * steps), "--test-subset", "100", "--out", out]
    cmd = [mpiexec or find_mpiexec(), *tb.mpiexec_args(), "-hosts",
           f"{tb.address('node01')}:1,{tb.address('node02')}:1",
           "-n", "1", "taskset", "-c", "0", *rank, ":", "-n", "1", "taskset", "-c", "1", *rank]
    env = dict(tb.env(), OMP_NUM_THREADS="1")
    env.pop("HYDRA_HOST_FILE", None)
    throttled: list[float] = []
    timer = None
    if case == "dynamic":  # node02 at half a core once the run is about THROTTLE_AT steps in
        timer = threading.Timer(delay, lambda: (testbed.throttle(tb, "node02", 0.5), throttled.append(time.time())))
        timer.start()
    launched = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    finally:
        if timer is not None:
            timer.cancel()
    if p.returncode != 0:
        raise RuntimeError(f"balance run {case} failed: {p.stderr[-2000:]}")
    result = resultfile.load(os.path.join(out, "result.json"))  # with its per-step series
    result["startup_s"] = result["epochs"][0]["started_at"] - launched  # launch to the first step
    if throttled:  # the step it happened in: from the epoch's start (wall clock) and the steps' times
        ends = itertools.accumulate(result["steps"]["time"])
        since = throttled[0] - result["epochs"][0]["started_at"]
        result["throttled_at_step"] = next((k for k, e in enumerate(ends) if e >= since), None)
    return result


SHARES = 10_000  # cgroup weight of a node's processes (v1 cpu.shares; v2 cpu.weight: its maximum)


def _own_core(tb, host: str, cpus: float) -> None:
    """``host`` at ``cpus`` of its core (a quota; 1.0: the whole core its rank is pinned to), its processes
    weighted far above the machine's other work: on a shared machine a rank would otherwise get the
    core's share the load leaves it, and a quota of half a core would bind nothing. With the weight, the
    quota is what limits a node, as its own clock limits a board."""
    testbed.throttle(tb, host, cpus)
    path = testbed.cpu_quota(f"{tb.name}-{host}", cpus)  # the node's cgroup (as throttle made it)
    for knob, value in (("cpu.shares", SHARES * 26), ("cpu.weight", SHARES)):
        if os.path.exists(os.path.join(path, knob)):
            with open(os.path.join(path, knob), "w") as f:
                f.write(str(value))


def _median_step(result: dict, skip: int) -> float:
    return statistics.median(result["steps"]["time"][skip:])


def section(quick: bool = False, *, work: str | None = None, mpiexec: str | None = None,
            log=print) -> dict:
    """Bring up the testbed, run the rounds, take it down; the figures (see the module docstring)."""
    from .. import perfmodel as pm
    from ..engine.balance import WINDOW
    # dynamic's run takes steps + THROTTLE_AT + 2 WINDOW steps of 64 images from the 5,000 embedded: at most 78
    rounds, steps = (2, 32) if quick else (3, 36)
    tmp = tempfile.TemporaryDirectory(prefix="pilab-bench-balance-") if work is None else None
    work = work or tmp.name
    res: dict = {"rounds": [], "settings": SETTINGS, "steps": steps, "window": WINDOW, "goal": GOAL}
    with testbed.exclusive("pilab bench --sections balance"):
        testbed.down(NAME)
        tb = testbed.up(testbed.Testbed(nodes=2, slots=1, rate="1gbit", subnet=SUBNET, name=NAME))
        try:
            for k in range(rounds):
                row = {}
                timed = ["ideal", "off", "static"]
                for case in timed[k % 3:] + timed[:k % 3] + ["dynamic"]:  # order rotated round by round
                    n = steps + (THROTTLE_AT + 2 * WINDOW if case == "dynamic" else 0)
                    # from the ideal run's own start-up; two whole cores go a third faster than its 0.75 each
                    delay = row["ideal"]["startup_s"] + THROTTLE_AT * 0.75 * row["ideal"]["step_s"] \
                        if case == "dynamic" else 0.0
                    r = _run(tb, case, n, os.path.join(work, f"r{k}-{case}"), mpiexec, delay)
                    row[case] = _figures(r, case)
                    log(f"  round {k + 1} {case}: median step {row[case]['step_s'] * 1e3:.0f} ms")
                ideal = row["ideal"]["step_s"]
                for case in ("off", "static"):
                    row[case]["of_ideal"] = row[case]["step_s"] / ideal
                row["dynamic"].update(_recovery(row["dynamic"], ideal))
                res["rounds"].append(row)
        finally:
            for h in tb.hosts:
                testbed.throttle(tb, h, 0)
            testbed.down(NAME)
            if tmp is not None:
                tmp.cleanup()
    for case in ("off", "static"):
        ratios = [r[case]["of_ideal"] for r in res["rounds"]]
        res[f"{case}_of_ideal"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    back = [r["dynamic"]["steps_to_goal"] for r in res["rounds"]]
    res["dynamic_steps_to_goal"] = back
    pred = pm.predict(pm.pi_config(), 48, "pi4b:12,pi5:12", baseline_np=2)["balancing"]
    res["predicted_pi4b12_pi5_12"] = {k: {"of_ideal": pred[k].get("of_ideal"), "speedup": pred[k]["speedup"]}
                                      for k in ("off", "balanced", "ideal")}
    return res


def _figures(result: dict, case: str) -> dict:
    from ..engine.balance import WINDOW
    times = result["steps"]["time"]
    out = {"step_s": _median_step(result, 2 * WINDOW), "steps": len(times), "startup_s": result["startup_s"],
           "shares": (result.get("balance") or {}).get("shares"),
           "changes": (result.get("balance") or {}).get("changes", [])}
    if case == "dynamic":
        out.update(times=times, throttled_at_step=result.get("throttled_at_step"))
    return out


def _recovery(dyn: dict, ideal: float) -> dict:
    """After the throttle: the steps until a WINDOW's median step is back within GOAL of the ideal."""
    from ..engine.balance import WINDOW
    times, at = dyn.pop("times"), dyn.get("throttled_at_step")
    if at is None:
        return {"steps_to_goal": None, "settled_of_ideal": None}
    after = times[at:]
    for k in range(len(after) - WINDOW + 1):
        if statistics.median(after[k:k + WINDOW]) <= GOAL * ideal:
            return {"steps_to_goal": k + WINDOW, "settled_of_ideal": statistics.median(after[-WINDOW:]) / ideal}
    return {"steps_to_goal": None, "settled_of_ideal": statistics.median(after[-WINDOW:]) / ideal}


def accuracy(quick: bool = False, log=print) -> dict:
    """Final test accuracy of balanced shares (given speeds 2:1) against equal shares, 3 seeds each, in the
    simulator at np=2 on the embedded data: the same mathematics per step, BatchNorm per rank on its own
    share (the section ``balance_accuracy``)."""
    from .. import simulate
    from ..config import Config
    seeds = (0, 1) if quick else (0, 1, 2)
    base = Config(width=0.25, epochs=2 if quick else 4, batch_size=32, sharding="reshuffle", threads=1,
                  train_subset=2000 if quick else 0, simulate_mode="exact")
    out = {}
    for mode in ("off", "static:2,1"):
        accs = []
        for s in seeds:
            from dataclasses import replace
            r = simulate(replace(base, seed=s, balance=mode), 2)
            accs.append(r["epochs"][-1]["test_acc"])
            log(f"  accuracy balance={mode} seed {s}: {accs[-1]:.4f}")
        out[mode] = {"accs": accs, "mean": statistics.fmean(accs),
                     "spread": max(accs) - min(accs)}
    return {"settings": f"simulate np=2 exact, mobilenetv2_cifar width 0.25, batch 32 per rank, "
                        f"{base.epochs} epochs, {base.train_subset or 'all'} embedded training images, "
                        f"seeds {', '.join(map(str, seeds))}", "modes": out}


def _back(k, dyn: dict) -> str:
    if dyn.get("throttled_at_step") is None:
        return "not measured (the run ended before the throttle)"
    return "not within the run" if k is None else str(k)


def markdown(b: dict, when: str = "") -> list[str]:
    """BENCHMARKS.md's lines for the ``balance`` section ``b``; ``when``: the line saying when and at what
    load it ran, or which saved run it is."""
    def spread(s):
        return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}, n={len(b['rounds'])})"
    goal = b.get("goal", GOAL)
    st = b["static_of_ideal"]
    out = ["## Uneven shares against a throttled node (`--balance`)", "",
           "Testbed of 2 nodes × 1 rank × 1 thread, each rank pinned to a core of its own; node02 at half a core's "
           "quota. Each run's median step (after its first 2 × WINDOW steps) against the same round's `ideal` run "
           "(both nodes at 0.75 of a core, equal shares: the cluster of the same total speed, 1.5 cores, with "
           "perfect sharing; docs/guide/mixed-cluster.md derives it); runs alternated within each round, shown as "
           "median (min–max, n = rounds). Settings: `" + " ".join(b["settings"]) + "`. " + when, "",
           "| run | step / ideal | goal |", "|---|---|---|",
           f"| `off`: equal shares, node02 at 0.5 core | {spread(b['off_of_ideal'])} | ≈ 1.5 |",
           f"| `static`: shares measured over the first {b['window']} steps | {spread(st)} | ≤ {goal} "
           f"({'met' if st['median'] <= goal else 'NOT met'}) |", ""]
    back = b.get("dynamic_steps_to_goal") or []
    shares = [r["static"].get("shares") for r in b["rounds"]]
    out += [f"Shares `static` took: {', '.join(str(s) for s in shares)}. `dynamic`: node02 throttled to half a core "
            f"about {THROTTLE_AT} steps into the run (both nodes whole cores before); steps after the throttle until "
            f"the median step over {b['window']} steps was back within {goal}× the ideal, per round: "
            f"{', '.join(_back(k, r['dynamic']) for k, r in zip(back, b['rounds']))} (goal: within one WINDOW of "
            "re-measuring, 2 × WINDOW steps); its shares' changes per round: "
            + "; ".join(str([(c['step'], c['shares']) for c in r["dynamic"].get("changes", [])]) for r in b["rounds"])
            + ".", ""]
    pred = b.get("predicted_pi4b12_pi5_12")
    if pred:
        out += [f"The performance model for 12 Pi 4B + 12 Pi 5 at np=48 (`perfmodel predict --np 48 --cluster "
                f"pi4b:12,pi5:12`): speedup {pred['off']['speedup']:.1f} with equal shares "
                f"({pred['off']['of_ideal']:.2f}× the ideal step), {pred['balanced']['speedup']:.1f} balanced "
                f"({pred['balanced']['of_ideal']:.2f}×), {pred['ideal']['speedup']:.1f} on the ideal cluster.", ""]
    if b.get("accuracy"):  # a run from before balance_accuracy was its own section
        out += accuracy_markdown({"modes": b["accuracy"]}, "")[2:]
    return out


def accuracy_markdown(a: dict, when: str = "") -> list[str]:
    """BENCHMARKS.md's lines for the ``balance_accuracy`` section ``a`` (``accuracy``'s figures)."""
    rows = [f"| {mode} | {', '.join(f'{x:.4f}' for x in v['accs'])} | {v['mean']:.4f} | {v['spread']:.4f} |"
            for mode, v in a["modes"].items()]
    return ["## Accuracy of uneven shares (`--balance`)", "",
            f"Final test accuracy of equal shares against shares 2:1 (`static:2,1`), one run per seed "
            f"({a.get('settings', 'simulator, np=2, embedded data, MobileNetV2-CIFAR 0.25, exact mode')}). " + when,
            "", "| balance | per seed | mean | spread |", "|---|---|---|---|", *rows, ""]


# the saved run of this section that the guide and notebook 01 show (pilab's source tree, not a wheel)
SAVED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks",
                     "balance-testbed.json")


def what_it_buys(saved: str = SAVED):
    """A throttled node and what ``--balance`` does about it, in words: the saved testbed run of this section
    (``off``, ``static`` and ``dynamic`` against the ideal step) beside the performance model's 12 Pi 4B +
    12 Pi 5 cluster with and without balancing. A ``pilab.plots.Paragraph`` (notebook 01's cell)::

        from pilab.bench import balance
        balance.what_it_buys()
    """
    import json

    from .. import perfmodel as pm
    from ..plots.base import Paragraph
    parts = []
    try:
        with open(saved) as f:
            b = json.load(f)["balance"]
    except (OSError, ValueError, KeyError):
        b = None
        parts.append(f"The testbed's measurement ({os.path.basename(saved)}) is in pilab's source repository "
                     "(benchmarks/), not in this install; sudo python -m pilab bench --sections balance makes one.")
    if b:
        def fig(key):
            s = b[key]
            return f"{s['median']:.2f}× ({s['min']:.2f}–{s['max']:.2f})"
        r0 = b["rounds"][0]["static"]
        speeds = r0["changes"][0]["speeds"] if r0.get("changes") else None
        dyn = [r["dynamic"] for r in b["rounds"]]
        back = [d.get("steps_to_goal") for d in dyn]
        parts.append(
            f"Measured on the testbed (benchmarks/balance-testbed.json; 2 nodes × 1 rank, each on a core of its own, "
            f"node02 held to half a core by its CPU quota; {len(b['rounds'])} alternated rounds). With equal shares "
            f"every step waited for node02: {fig('off_of_ideal')} the step of a cluster of the same total speed "
            f"with perfect sharing (the ideal). --balance static measured the two speeds over the first "
            f"{b['window']} steps" + (f" ({speeds[0]:.0f} and {speeds[1]:.0f} images/s)" if speeds else "")
            + f" and split the {sum(r0['shares'])} images of a step {r0['shares'][0]}/{r0['shares'][1]}: "
            f"{fig('static_of_ideal')} the ideal.")
        if all(k is not None for k in back):
            parts.append(f"--balance dynamic, node02 throttled while the job ran: the step was back within "
                         f"{b['goal']}× the ideal {min(back)}–{max(back)} steps later (it looks every "
                         f"{b['window']} steps).")
    pred = pm.predict(pm.pi_config(), 48, "pi4b:12,pi5:12", baseline_np=2)["balancing"]
    off, bal, ideal = pred["off"], pred["balanced"], pred["ideal"]
    parts.append(f"Predicted by the performance model for 12 Pi 4B + 12 Pi 5 (np=48, mobilenetv2_cifar, 32 images "
                 f"a rank): equal shares {off['of_ideal']:.2f}× the ideal step, a speedup of {off['speedup']:.1f} "
                 f"over one Pi 4B node; balanced (shares {min(bal['shares'])} on a Pi 4B rank, "
                 f"{max(bal['shares'])} on a Pi 5's) {bal['of_ideal']:.2f}×, a speedup of {bal['speedup']:.1f}; "
                 f"the ideal {ideal['speedup']:.1f}.")
    out = Paragraph("\n\n".join(parts))
    out.title = "A throttled node, and the balance that fixes it"
    return out
