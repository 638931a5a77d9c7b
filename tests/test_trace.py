"""A per-rank trace of a real run (``--trace``, pilab.trace.recorder): real mpiexec ranks on a small slice,
the file checked against the format (pilab.trace.format.validate), a straggler made by a real CPU quota
(a cgroup), the bounded window, and the same losses bit for bit with and without tracing; on the testbed
(two network namespaces, root; the machine's testbed lock held), one node's link at 10 Mbit/s instead of
1 Gbit/s makes the gradient messages crossing it finish late. Both stragglers are also read back by
``python -m pilab trace``, which must name them. With trace on, rank 0's ``lane`` events feed the
notebook's live swim-lane."""
import json
import os
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from conftest import MPIEXEC, REPO, mpi_env, skip_or_fail
from pilab import resultfile
from pilab.trace import format as tracefile
from pilab import engine

TINY = ["--width", "0.25", "--train-subset", "200", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet", "--epochs", "2", "--bucket-mb", "0.05"]
PY = [sys.executable, "-m", "pilab", "train"]


def _train(out, *extra, prefix=None, timeout=120):
    """``mpiexec -n 2 python -m pilab train TINY extra --out out`` (or the MPMD line ``prefix`` builds)."""
    args = [*TINY, *extra, "--out", str(out)]
    cmd = prefix(args) if prefix else [MPIEXEC, "-n", "2", *PY, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env())
    assert p.returncode == 0, p.stdout + p.stderr
    return resultfile.load(str(out / "result.json"))


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


def _reader(run_dir):
    """``python -m pilab trace RUN_DIR``'s text: ([(step, "cause made-slow-by")] of the slowest steps, the
    critical path's line, the whole text)."""
    p = subprocess.run([*PY[:-1], "trace", str(run_dir)], capture_output=True, text=True, timeout=120, env=mpi_env())
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("slowest steps")))
    slow = []
    for x in lines[at + 2:]:
        if not x.strip():
            break
        step, _, cause, _, who = x.split(None, 4)
        slow.append((int(step), f"{cause} {who}"))
    critical = next(x for x in lines if x.startswith("critical path"))
    return slow, critical, p.stdout


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
    """A fresh cgroup with a CPU quota of 0.1 core (testbed.cpu_quota: v1's cpu controller or v2's
    cpu.max), or a skip."""
    from pilab import testbed
    try:
        return testbed.cpu_quota(name, 0.1)
    except testbed.TestbedError as e:
        skip_or_fail(str(e), "the throttled-rank trace must run")


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
        from pilab import testbed
        testbed.cpu_quota(os.path.basename(cg), 0)
    spans, _ = _by_step(tracefile.read(str(tmp_path / "t" / "trace.json")))
    # the straggler warning's steps are kept beyond the window (first 5, last 2), on both ranks alike
    t = res["trace"]
    assert set(t["named"]) - {1, 2, 3, 4, 5, 11, 12}, t
    assert set(t["steps"]) == {1, 2, 3, 4, 5, 11, 12} | set(t["named"])
    assert set(spans) == {(r, s) for r in (0, 1) for s in t["steps"]}
    # the first straggler flagged is rank 1's compute (the monitor names no network straggler while a rank
    # is a compute one; a window where rank 1's median dips under the threshold may still add one later)
    first = min(res["stragglers"] or [{}], key=lambda s: s.get("first_step", 0))
    assert (first.get("rank"), first.get("kind")) == (1, "compute"), res["stragglers"]
    fb = [_median(spans, r, "forward", "backward") for r in (0, 1)]
    wait = [_median(spans, r, "wait") for r in (0, 1)]
    assert fb[1] > 1.5 * fb[0], fb
    assert wait[0] > wait[1] and wait[0] > 0.3 * fb[0], wait
    table = {r["rank"]: r for r in res["trace"]["ranks"]}
    assert table[1]["compute_s"] > table[0]["compute_s"] and table[0]["wait_s"] > table[1]["wait_s"]
    # the reader (python -m pilab trace) names rank 1 as the one that made the slowest steps slow, and as
    # the critical path of the median step (the last to end backward)
    slow, critical, text = _reader(tmp_path / "t")
    assert slow and all(w.split(" ", 1)[1].startswith("rank 1 (") for _, w in slow), text
    assert ": rank 1 (" in critical, text


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

    cfg = Config(width=0.25, train_subset=64, test_subset=20, batch_size=8, epochs=1, max_steps=3, threads=1,
                 trace=True, out=str(tmp_path / "s"))
    result, _ = engine.fit(cfg, engine.VirtualRanks(2, ranks_per_chunk=1))
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


def test_a_slow_link_makes_the_buckets_finish_late(tmp_path, testbed_lock):
    """Two testbed nodes, one rank each: the same traced run at 1 Gbit/s and with node02's link at 10
    Mbit/s. Every Allreduce crosses that link, so on both ranks the messages' flights (posted to first
    seen complete) and the network part of the wait at the end of backward grow, and the reader names the
    link. (At 100 Mbit/s this small model's messages still hide behind its backward: the slowest steps
    were a rank's compute, not the link.)"""
    from conftest import run_on_testbed
    from pilab import testbed
    from pilab.launch import find_mpiexec

    why = testbed.available()
    if why:
        skip_or_fail(why, "CI runs as root here and must run the multi-node tests")
    name = "pltrace"
    testbed.down(name)
    tb = testbed.up(testbed.Testbed(nodes=2, slots=1, rate="1gbit", subnet="10.87.0.0/24", name=name))
    medians, reads = {}, {}
    try:
        for rate in ("1gbit", "10mbit"):
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
            reads[rate] = _reader(out)
    finally:
        testbed.down(name)
    # the reader blames the slowest steps on the network and names the slowed link (one rank on each of two
    # hosts: every message crosses it); step 1 may instead be its start-up compute (first allocations).
    # The slowest steps at 1 Gbit/s may be anything: not asserted
    slow, _, text = reads["10mbit"]
    assert len(slow) == 5 and all(w == "network link node01-node02" for s, w in slow if s != 1), text
    fast, slow = medians["1gbit"], medians["10mbit"]
    for r in (0, 1):  # the wait span also holds the wait for a slower rank (the machine's load): its network part
        assert slow[r]["flight"] > 3 * fast[r]["flight"], medians
        assert slow[r]["network"] > fast[r]["network"], medians
    assert sum(slow[r]["network"] for r in (0, 1)) > 2 * sum(fast[r]["network"] for r in (0, 1)), medians


