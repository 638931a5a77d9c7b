"""pilab.lab.cluster against real ipyparallel engines that are MPI ranks (mpiexec -n 2 on this machine).

One cluster serves most tests (starting one costs ~8 s); the test that kills an engine starts its own.
Timings are written to test-artifacts/cluster_timings.json.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

pytest.importorskip("ipyparallel")
pytest.importorskip("mpi4py")

from ipyparallel import interactive  # noqa: E402  (engines get these test helpers by value)

from pilab.lab import cluster  # noqa: E402
from pilab.config import Config  # noqa: E402

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "test-artifacts")
TIMINGS: dict = {}

# A few seconds per run on 2 shared cores: 256 images, 8 steps of 16 per rank per epoch.
TINY = Config(width=0.25, train_subset=256, test_subset=128, epochs=1, batch_size=16, threads=1)


def _save_timings():
    os.makedirs(ARTIFACTS, exist_ok=True)
    with open(os.path.join(ARTIFACTS, "cluster_timings.json"), "w") as f:
        json.dump(TIMINGS, f, indent=1)


@pytest.fixture(scope="module")
def lab():
    t = time.monotonic()
    lab = cluster.start(n=2)
    TIMINGS["start_s"] = round(time.monotonic() - t, 2)
    yield lab
    t = time.monotonic()
    lab.stop()
    TIMINGS["stop_s"] = round(time.monotonic() - t, 2)
    _save_timings()


def _first_step(run, timeout=120):
    deadline = time.monotonic() + timeout
    while not any(e.get("kind") == "step" for e in run.events):
        assert not run.done, f"run ended before its first step: {run.describe()}"
        assert time.monotonic() < deadline, "no step event within the timeout"
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# profiles (no engines)
# ----------------------------------------------------------------------------------------------
def test_mpi_profile_names_mpiexec_by_absolute_path(monkeypatch):
    # A notebook kernel's PATH often lacks the venv's bin: the profile must not rely on it.
    import ipyparallel as ipp

    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("PILAB_MPIEXEC", raising=False)
    c = ipp.Cluster(profile_dir=cluster.profile_dir("mpi"))
    cmd = c.config.MPIEngineSetLauncher.mpi_cmd
    assert os.path.isabs(cmd[0]) and os.access(cmd[0], os.X_OK), cmd
    assert cmd[0] == os.path.join(os.path.dirname(sys.executable), "mpiexec")
    assert c.engine_launcher_class.__name__ == "MPIEngineSetLauncher"


def test_pi_profile_settings(tmp_path, monkeypatch):
    import ipyparallel as ipp

    template = os.path.join(cluster.profile_dir("pi"), "hosts.template")
    assert cluster.hostfile_slots(template) == 48  # 24 nodes x 2 ranks
    hosts = tmp_path / "hosts"
    hosts.write_text("# two boards\nnode1:2\nnode2:2\n")
    monkeypatch.setenv("PILAB_HOSTFILE", str(hosts))
    monkeypatch.delenv("PILAB_CONTROLLER_IP", raising=False)
    # The real lan_address would resolve node1 through DNS (traffic off this machine): record the call.
    asked = []
    monkeypatch.setattr(cluster, "lan_address", lambda hostfile: asked.append(hostfile) or "192.0.2.10")
    cfg = ipp.Cluster(profile_dir=cluster.profile_dir("pi")).config
    assert cfg.Cluster.n == 4
    assert cfg.MPIEngineSetLauncher.mpi_args == ["-f", str(hosts)]
    assert os.path.isabs(cfg.MPIEngineSetLauncher.mpi_cmd[0])
    # The address that routes to the boards of this hostfile: listened on (not localhost, which would keep
    # engines on other boards from ever registering, nor every interface) and told to the engines.
    assert cfg.Cluster.controller_ip == cfg.Cluster.controller_location == "192.0.2.10"
    assert asked == [str(hosts)]
    assert cfg.Cluster.engine_timeout >= 120


def test_lan_address_skips_loopback_routes_and_falls_back(tmp_path, monkeypatch):
    # Only loopback and IP literals: a UDP connect to them sends nothing and needs no name lookup.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n127.0.0.3:2\n")
    monkeypatch.setattr(cluster.profiles, "non_loopback_addresses", lambda: ["192.0.2.7"])
    assert cluster.lan_address(str(hosts)) == "192.0.2.7"  # a route over lo is no LAN address
    monkeypatch.setattr(cluster.profiles, "non_loopback_addresses", lambda: [])
    assert cluster.lan_address(str(hosts)) == "127.0.0.1"  # then only local engines can register
    assert cluster.lan_address(str(tmp_path / "missing")) == "127.0.0.1"


def test_pi_profile_without_hostfile_says_what_to_do(tmp_path, monkeypatch):
    # ipyparallel would log the config error and start engines on localhost; start() refuses.
    monkeypatch.setenv("PILAB_HOSTFILE", str(tmp_path / "missing"))
    with pytest.raises(cluster.ClusterError, match="hosts.template"):
        cluster.start(profile="pi", n=None)


def _loopback_alias() -> str:
    """127.0.0.2: loopback (all of 127.0.0.0/8 is on Linux), yet not the 127.0.0.1 profile_mpi uses."""
    alias = "127.0.0.2"
    try:
        with socket.socket() as s:
            s.bind((alias, 0))
    except OSError as e:  # e.g. macOS configures only 127.0.0.1 on lo0
        pytest.skip(f"cannot bind the loopback alias {alias} ({e}); the test needs no other address")
    return alias


def test_pi_profile_engines_register_over_a_loopback_alias(tmp_path, monkeypatch):
    # The controller listens on, and advertises, only the address the profile is given. The loopback-only
    # variant (runs anywhere); across real hosts -- engines in network namespaces reaching the head
    # node's bridge address -- see tests/test_testbed.py::test_pi_profile_engines_register_across_the_nodes.
    addr = _loopback_alias()
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    monkeypatch.setenv("PILAB_HOSTFILE", str(hosts))
    monkeypatch.setenv("PILAB_CONTROLLER_IP", addr)
    lab = cluster.start(profile="pi", n=None)
    try:
        assert lab.size == 2
        info = json.load(open(lab.ipp_cluster.cluster_file))["cluster"]
        assert info["controller_ip"] == addr and info["controller_location"] == addr
        # The engines reached the controller on that address (it listens on nothing else).
        engine_info = json.load(open(os.path.join(lab.ipp_cluster.profile_dir, "security",
                                                  f"ipcontroller-{lab.ipp_cluster.cluster_id}-engine.json")))
        assert engine_info["location"] == addr, engine_info
        assert engine_info["interface"] == f"tcp://{addr}", engine_info
        assert [r["rank"] for r in lab.ranks] == [0, 1]
        assert lab.apply(_allreduce_rank) == [1, 1]
    finally:
        lab.stop()


@interactive
def _allreduce_rank():
    from mpi4py import MPI

    return MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank())


# ----------------------------------------------------------------------------------------------
# one cluster of 2 engines
# ----------------------------------------------------------------------------------------------
def test_engines_map_to_ranks_in_rank_order(lab):
    assert lab.size == 2
    assert [r["rank"] for r in lab.ranks] == [0, 1]
    for r in range(lab.size):
        # Ask each engine directly: the map must agree with what the engine says.
        assert lab.client[lab.engine(r)].apply_sync(cluster.whoami)["rank"] == r
        assert lab.rank_of(lab.engine(r)) == r
    assert [w["rank"] for w in lab.apply(cluster.whoami)] == [0, 1]
    assert lab.view.targets == lab.engine_ids
    assert lab.missing() == []
    assert "rank  1 = engine" in repr(lab)


def test_connect_attaches_without_owning(lab):
    # What a notebook does after `ipcluster start` in a shell: attach, use, disconnect.
    other = cluster.connect(profile=lab.ipp_cluster.profile_dir, cluster_id=lab.ipp_cluster.cluster_id)
    try:
        assert not other.owned and other.engine_ids == lab.engine_ids
        assert [w["rank"] for w in other.apply(cluster.whoami)] == [0, 1]
    finally:
        other.stop()  # only disconnects
    assert lab.apply(cluster.whoami)[1]["rank"] == 1  # the engines are still there


def test_stop_ends_all_ranks_within_a_step_and_a_second_run_works(lab):
    events = []
    run = lab.train(replace(TINY, epochs=50), callbacks=[events.append])
    _first_step(run)
    steps = [e for e in events if e.get("kind") == "step"]
    step_s = max(e["time"] for e in steps)
    t = time.monotonic()
    run.stop()
    result = run.wait(timeout=120)
    latency = time.monotonic() - t
    TIMINGS["stop_latency_s"], TIMINGS["step_s"] = round(latency, 2), round(step_s, 3)
    assert result["stopped_early"] is True and run.status == "stopped"
    assert result["np"] == 2
    assert latency < step_s + 10, (latency, step_s)
    # Every engine finished its task (none left training) and both are idle again.
    assert run.ar.ready() and all(v == 0 for k, v in lab.client.queue_status().items()
                                  if k in lab.engine_ids for v in [v["tasks"]])
    assert [e["kind"] for e in events][0] == "start" and events[-1]["kind"] == "end"

    # The same engines train again, to the end this time.
    t = time.monotonic()
    run2 = lab.train(replace(TINY, max_steps=3))
    result2 = run2.wait(timeout=180)
    TIMINGS["second_run_s"] = round(time.monotonic() - t, 2)
    assert run2.status == "done" and result2["stopped_early"] is False
    assert len(result2["steps"]["loss"]) == 3
    TIMINGS["losses_local_data"] = result2["steps"]["loss"]


# A second client, as a notebook kernel would be: it attaches to the engines, trains, blocks in
# run.wait(), and gets SIGINT from the test (what JupyterLab's stop button sends the kernel).
_WAITING_CLIENT = """
import json, pickle, sys, time
from pilab.lab import cluster
profile, cluster_id, cfg = sys.argv[1], sys.argv[2], pickle.loads(bytes.fromhex(sys.argv[3]))
lab = cluster.connect(profile=profile, cluster_id=cluster_id)
try:
    run = lab.train(cfg)
    deadline = time.monotonic() + 120
    while not any(e.get("kind") == "step" for e in run.events):
        assert not run.done and time.monotonic() < deadline, run.describe()
        time.sleep(0.05)
    print("waiting", flush=True)
    result = run.wait(timeout=120)
    print(json.dumps({"stopped_early": result["stopped_early"], "status": run.status}), flush=True)
