"""Uneven per-rank shares set by speed (``Config.balance``, pilab.engine.balance): the policy on its own
(given, measured and re-measured speeds, the threshold, checkpoints)."""
import re

import pytest

from pilab.config import Config, ConfigError
from pilab.engine.balance import THRESHOLD, WINDOW, Shares


def parse(value, np_=None):
    return Config(balance=value, sharding="reshuffle").balance_plan(np_)


def test_parse_modes_and_given_speeds():
    assert parse("off") == ("off", None) and parse("dynamic") == ("dynamic", None)
    assert parse("static:2,1") == ("static", [2.0, 1.0])
    assert parse("static:1x2,2.5x3", np_=5) == ("static", [1.0, 1.0, 2.5, 2.5, 2.5])
    for bad, words in [("fast", "use off, static"), ("dynamic:2,1", "use off, static"),
                       ("static:2,0", "not SPEED or SPEEDxCOUNT"), ("static:1x0", "not SPEED"),
                       ("static:a", "not SPEED")]:
        with pytest.raises(ConfigError, match=words):
            parse(bad)
    with pytest.raises(ConfigError, match="gives 2 speeds for 3 ranks"):
        parse("static:2,1", np_=3)
    for other, words in [({}, "sharding=static"), ({"sharding": "reshuffle", "local_steps": 2}, "local SGD"),
                         ({"sharding": "reshuffle", "bn": "sync"}, "bn=sync"),
                         ({"sharding": "reshuffle", "ghost_batch": 8}, "ghost_batch")]:
        with pytest.raises(ConfigError, match=words):
            Config(balance="static", **other)


def _run(sh, speeds_by_step, steps, per_step=0.0):
    """Feed ``steps`` steps whose rank r trains share_r images at speeds_by_step(step)[r] images/s
    (plus ``per_step`` seconds each step whatever the share); returns the steps where the shares changed."""
    changed = []
    for step in range(steps):
        busy = [per_step + b / s for b, s in zip(sh.shares, speeds_by_step(step))]
        if sh.observe(step, busy) is not None:
            changed.append(step + 1)
    return changed


def test_given_speeds_set_the_shares_from_the_first_step_and_never_move():
    sh = Shares("static", 2, 64, given=[2.0, 1.0])
    assert sh.shares == [43, 21]
    assert _run(sh, lambda s: [1.0, 1.0], 5 * WINDOW) == [] and sh.shares == [43, 21]


def test_static_measures_once_then_keeps_the_shares():
    sh = Shares("static", 2, 64)
    assert sh.shares == [32, 32]
    # rank 1 at half speed: after one window the shares follow; later changes are not followed
    changed = _run(sh, lambda s: [100.0, 50.0] if s < 3 * WINDOW else [100.0, 100.0], 6 * WINDOW, per_step=0.01)
    assert changed == [WINDOW] and sh.shares in ([43, 21], [42, 22])  # 2:1, a little less for the per-step work
    assert sh.changes[0]["step"] == WINDOW and sh.changes[0]["speeds"][1] < 0.6 * sh.changes[0]["speeds"][0]


def test_dynamic_follows_a_node_throttled_mid_run_within_two_windows():
    sh = Shares("dynamic", 2, 64)
    at = 5 * WINDOW + 3  # node02 throttled to half speed here, mid-window
    changed = _run(sh, lambda s: [100.0, 100.0] if s < at else [100.0, 50.0], 10 * WINDOW, per_step=0.002)
    assert sh.shares == [43, 21]
    assert len(changed) == 1 and at < changed[0] <= at + 2 * WINDOW, changed


def test_dynamic_corrects_a_split_made_from_a_window_the_throttle_cut_in_half():
    # node02 throttled half-way through a window: its median speed is between the two, so the first split
    # falls short (the testbed's bench, round 3: shares 37/27 where 43/21 were due); the next window, at the
    # new shares, has node02's new speed and the shares follow it -- then stay
    sh = Shares("dynamic", 2, 64)
    at = 5 * WINDOW + WINDOW // 2
    changed = _run(sh, lambda s: [100.0, 100.0] if s < at else [100.0, 50.0], 12 * WINDOW, per_step=0.002)
    assert sh.shares == [43, 21] and len(changed) == 2, (changed, sh.changes)
    assert sh.changes[0]["shares"][1] > 21 and changed[1] == changed[0] + WINDOW, sh.changes