LANE_RUN = """
import json, sys
from mpi4py import MPI
from pilab.config import Config
from pilab import engine
comm = MPI.COMM_WORLD
out = {}
for trace in (True, False):
    cfg = Config(width=0.25, train_subset=96, test_subset=50, batch_size=16, epochs=1, threads=1,
                 bucket_mb=0.05, trace=trace)
    events = []
    engine.train(cfg, comm, callbacks=[events.append])
    out[str(trace)] = events
if comm.Get_rank() == 0:
    json.dump(out, open(sys.argv[1], "w"), default=float)
"""


def test_live_lane_events_of_two_ranks(tmp_path):
    """With trace on, rank 0 sends a ``lane`` event each step (real mpiexec ranks): its own measured
    spans and bucket flights, rank 1's estimated compute and wait inside the same step; none without
    trace. The notebook's live swim-lane (plots.LivePlot) builds from them: the last steps, both ranks."""
    from pilab import plots
    from pilab.plots import run as tp

    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", LANE_RUN, str(tmp_path / "ev.json")],
                       capture_output=True, text=True, timeout=180, env=mpi_env(), cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads((tmp_path / "ev.json").read_text())
    assert not [e for e in got["False"] if e["kind"] == "lane"]
    events = got["True"]
    steps = [e["global_step"] for e in events if e["kind"] == "step"]
    lanes = [e for e in events if e["kind"] == "lane"]
    assert steps == [e["global_step"] for e in lanes] == list(range(1, 4))
    last_end = 0.0
    for e in lanes:
        mine = {n: (b, t) for r, n, b, t, est in e["spans"] if r == 0 and not est}
        assert list(mine) == ["data", "forward", "backward", "wait", "optimizer"], e
        assert all(b <= t for b, t in mine.values()) and mine["data"][0] >= last_end
        last_end = mine["optimizer"][1]
        other = {n: (b, t) for r, n, b, t, est in e["spans"] if r == 1}
        assert all(est for r, *_, est in e["spans"] if r == 1) and list(other) == ["data+forward+backward", "wait"]
        assert other["data+forward+backward"][0] == mine["data"][0] < other["data+forward+backward"][1]
        assert other["wait"][1] == mine["wait"][1]  # rank 0 saw the last gradient averaged: the step's exchange ended
        assert e["flights"] and all(r == 0 and mine["backward"][0] <= a <= b for r, _, nb, a, b in e["flights"])
    live = plots.LivePlot()
    assert not live.lanes.figure.visible
    for e in events:
        live(e)
    cols = live.lanes.source.data
    assert live.lanes.figure.visible and set(cols["rank"]) == {0, 1}
    assert sorted(set(cols["step"])) == steps[-tp.LANE_STEPS:]
    assert min(cols["left"]) == 0.0 and all(a <= b for a, b in zip(cols["left"], cols["right"]))
    assert {n for n, r in zip(cols["name"], cols["rank"]) if r == 1} == {"data+forward+backward (estimated)",
                                                                         "wait (estimated)"}
    live({**events[0], "config": {**events[0]["config"], "trace": False}})  # a run without trace: hidden
    assert not live.lanes.figure.visible and not live.lanes.source.data["left"]


def test_panel_draws_the_lanes_of_a_traced_run():
    """The panel with trace ticked, training in this process (no engines): its live plot shows the
    swim-lane under the per-rank bars, holding the run's last steps; unticked, the next run hides it."""
    pytest.importorskip("ipywidgets")
    from pilab.config import Config
    from pilab.lab import widgets
    from pilab.plots import run as tp

    panel = widgets.ControlPanel(None, Config(width=0.25, train_subset=96, test_subset=50, batch_size=16,
                                              epochs=2, threads=1))
    lanes = panel.live.lanes
    assert lanes.figure in panel.live.layout.children and not lanes.figure.visible
    panel.controls["trace"].value = True
    panel.start()
    result = panel.wait(300)
    assert result and not result.get("stopped_early")
    assert lanes.figure.visible and set(lanes.source.data["rank"]) == {0}
    total = result["total_steps"]
    assert sorted(set(lanes.source.data["step"])) == list(range(total - tp.LANE_STEPS + 1, total + 1))
    panel.controls["trace"].value = False
    panel.start()
    panel.wait(300)
    assert not lanes.figure.visible and not lanes.source.data["step"]


@pytest.mark.parametrize("args, says", [(["--rates", "3furlongs"], "3furlongs"), (["--burst", "1000"], "65536")])
def test_testbed_validation_refuses_bad_settings_before_any_testbed(args, says, tmp_path):
    """experiments/perfmodel/validate_testbed.py: a bad rate or too small a token bucket is one line and
    exit 2, before a namespace exists (so nothing to take down, nothing written)."""
    p = subprocess.run([sys.executable, os.path.join(REPO, "experiments", "perfmodel", "validate_testbed.py"), *args,
                        "--out", str(tmp_path / "v")], capture_output=True, text=True, timeout=120, env=mpi_env(),
                       cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "v").exists()