finally:
    lab.stop()
"""


def test_interrupting_a_wait_stops_the_run(lab, tmp_path):
    # A kernel interrupt while a cell blocks in run.wait() (or panel.wait()) is a KeyboardInterrupt
    # in the waiting thread: wait() turns it into run.stop() and keeps waiting for the ranks.
    # The SIGINT goes to a client process of its own, never to pytest.
    err_file = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-c", _WAITING_CLIENT, lab.ipp_cluster.profile_dir, lab.ipp_cluster.cluster_id,
           pickle.dumps(replace(TINY, epochs=50)).hex()]
    with open(err_file, "w") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
    try:
        _read_line(p, "waiting", timeout=180)
        time.sleep(0.5)  # well inside run.wait() by now
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out + err_file.read_text()
        (line,) = [x for x in out.splitlines() if x.startswith("{")]
        assert json.loads(line) == {"stopped_early": True, "status": "stopped"}
        assert "interrupted: every rank stops after its current step" in err_file.read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
            lab.interrupt()  # the run it left behind: free the engines for the next test
        _wait_idle(lab, timeout=60)


def _read_line(p: subprocess.Popen, expected: str, timeout: float) -> None:
    """Wait for the line ``expected`` on ``p``'s stdout (fail if it exits or the time is up first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.5)
        if ready:
            line = p.stdout.readline()
            if line.strip() == expected:
                return
            assert line, f"the client exited (rc={p.wait()}) before printing {expected!r}"
    raise AssertionError(f"the client did not print {expected!r} within {timeout} s")


