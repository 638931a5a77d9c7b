"""Reading traces (#39 items 2-3): the straggler table on synthetic traces built with pilab.trace.format
(the recorder's conventions), the `pilab trace` command, and the performance model's predicted trace.

    python -m pytest tests/test_trace_read.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from pilab.trace import format as tf
from pilab.trace.read import analyse, load, report

MS = 1e3  # microseconds per millisecond


def make_trace(path, hosts=2, per_host=2, steps=8, slow_rank=None, slow_hosts=(), buckets=4):
    """A measured-style trace: ``slow_rank`` computes 1.6x longer (a throttled CPU); the buckets of
    the ranks on ``slow_hosts`` (host indices) finish 25 ms late (a slow link between them)."""
    ev = [tf.process(h, f"node{h + 1:02d}") for h in range(hosts)]
    ranks = {r: r // per_host for r in range(hosts * per_host)}
    ev += [tf.thread(h, r, f"rank {r}") for r, h in ranks.items()]
    t0 = 0.0
    for s in range(steps):
        info = {"step": s, "epoch": 1}
        f = {r: 1.6 if r == slow_rank else 1.0 + 0.01 * ((r + s) % 3) for r in ranks}
        bwd_end = {r: t0 + (5 + 20 * f[r] + 40 * f[r]) * MS for r in ranks}
        done = {}
        for r in ranks:
            late = 25 * MS if ranks[r] in slow_hosts else 0.0
            for k in range(buckets):
                posted = t0 + (5 + 20 * f[r] + 40 * f[r] * (k + 1) / buckets) * MS
                end = max(bwd_end.values()) - (buckets - 1 - k) * 2 * MS + 3 * MS + late
                ev += tf.flight(f"bucket {k}", pid=ranks[r], tid=r, ts=posted, end=max(posted, end),
                                id=f"{r}-{s}-{k}", step=s, bucket=k, bytes=1 << 20)
                done[r] = max(posted, end)
        common = max(done.values())
        for r, h in ranks.items():
            ev += [tf.span("data", pid=h, tid=r, ts=t0, dur=5 * MS, **info),
                   tf.span("forward", pid=h, tid=r, ts=t0 + 5 * MS, dur=20 * f[r] * MS, **info),
                   tf.span("backward", pid=h, tid=r, ts=t0 + (5 + 20 * f[r]) * MS, dur=40 * f[r] * MS, **info),
                   tf.span("wait", pid=h, tid=r, ts=bwd_end[r], dur=common - bwd_end[r], **info),
                   tf.span("optimizer", pid=h, tid=r, ts=common, dur=4 * MS, **info)]
        t0 = common + 5 * MS
    tf.write(str(path), ev, meta={"kind": "measured", "np": len(ranks), "clock": {"offsets_us": [0.0] * len(ranks),
                                                                                "error_us": 40.0}})
    return path


def test_throttled_rank_named(tmp_path):
    a = analyse(load(str(make_trace(tmp_path / "t.json", slow_rank=3))), top=3)
    assert [x["who"] for x in a["slow"]] == ["rank 3 (node02)"] * 3
    assert {x["cause"] for x in a["slow"]} == {"compute"}
    rows = {t["rank"]: t for t in a["ranks"]}
    assert max(rows, key=lambda r: rows[r]["compute"]) == 3
    # the others waited for rank 3 at the end of backward; rank 3 waited for no one
    assert rows[3]["peer"] == 0 and all(rows[r]["peer"] > 0.02 for r in (0, 1, 2))
    c = a["critical"]
    assert c["median"] and abs(sum(c["shares"].values()) - 1) < 1e-9 and c["shares"]["compute"] > 0.5
    # on the critical path: the throttled rank, which waited for no one
    assert c["rank"] == 3 and c["path"]["peer"] == 0 and c["path_shares"]["compute"] > c["shares"]["compute"]
    assert "rank 3 (node02)" in report(a)


def test_slow_link_named(tmp_path):
    a = analyse(load(str(make_trace(tmp_path / "t.json", hosts=3, slow_hosts=(1, 2)))), top=2)
    assert [(x["cause"], x["who"]) for x in a["slow"]] == [("network", "link node02-node03")] * 2
    rows = {t["rank"]: t for t in a["ranks"]}
    assert all(rows[r]["network"] > 0.02 for r in rows)  # everyone's step waits for the late buckets


@pytest.mark.parametrize("hosts, per_host, slow, who", [(3, 1, (2,), "rank 2 (node03)"),
                                                        (2, 2, (1,), "host node02")], ids=["rank", "host"])
def test_late_buckets_named(tmp_path, hosts, per_host, slow, who):
    a = analyse(load(str(make_trace(tmp_path / "t.json", hosts=hosts, per_host=per_host, slow_hosts=slow))), top=1)
    assert (a["slow"][0]["cause"], a["slow"][0]["who"]) == ("network", who)


def test_two_hosts_all_late_is_their_link(tmp_path):
    a = analyse(load(str(make_trace(tmp_path / "t.json", slow_hosts=(0, 1)))), top=1)
    assert a["slow"][0]["who"] == "link node01-node02"


def test_one_rank_on_each_of_two_hosts_is_their_link(tmp_path):
    """Two ranks, one per host, one of them late: the link (every message crosses it; which end sees the
    late completion varies by step on a real slow link: tests/test_trace.py's testbed run)."""
    for slow in ((0,), (1,)):
        a = analyse(load(str(make_trace(tmp_path / f"t{slow}.json", per_host=1, slow_hosts=slow))), top=1)
        assert (a["slow"][0]["cause"], a["slow"][0]["who"]) == ("network", "link node01-node02")


def test_run_dir_and_step(tmp_path):
    make_trace(tmp_path / "trace.json", slow_rank=1)
    a = analyse(load(str(tmp_path)), step=5)
    assert a["critical"]["step"] == 5 and not a["critical"]["median"]
    with pytest.raises(ValueError, match="step 99 is not in the trace"):
        analyse(load(str(tmp_path)), step=99)
    r = _cli("trace", str(tmp_path), "--step", "99")
    assert r.returncode == 2 and r.stderr.startswith("pilab: error: --step 99: step 99 is not in the trace")
    assert not (tmp_path / "trace.html").exists()


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pilab", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_writes_html_and_png(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    make_trace(run / "trace.json", slow_rank=2)
    r = _cli("trace", str(run), "--top", "2", "--png", str(tmp_path / "step.png"))
    assert r.returncode == 0, r.stderr
    assert "rank 2 (node02)" in r.stdout and "critical path of the median step" in r.stdout
    html = (run / "trace.html").read_text()
    assert "Bokeh" in html and "cdn.bokeh.org" not in html  # BokehJS inline: opens offline
    assert not re.search(r"<script[^>]+src=", html)
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("content", [None, "not json", json.dumps({"traceEvents": [{"ph": "X"}]}),
                                     json.dumps({"traceEvents": []})])
def test_cli_bad_input(tmp_path, content):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_text(content)
    r = _cli("trace", str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "trace" in r.stderr
    assert not (tmp_path / "trace.html").exists()


def test_predicted_trace_is_predict(tmp_path):
    out = tmp_path / "pred.json"
    r = _cli("perfmodel", "trace", "--np", "48", "--cluster", "pi4b_cluster", "--out", str(out))
    assert r.returncode == 0, r.stderr
    doc = tf.read(str(out))  # validates
    meta = doc["otherData"]
    assert meta["kind"] == "predicted" and meta["np"] == 48
    from pilab.perfmodel import pi_config, predict
    step = predict(pi_config(), 48, "pi4b_cluster")["step_time"]
    ends = [e["ts"] + e["dur"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert max(ends) / 1e6 == pytest.approx(step, rel=1e-12)
    assert meta["prediction"]["step_time"] == step
    phases = {e["name"].split()[-1] for e in doc["traceEvents"] if e.get("cat") == "allreduce-phase"}
    assert phases == {"intra", "inter"}
    threads = {(e["pid"], e["tid"]) for e in doc["traceEvents"] if e["ph"] == "X"}
    assert len(threads) == 48 and len({p for p, _ in threads}) == 24
    a = analyse(doc)  # the reader reads a predicted trace too
    assert a["kind"] == "predicted" and a["critical"]["time"] == pytest.approx(step, rel=1e-9)


def test_validate_table(tmp_path):
    """A predicted trace validated against itself: every error 0."""
    out = tmp_path / "pred.json"
    assert _cli("perfmodel", "trace", "--np", "4", "--cluster", "pi4b_cluster", "--width", "0.25",
                "--out", str(out)).returncode == 0
    from pilab.trace.predict import compare
    v = compare(tf.read(str(out)), tf.read(str(out)))
    assert v["step"]["error"] == pytest.approx(0, abs=1e-9)
    assert all(b["error"] == pytest.approx(0, abs=1e-9) for b in v["buckets"]) and v["buckets"]


def test_validate_cli(tmp_path):
    """`perfmodel validate` predicts the measured trace's own config and np; goals given on the command
    line are judged (a synthetic trace is far from a Pi's step: a miss, shown)."""
    from pilab.config import Config
    path = make_trace(tmp_path / "trace.json", slow_rank=None)
    doc = tf.read(str(path))
    cfg = Config(width=0.25, train_subset=960, test_subset=200)
    tf.write(str(path), doc["traceEvents"], meta={**doc["otherData"], "config": cfg.to_dict(), "np": 4})
    r = _cli("perfmodel", "validate", str(path), "--step-goal", "0.1", "--tail-goal", "0.2",
             "--out", str(tmp_path / "v.json"), "--predicted-out", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr
    assert "bucket 0" in r.stdout and "MISS (goal 10%)" in r.stdout
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["np"] == 4 and v["step"]["measured"] == pytest.approx(0.073, rel=0.05)
    assert tf.read(str(tmp_path / "p.json"))["otherData"]["np"] == 4
    bare = make_trace(tmp_path / "bare.json")  # no config in its meta
    r = _cli("perfmodel", "validate", str(bare))
    assert r.returncode == 2 and "no config" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, words", [(["--np", "49"], "exceeds pi4b_cluster"),
                                         (["--np", "4", "--profile", "naive"], "profile='naive'"),
                                         (["--np", "0"], "--np 0")], ids=["np", "profile", "np0"])
def test_perfmodel_trace_bad_input(tmp_path, args, words):
    r = _cli("perfmodel", "trace", *args, "--out", str(tmp_path / "p.json"))
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("algorithm", ["mpich", "ring", "recursive_doubling", "rabenseifner", "hierarchical"])
def test_allreduce_phases_add_up_to_its_time(algorithm):
    """The phases a predicted trace draws are allreduce_time's own rounds, split by link."""
    from pilab import perfmodel as pm
    cl = pm.pi4b_cluster()
    phases = pm.allreduce_phases(4e6, 48, cl, algorithm)
    assert sum(t for _, t in phases) == pytest.approx(pm.allreduce_time(4e6, 48, cl, algorithm), rel=1e-12)
    # a ring's every round has a flow between nodes: all of it is inter-node
    assert {k for k, _ in phases} == ({"inter"} if algorithm == "ring" else {"intra", "inter"})
    if algorithm == "hierarchical":  # reduce inside the node, leaders across, broadcast inside
        assert [k for k, _ in phases] == ["intra", "inter", "intra"]


def test_committed_example_is_what_the_reader_says():
    """experiments/perfmodel/trace-example: the testbed trace, its prediction and the validation JSON the
    driver wrote agree with the reader as it is now."""
    import os
    from pilab.trace.predict import compare
    d = os.path.join(os.path.dirname(__file__), "..", "experiments", "perfmodel", "trace-example")
    measured = load(os.path.join(d, "trace-200mbit.json"))
    a = analyse(measured)
    assert (a["kind"], a["np"], a["steps"]) == ("measured", 2, 40)
    v = compare(measured, load(os.path.join(d, "predicted-200mbit.json")))
    with open(os.path.join(d, "validation.json")) as f:
        saved = json.load(f)["rates"]["200mbit"]
    assert v["step"]["error"] == pytest.approx(saved["step"]["error"], rel=1e-9)
    assert [b["error"] for b in v["buckets"]] == pytest.approx([b["error"] for b in saved["buckets"]], rel=1e-9)


def test_uneven_shares_priced_against_equal_ones(tmp_path):
    # rank 1 at half rank 0's speed (2 ms an image against 1 ms) with shares 16/8 of 24: both busy 16 ms, then
    # a 4 ms optimizer; at equal shares (12/12) rank 1 would have taken 24 ms: each step 8 ms longer
    ev = [tf.process(0, "node01"), tf.process(1, "node02"), tf.thread(0, 0, "rank 0"), tf.thread(1, 1, "rank 1")]
    per_image, shares, t0 = {0: 1.0, 1: 2.0}, {0: 16, 1: 8}, 0.0
    for s in range(1, 7):
        for r in (0, 1):
            b = shares[r]
            info = {"step": s, "epoch": 1, "images": b}
            ev += [tf.span("data", pid=r, tid=r, ts=t0, dur=0.25 * b * per_image[r] * MS, **info),
                   tf.span("forward", pid=r, tid=r, ts=t0 + 0.25 * b * per_image[r] * MS,
                           dur=0.25 * b * per_image[r] * MS, **info),
                   tf.span("backward", pid=r, tid=r, ts=t0 + 0.5 * b * per_image[r] * MS,
                           dur=0.5 * b * per_image[r] * MS, **info),
                   tf.span("wait", pid=r, tid=r, ts=t0 + 16 * MS, dur=0.0, **info),
                   tf.span("optimizer", pid=r, tid=r, ts=t0 + 16 * MS, dur=4 * MS, **info)]
        t0 += 21 * MS
    tf.write(str(tmp_path / "t.json"), ev, meta={"kind": "measured", "np": 2, "config": {"balance": "static"}})
    a = analyse(load(str(tmp_path / "t.json")))
    b = a["balance"]
    assert b["shares"] == b["first"] == [16, 8] and b["steps"] == 6 and b["mode"] == "static"
    assert b["step"] == pytest.approx(0.020) and b["equal"] == pytest.approx(0.028)
    text = report(a)
    assert "balance static: each rank's share of the 24 images a step, 16/8 at the end." in text
    assert "the median step took 20.0 ms; at equal shares (12/12) the same per-image times give ≈ 28.0 ms " \
           "(1.40× the measured step)" in text
    # a trace without shares (or equal ones in a run without balance) says nothing of them
    assert analyse(load(str(make_trace(tmp_path / "u.json"))))["balance"] is None
    assert "balance" not in report(analyse(load(str(make_trace(tmp_path / "u.json")))))