def test_a_uniform_cluster_keeps_equal_shares_and_noise_moves_nothing():
    sh = Shares("static", 3, 48)
    assert _run(sh, lambda s: [100.0, 95.0 if s % 2 else 105.0, 100.0], 3 * WINDOW) == [] and sh.shares == [16] * 3
    sh = Shares("dynamic", 3, 48)
    slow = 1 - THRESHOLD / 2  # a rank 7.5% slower, now and then: noise, not a new board
    assert _run(sh, lambda s: [100.0, 100.0 * (slow if s % 3 else 1), 100.0], 10 * WINDOW) == []
    assert sh.shares == [16, 16, 16]


def test_checkpoint_keeps_the_shares_at_the_same_np_and_batch_only():
    sh = Shares("static", 2, 64, given=[3.0, 1.0])
    state = sh.state_dict()
    again = Shares("static", 2, 64)
    again.load_state_dict(state)
    assert again.shares == [48, 16] and again.speeds == [3.0, 1.0]
    other = Shares("static", 3, 96)
    other.load_state_dict(state)  # another np: measured again
    assert other.shares == [32, 32, 32] and other.speeds is None


# ---- over real MPI ranks (tests/mpi_worker.py's "balance" case) against the simulator ----------------------
def _launch(np_, tmp_path_factory):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import MPIEXEC, mpi_env
    out = tmp_path_factory.mktemp(f"balance{np_}") / "res.json"
    cmd = [MPIEXEC, "-n", str(np_), sys.executable, str(Path(__file__).parent / "mpi_worker.py"), "balance", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return np_, json.loads(out.read_text())


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def uneven(request, tmp_path_factory):
    return _launch(request.param, tmp_path_factory)


@pytest.mark.mpi
def test_uneven_shares_run_bit_for_bit_as_in_the_simulator(uneven):
    np_, r = uneven
    assert max(r["simulator_diff_per_rank"]) == 0.0, r["simulator_diff_per_rank"]
    assert r["loss"] == r["simulator_loss"] and r["test_acc"] == r["simulator_test_acc"]
    # shares that change every step (a component through the seam) too
    assert max(r["moved_diff_per_rank"]) == 0.0, r["moved_diff_per_rank"]
    assert r["moved_loss"] == r["simulator_moved_loss"]


@pytest.mark.mpi
def test_result_json_records_the_shares(uneven):
    np_, r = uneven
    want = {2: [12, 4], 3: [12, 8, 4]}[np_]  # static:3,1 / 3,2,1 of a global batch of 8 x np
    assert r["global_batch"] == 8 * np_
    for b in (r["balance"], r["simulator_balance"]):
        assert b["mode"] == "static" and b["first"] == want and b["shares"] == want and b["changes"] == []


@pytest.mark.mpi
def test_every_image_once_an_epoch_with_shares_changing_every_step(uneven):
    np_, r = uneven
    B, spe = r["global_batch"], r["steps_per_epoch"]
    assert sorted(map(tuple, ((e, s, k) for e, s, k, _ in r["used"]))) == \
        sorted((e, s, k) for e in range(2) for s in range(spe) for k in range(np_))
    for epoch in range(2):
        rows = [u for u in r["used"] if u[0] == epoch]
        images = [i for *_, idx in rows for i in idx]
        assert len(images) == len(set(images)) == spe * B  # none twice; all but the leftover once
        assert r["n_train"] - len(images) < B
        for step in range(spe):  # each step: the ranks' shares, B in all, not all equal
            sizes = [len(idx) for e, s, k, idx in sorted(rows, key=lambda u: u[2]) if s == step]
            assert sum(sizes) == B and min(sizes) >= 1
        assert len({tuple(len(idx) for e, s, k, idx in sorted(rows, key=lambda u: u[2]) if s == step)
                    for step in range(spe)}) > 1
    sim = sorted(map(lambda u: (u[0], u[1], u[2], tuple(u[3])), r["simulator_used"]))
    assert sorted(map(lambda u: (u[0], u[1], u[2], tuple(u[3])), r["used"])) == sim


@pytest.mark.mpi
def test_a_mid_epoch_checkpoint_resumes_as_if_never_stopped(uneven):
    np_, r = uneven
    assert r["resumed_from_step"] == 3
    assert max(r["resume_diff_per_rank"]) == 0.0, r["resume_diff_per_rank"]
    assert r["resumed_loss"] == r["loss"][3:]


@pytest.mark.mpi
def test_static_measures_a_rank_held_to_a_fifth_of_a_core_and_gives_it_less(tmp_path):
    """Rank 1's process in a cgroup with 0.2 of a core (a real CPU quota: its wrapper moves itself in, then
    execs python), each rank pinned to a core of its own: after the first WINDOW steps at equal shares,
    --balance static gives rank 1 the smaller share, and keeps it."""
    import json
    import os
    import subprocess
    import sys

    from conftest import MPIEXEC, mpi_env, skip_or_fail
    from pilab import testbed
    try:
        cg = testbed.cpu_quota(f"pilab-balance-test-{os.getpid()}", 0.2)
    except testbed.TestbedError as e:
        skip_or_fail(str(e), "the measured shares must be tested")
    wrap = ["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$@"', "sh"]
    cores = sorted(os.sched_getaffinity(0))
    pin = [["taskset", "-c", str(cores[0])], ["taskset", "-c", str(cores[-1])]]
    args = [sys.executable, "-m", "pilab", "train", "--width", "0.25", "--batch-size", "16", "--threads", "1",
            "--sharding", "reshuffle", "--balance", "static", "--train-subset", str(3 * WINDOW * 32),
            "--test-subset", "50", "--epochs", "1", "--quiet", "--straggler-threshold", "0", "--out", str(tmp_path)]
    try:
        p = subprocess.run([MPIEXEC, "-n", "1", *pin[0], *args, ":", "-n", "1", *wrap, *pin[1], *args],
                           capture_output=True, text=True, timeout=300, env=mpi_env())
    finally:
        testbed.cpu_quota(os.path.basename(cg), 0)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(tmp_path / "result.json") as f:
        b = json.load(f)["balance"]
    assert b["mode"] == "static" and b["first"] == [16, 16]
    assert [c["step"] for c in b["changes"]] == [WINDOW], b  # measured once, over the first window
    assert sum(b["shares"]) == 32 and b["shares"][0] > 1.5 * b["shares"][1], b
    assert b["speeds"][1] < 0.6 * b["speeds"][0], b


@pytest.mark.mpi
def test_the_trace_records_each_ranks_share_and_says_what_it_bought(tmp_path):
    """A traced run with given shares 3:1 at np 2 under mpiexec: every step span of rank r in trace.json
    carries b_r, and `pilab trace` says the shares and prices the step at equal shares."""
    import json
    import subprocess
    import sys

    from conftest import MPIEXEC, mpi_env
    args = [sys.executable, "-m", "pilab", "train", "--width", "0.25", "--batch-size", "8", "--threads", "1",
            "--sharding", "reshuffle", "--balance", "static:3,1", "--train-subset", "256", "--test-subset", "50",
            "--epochs", "1", "--quiet", "--straggler-threshold", "0", "--trace", "--out", str(tmp_path)]
    p = subprocess.run([MPIEXEC, "-n", "2", *args], capture_output=True, text=True, timeout=300, env=mpi_env())
    assert p.returncode == 0, p.stdout + p.stderr
    with open(tmp_path / "trace.json") as f:
        doc = json.load(f)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] in ("data", "forward", "backward")]
    assert {e["tid"] for e in spans} == {0, 1}
    assert all(e["args"]["images"] == {0: 12, 1: 4}[e["tid"]] for e in spans)  # 3:1 of 16
    p = subprocess.run([sys.executable, "-m", "pilab", "trace", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "balance static:3,1: each rank's share of the 16 images a step, 12/4 at the end." in p.stdout
    line = next(x for x in p.stdout.splitlines() if x.startswith("the median step took"))
    assert re.fullmatch(r"the median step took \d+\.\d ms; at equal shares \(8/8\) the same per-image times "
                        r"give ≈ \d+\.\d ms \(\d+\.\d\d× the measured step\)", line), line


def test_the_live_panel_labels_each_ranks_bar_with_its_share():
    """The live plot and the control panel fed with a real run's events as rank 0 emitted them (the simulator
    with given shares 3:1 at np 2, exact: bit for bit as under mpiexec): each rank's bar and its axis label
    say its images a step, from the run's first step and again at each epoch."""
    pytest.importorskip("ipywidgets")
    import pilab
    from pilab import plots
    from pilab.lab import widgets

    events = []
    cfg = Config(width=0.25, batch_size=8, sharding="reshuffle", balance="static:3,1", simulate_mode="exact",
                 train_subset=128, test_subset=50, epochs=2, threads=1)
    pilab.simulate(cfg, 2, callbacks=[events.append])
    shares = [e for e in events if e["kind"] == "shares"]
    assert [(e["global_step"], e["shares"]) for e in shares] == [(1, [12, 4])]  # given: told once
    assert [e["shares"] for e in events if e["kind"] == "epoch"] == [[12, 4], [12, 4]]
    live = plots.LivePlot()
    panel = widgets.ControlPanel(None, live=live)
    seen = []
    for ev in events:
        live(ev)
        panel._on_event(ev)
        if ev["kind"] == "shares":
            seen = list(live.timeline.y_range.factors)
    assert seen == ["0 · 12 img", "1 · 4 img"]  # from the first step, before any epoch ended
    factors = list(live.timeline.y_range.factors)
    assert factors == ["0 · 12 img", "1 · 4 img"] and list(live.ranks.data["rank"]) == factors
    live({"kind": "straggler", "line": "x", "stragglers": [{"rank": 1, "kind": "compute", "slowdown": 0.5}]})
    assert list(live.timeline.y_range.factors) == ["0 · 12 img", "1 · 4 img ! compute +50%"]
    assert list(live.ranks.data["rank"]) == list(live.timeline.y_range.factors)
    # a new run's start clears the labels
    live(next(e for e in events if e["kind"] == "start"))
    assert list(live.timeline.y_range.factors) == ["0", "1"]


@pytest.mark.mpi
def test_resume_at_another_np_sets_the_shares_again(tmp_path):
    """A checkpoint made at np 3 with shares, resumed at np 2 (a fixed global batch: --batch-mode global), and
    the reverse, under mpiexec. Given speeds are one per rank: the np-3 run's three are refused at np 2 in
    one line naming the fix, two new ones run; measured shares are measured again at the new np."""
    import json
    import subprocess
    import sys

    from conftest import MPIEXEC, mpi_env
    common = ["--width", "0.25", "--batch-size", "24", "--batch-mode", "global", "--threads", "1", "--sharding",
              "reshuffle", "--train-subset", "480", "--test-subset", "50", "--epochs", "1", "--quiet",
              "--straggler-threshold", "0", "--hang-s", "0"]

    def train(np_, out, *flags):
        cmd = [MPIEXEC, "-n", str(np_), sys.executable, "-m", "pilab", "train", *common, "--out", str(out), *flags]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=mpi_env())

    def result(out):
        with open(out / "result.json") as f:
            return json.load(f)
    stop = WINDOW + 2  # of 20 steps: the measured shares of the first run are in its checkpoint
    given = tmp_path / "given"
    p = train(3, given, "--balance", "static:3,2,1", "--max-steps", str(stop), "--checkpoint-every-steps", str(stop))
    assert p.returncode == 0, p.stderr[-3000:]
    resume = ["--resume", str(given / "checkpoint.pt")]
    p = train(2, given, "--balance", "static:3,2,1", *resume)  # the flags it was made with
    assert p.returncode == 2, p.stderr[-3000:]
    said = [x for x in p.stderr.splitlines() if x.startswith("pilab: error:")]
    assert said == ["pilab: error: balance='static:3,2,1' gives 3 speeds for 2 ranks; give one per rank "
                    "(--balance static:S0,S1) or let them be measured (--balance static)"], p.stderr
    assert "Traceback" not in p.stderr
    p = train(2, given, "--balance", "static:3,1", *resume)
    assert p.returncode == 0, p.stderr[-3000:]
    r = result(given)
    assert r["np"] == 2 and r["resumed_from_np"] == 3 and r["global_batch"] == 24 and r["steps_done"] == 20
    assert r["balance"]["first"] == r["balance"]["shares"] == [18, 6] and r["balance"]["changes"] == []

    for before, after in ((3, 2), (2, 3)):  # measured shares: measured again
        out = tmp_path / f"measured{before}"
        p = train(before, out, "--balance", "static", "--max-steps", str(stop), "--checkpoint-every-steps", str(stop))
        assert p.returncode == 0, p.stderr[-3000:]
        assert result(out)["balance"]["speeds"] is not None  # its shares were measured before the checkpoint
        p = train(after, out, "--balance", "static", "--resume", str(out / "checkpoint.pt"))
        assert p.returncode == 0, p.stderr[-3000:]
        b = result(out)["balance"]
        assert result(out)["resumed_from_np"] == before and b["first"] == [24 // after] * after, b
        assert len(b["speeds"]) == after and sum(b["shares"]) == 24, b  # measured over the resumed run's steps
