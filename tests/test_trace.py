"""A per-rank trace of a real run (``--trace``, pilab.engine.trace): real mpiexec ranks on a small slice,
the file checked against the format (pilab.tracefile.validate), a straggler made by a real CPU quota
(a cgroup), the bounded window, and the same losses bit for bit with and without tracing; on the testbed
(two network namespaces, root; hold /tmp/pilab-testbed.lock), one node's link 10x slower makes the
gradient messages crossing it finish late."""
import json
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from conftest import MPIEXEC, mpi_env, skip_or_fail
from pilab import tracefile

TINY = ["--width", "0.25", "--train-subset", "200", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet", "--epochs", "2", "--bucket-mb", "0.05"]
PY = [sys.executable, "-m", "pilab", "train"]


def _train(out, *extra, prefix=None, timeout=120):
    """``mpiexec -n 2 python -m pilab train TINY extra --out out`` (or the MPMD line ``prefix`` builds)."""
    args = [*TINY, *extra, "--out", str(out)]
    cmd = prefix(args) if prefix else [MPIEXEC, "-n", "2", *PY, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env())
    assert p.returncode == 0, p.stdout + p.stderr
    with open(out / "result.json") as f:
        return json.load(f)


def _by_step(doc):
    """{(rank, step): {span name: event}} and {(rank, step): [flight begin/end pairs]}."""
    spans, begins, flights = defaultdict(dict), {}, defaultdict(list)
    for ev in doc["traceEvents"]:
        if ev["ph"] == "X" and ev["cat"] == "step" and ev["name"] not in ("eval", "checkpoint"):
            spans[(ev["tid"], ev["args"]["step"])][ev["name"]] = ev
        elif ev["ph"] == "b":
            begins[ev["id"]] = ev
        elif ev["ph"] == "e":
            b = begins.pop(ev["id"])
            flights[(b["tid"], b["args"]["step"])].append((b, ev))
    return spans, flights


def _median(spans, rank, *names):
    return float(np.median([sum(row[n]["dur"] for n in names) for (r, _), row in spans.items()
                            if r == rank and all(n in row for n in names)]))


def test_trace_of_two_ranks(tmp_path):
    """Every step of both ranks has its spans, every gradient message a flight posted after its
    backward began and ending after it began; tracks in time order; the losses are those of a run
    without --trace, bit for bit."""
    res = _train(tmp_path / "t", "--trace", "--checkpoint-every", "1")
    plain = _train(tmp_path / "p")
    assert res["steps"]["loss"] == plain["steps"]["loss"]  # tracing changes no number
    assert "trace" not in plain
    doc = tracefile.read(str(tmp_path / "t" / "trace.json"))  # validates: fields, b/e pairs, order per track
    meta = doc["otherData"]
    assert meta["kind"] == "measured" and meta["np"] == 2 and meta["config"]["trace"] is True
    assert len(meta["clock"]["offsets_us"]) == 2 and meta["clock"]["error_us"] >= 0
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert {t for _, t in threads} == {0, 1}
    spans, flights = _by_step(doc)
    steps = res["total_steps"]
    assert steps == 12 and set(spans) == {(r, s) for r in (0, 1) for s in range(1, steps + 1)}
    for (r, s), row in spans.items():
        assert {"data", "forward", "backward", "wait", "optimizer"} <= set(row), (r, s)
        start = row["backward"]["ts"]
        assert flights[(r, s)], f"rank {r} step {s} has no bucket"
        for b, e in flights[(r, s)]:
            assert e["ts"] >= b["ts"] >= start
            assert b["args"]["bytes"] > 0 and b["id"] == f"{r}-{s}-{b['args']['bucket']}"
    assert sum(1 for _ in flights[(0, 5)]) > 1  # several messages: 0.05 MiB buckets
    evals = [e for e in doc["traceEvents"] if e["name"] == "eval"]
    assert {e["tid"] for e in evals} == {0, 1}
    saves = [e for e in doc["traceEvents"] if e["name"] == "checkpoint"]
    assert [(e["tid"], e["args"]["step"]) for e in saves] == [(0, 6), (0, 12)]  # rank 0 writes them
    table = res["trace"]
    assert table["path"] == str(tmp_path / "t" / "trace.json")
    assert [r["rank"] for r in table["ranks"]] == [0, 1] and all(r["compute_s"] > 0 for r in table["ranks"])


def _cpu_cgroup(name):
    """A fresh cgroup with a CPU quota of 0.1 core (v1 cpu controller or v2 cpu.max), or a skip."""
    for root, v2 in (("/sys/fs/cgroup/cpu", False), ("/sys/fs/cgroup", True)):
        knob = os.path.join(root, "cpu.max" if v2 else "cpu.cfs_quota_us")
        if os.path.isfile(knob) and os.access(root, os.W_OK):
            path = os.path.join(root, name)
            try:
                os.makedirs(path, exist_ok=True)
                with open(os.path.join(path, "cpu.max" if v2 else "cpu.cfs_quota_us"), "w") as f:
                    f.write("10000 100000" if v2 else "10000")
            except OSError as e:
                skip_or_fail(f"cannot make a CPU-quota cgroup at {path} ({e}); run as root",
                             "the throttled-rank trace must run")
            return path
    skip_or_fail("no writable cgroup cpu controller (/sys/fs/cgroup/cpu or cpu.max); run as root",
                 "the throttled-rank trace must run")


def test_throttled_rank_shows(tmp_path):
    """Rank 1's process in a cgroup with a tenth of a core (MPMD: its own wrapper moves itself in,
    then execs python): the trace shows rank 1's longer forward and backward, and rank 0's longer wait;
    the steps the straggler warning named are kept beyond the window."""
    cg = _cpu_cgroup(f"pilab-trace-test-{os.getpid()}")
    wrap = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
    try:
        res = _train(tmp_path / "t", "--trace", "--trace-window", "2", "--straggler-steps", "2",
                     prefix=lambda a: [MPIEXEC, "-n", "1", *PY, *a, ":", "-n", "1", *wrap, *PY, *a], timeout=180)
    finally:
        for knob, v in (("cpu.cfs_quota_us", "-1"), ("cpu.max", "max")):
            if os.path.exists(os.path.join(cg, knob)):
                with open(os.path.join(cg, knob), "w") as f:
                    f.write(v)
        os.rmdir(cg)
    spans, _ = _by_step(tracefile.read(str(tmp_path / "t" / "trace.json")))
    # the straggler warning's steps are kept beyond the window (first 5, last 2), on both ranks alike
    t = res["trace"]
    assert set(t["named"]) - {1, 2, 3, 4, 5, 11, 12}, t
    assert set(t["steps"]) == {1, 2, 3, 4, 5, 11, 12} | set(t["named"])
    assert set(spans) == {(r, s) for r in (0, 1) for s in t["steps"]}
    assert res["stragglers"] and res["stragglers"][0]["rank"] == 1
    fb = [_median(spans, r, "forward", "backward") for r in (0, 1)]
    wait = [_median(spans, r, "wait") for r in (0, 1)]
    assert fb[1] > 1.5 * fb[0], fb
    assert wait[0] > wait[1] and wait[0] > 0.3 * fb[0], wait
    table = {r["rank"]: r for r in res["trace"]["ranks"]}
    assert table[1]["compute_s"] > table[0]["compute_s"] and table[0]["wait_s"] > table[1]["wait_s"]


def test_window_keeps_first_and_last_steps(tmp_path):
    """--trace-window 3 on a 12-step run: the first 5 steps and the last 3, no others."""
    res = _train(tmp_path / "t", "--trace", "--trace-window", "3", "--straggler-threshold", "0")
    spans, flights = _by_step(tracefile.read(str(tmp_path / "t" / "trace.json")))
    want = [1, 2, 3, 4, 5, 10, 11, 12]
    assert sorted({s for _, s in spans}) == want and sorted({s for _, s in flights}) == want
    assert res["trace"]["steps"] == want and res["trace"]["first"] == [1, 2, 3, 4, 5]


def test_simulator_tracks_per_virtual_rank(tmp_path):
    """The simulator: one track per virtual rank (data, forward, backward), the optimizer on rank 0's."""
    from pilab.config import Config
    from pilab.engine import loop as engine

    cfg = Config(width=0.25, train_subset=64, test_subset=20, batch_size=8, epochs=1, max_steps=3, threads=1,
                 trace=True, out=str(tmp_path / "s"))
    result, _ = engine.train(cfg, engine.VirtualRanks(2, ranks_per_chunk=1))
    spans, flights = _by_step(tracefile.read(str(tmp_path / "s" / "trace.json")))
    assert set(spans) == {(r, s) for r in (0, 1) for s in (1, 2, 3)} and not flights
    assert all({"data", "forward", "backward"} <= set(row) for row in spans.values())
    assert all(("optimizer" in row) == (r == 0) for (r, _), row in spans.items())
    assert result["trace"]["tracks"].startswith("one per virtual rank")


def test_bad_window_is_one_line_exit_2(tmp_path):
    p = subprocess.run([*PY, *TINY, "--trace", "--trace-window", "0", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120, env=mpi_env())
    assert p.returncode == 2 and "trace_window=0" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_panel_has_a_trace_checkbox():
    """The notebook panel's trace box sets Config.trace (ipywidgets only; no run)."""
    pytest.importorskip("ipywidgets")
    from pilab.config import Config
    from pilab.lab import widgets

    panel = widgets.ControlPanel(None, Config(width=0.25), settings_only=True)
    assert panel.config().trace is False
    panel.controls["trace"].value = True
    assert panel.config().trace is True and panel.controls["trace"].tooltip == Config.help("trace") != ""


def test_a_resumed_run_traces_its_own_steps(tmp_path):
    """--trace may be turned on at a resume (it changes no number): the trace holds the steps after it."""
    _train(tmp_path / "a", "--max-steps", "6", "--checkpoint-every", "1")
    res = _train(tmp_path / "b", "--resume", str(tmp_path / "a" / "checkpoint.pt"), "--trace")
    spans, _ = _by_step(tracefile.read(str(tmp_path / "b" / "trace.json")))
    assert sorted({s for _, s in spans}) == res["trace"]["steps"] == [7, 8, 9, 10, 11, 12]


def test_a_slow_link_makes_the_buckets_finish_late(tmp_path):
    """Two testbed nodes, one rank each: the same traced run at 1 Gbit/s and with node02's link at 100
    Mbit/s. Every Allreduce crosses that link, so on both ranks the messages' flights (posted to first
    seen complete) and the network part of the wait at the end of backward grow."""
    from conftest import run_on_testbed
    from pilab import testbed
    from pilab.launch import find_mpiexec

    why = testbed.available()
    if why:
        skip_or_fail(why, "CI runs as root here and must run the multi-node tests")
    name = "pltrace"
    testbed.down(name)
    tb = testbed.up(testbed.Testbed(nodes=2, slots=1, rate="1gbit", subnet="10.87.0.0/24", name=name))
    medians = {}
    try:
        for rate in ("1gbit", "100mbit"):
            bed = testbed.shape(tb, "node02", rate)
            out = tmp_path / rate
            rank = [*PY, *TINY, "--epochs", "1", "--hang-s", "0", "--trace", "--out", str(out)]
            p = run_on_testbed(bed, [find_mpiexec(), *bed.mpiexec_args(), "-hosts",
                                     f"{bed.address('node01')}:1,{bed.address('node02')}:1", "-n", "2", *rank],
                               env=bed.env(mpi_env()), timeout=300)
            assert p.returncode == 0, p.stderr[-3000:]
            spans, flights = _by_step(tracefile.read(str(out / "trace.json")))
            table = json.loads((out / "result.json").read_text())["trace"]["ranks"]
            medians[rate] = {r: {"flight": float(np.median([e["ts"] - b["ts"] for (q, s), fl in flights.items()
                                                            if q == r and s > 1 for b, e in fl])),
                                 "network": table[r]["network_s"], "wait": _median(spans, r, "wait"),
                                 "compute": _median(spans, r, "forward", "backward")}
                             for r in (0, 1)}
    finally:
        testbed.down(name)
    fast, slow = medians["1gbit"], medians["100mbit"]
    for r in (0, 1):  # the wait span also holds the wait for a slower rank (the machine's load): its network part
        assert slow[r]["flight"] > 3 * fast[r]["flight"], medians
        assert slow[r]["network"] > fast[r]["network"], medians
    assert sum(slow[r]["network"] for r in (0, 1)) > 2 * sum(fast[r]["network"] for r in (0, 1)), medians