def _wait_idle(lab, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(q["tasks"] or q["queue"] for eid, q in lab.client.queue_status().items()
              if eid in lab.engine_ids):
        assert time.monotonic() < deadline, "the engines are still busy"
        time.sleep(0.2)


def test_scattered_shards_equal_local_loading(lab):
    # Rank 0 alone reads the data; the others get their shard by Scatterv and must hold exactly the
    # rows a local load would give them.
    checks = lab.apply(_check_scatter, TINY.seed, timeout=180)
    for r, c in enumerate(checks):
        assert c["rank"] == r and c["shard_rows_equal"] and c["test_rows_equal"], c
        assert c["loader_shard_size"] == c["expected_shard_size"]
    if "losses_local_data" not in TIMINGS:
        pytest.skip("needs the run of the previous test to compare losses")
    result = lab.train(replace(TINY, max_steps=3), scatter=True).wait(timeout=180)
    assert result["steps"]["loss"] == TIMINGS["losses_local_data"]


@interactive
def _check_scatter(seed):
    import numpy as np
    from mpi4py import MPI

    from pilab.lab import cluster as cl
    from pilab import data

    comm = MPI.COMM_WORLD
    full = data.load("embedded", train_subset=256, test_subset=128, seed=seed)
    local = cl.scatter_shards(full if comm.rank == 0 else None, comm, seed=seed)
    shard = data.static_shards(full.y_train, comm.size, seed)[comm.rank]
    sl = data.test_shard(len(full.y_test), comm.size, comm.rank)
    loader = data.ShardLoader(local, comm.size, comm.rank, 16, seed=seed)
    return {"rank": comm.rank,
            "shard_rows_equal": bool(np.array_equal(local.x_train[shard], full.x_train[shard])
                                     and np.array_equal(local.y_train, full.y_train)),
            "test_rows_equal": bool(np.array_equal(local.x_test[sl], full.x_test[sl])),
            "loader_shard_size": loader.shard_size, "expected_shard_size": len(shard)}


def test_fewer_processes_run_on_a_sub_communicator(lab):
    run = lab.train(replace(TINY, max_steps=2), np_=1)
    result = run.wait(timeout=180)
    assert result["np"] == 1 and result["global_batch"] == TINY.batch_size
    assert run.ar.get()[1] == {"rank": 1, "idle": True}
    with pytest.raises(cluster.ClusterError, match="between 1 and the 2"):
        lab.train(TINY, np_=3)


def test_px_cell_interrupt_sets_the_stop_flag(lab):
    # What `%%px` does on a kernel interrupt: SIGINT to the engines while the cell runs.
    lab.push(cfg=replace(TINY, epochs=50))
    ar = lab.view.execute(
        "from mpi4py import MPI\nfrom pilab import engine\nfrom pilab.lab import cluster\n"
        "cbs = [cluster.publish] if MPI.COMM_WORLD.rank == 0 else []\n"
        "with cluster.stop_flag() as stop:\n"
        "    result, model = engine.fit(cfg, engine.MPIRanks(MPI.COMM_WORLD), stop=stop, callbacks=cbs)\n",
        block=False)
    deadline = time.monotonic() + 120
    while len(ar.data[0]) < 2:  # start + one step published by rank 0: the loop is running
        assert not ar.ready(), ar.get()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    t = time.monotonic()
    lab.client.send_signal("SIGINT", targets=[lab.engine(0)], block=True)
    ar.get(timeout=60)
    TIMINGS["px_interrupt_latency_s"] = round(time.monotonic() - t, 2)
    assert all(r["stopped_early"] for r in lab.view.pull("result", block=True))
    # rank_state gathers in rank order and shows on rank 0 only.
    lab.view.execute("t = cluster.rank_state(MPI.COMM_WORLD, model, result)", block=True)
    tables = lab.view.pull("t", block=True)
    assert tables[1] is None and [row["rank"] for row in tables[0]] == [0, 1]
    assert [row["shard_size"] for row in tables[0]] == [128, 128]
    # BN running stats were broadcast from rank 0 before evaluation.
    assert tables[0][0]["bn_running_mean"] == tables[0][1]["bn_running_mean"]
    assert "bn_running_mean" in repr(tables[0])


def test_a_stuck_rank_is_reported_not_waited_for(lab):
    run = lab.train(replace(TINY, epochs=50), hang_s=4)
    _first_step(run)
    pid = lab.ranks[1]["pid"]
    os.kill(pid, signal.SIGSTOP)  # rank 1 freezes; rank 0 waits for it in the allreduce
    try:
        t = time.monotonic()
        with pytest.raises(cluster.ClusterError, match="no progress") as err:
            run.wait(timeout=60)
        TIMINGS["hang_reported_s"] = round(time.monotonic() - t, 2)
        assert "rank 1: stopped" in str(err.value)
        assert run.status == "hung"
    finally:
        os.kill(pid, signal.SIGCONT)
    # Rank 1 resumes; stop the run so the cluster is free again.
    lab.interrupt()
    run.ar.get(timeout=60)


# ----------------------------------------------------------------------------------------------
# a rank that dies (own cluster: MPI ends the whole job)
# ----------------------------------------------------------------------------------------------
def test_a_killed_engine_is_reported_not_a_hang():
    lab = cluster.start(n=2)
    try:
        run = lab.train(replace(TINY, epochs=50))
        _first_step(run)
        os.kill(lab.ranks[1]["pid"], signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(cluster.ClusterError, match="died") as err:
            run.wait(timeout=60)
        TIMINGS["death_reported_s"] = round(time.monotonic() - t, 2)
        assert "rank 1" in str(err.value) and run.status == "died"
        assert 1 in lab.missing()
        with pytest.raises(cluster.ClusterError, match="rank 1"):
            lab.train(TINY)
        with pytest.raises(cluster.ClusterError, match="rank 1"):
            lab.apply(cluster.whoami, timeout=30)
    finally:
        t = time.monotonic()
        lab.stop()
        TIMINGS["stop_after_death_s"] = round(time.monotonic() - t, 2)
        _save_timings()
