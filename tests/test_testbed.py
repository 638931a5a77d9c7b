"""Multi-node runs over real TCP between network namespaces (pilab.testbed): one testbed user at a time,
shared memory inside a node and TCP between nodes, two nodes training exactly as one host, a host that
does not answer, a node's CPU throttled while a job runs, the Pi profile's engines across the nodes, and
a notebook run losing a node's link; on a shared cluster (docs/security.md), a stranger's forged failure
line to a running job's watchdog, a user's testbed whose jobs run as that user, a planted state directory.
After every job no process is left on any node: the shim's pid namespace ends whatever mpiexec started there. The faults of a CLI job (a lost link, a killed node, a
slow node, a slow link) are tests/test_longruns_testbed.py's, on one run each.

One testbed (2 nodes x 2 slots, 1 Gbit/s links) serves the module and is always torn down. Needs root,
`ip` and `tc`: skipped with the reason elsewhere, a failure under CI=true. Measurements (seconds, bytes)
go to test-artifacts/testbed.json; nothing here asserts a wall-clock time except the watchdog's
documented bound (hang_s + 30 s; in the notebook test as run.wait's timeout).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import holding_testbed, mpi_env, no_processes_left, run_on_testbed, skip_or_fail

from pilab import testbed

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(REPO, "test-artifacts")
RECORD: dict = {}
NAME = "pilabt"  # not the default testbed's name: a teacher's `testbed up` is left alone
SUBNET = "10.79.0.0/24"
TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet"]


def _need_testbed():
    why = testbed.available()
    if why:
        skip_or_fail(why, "CI runs as root here and must run the multi-node tests")


@pytest.fixture(scope="module")
def tb(request):
    _need_testbed()
    with holding_testbed(request):
        testbed.down(NAME)  # whatever a crashed earlier run left (a live one would hold the lock)
        t = time.monotonic()
        bed = testbed.up(testbed.Testbed(nodes=2, slots=2, rate="1gbit", subnet=SUBNET, name=NAME))
        RECORD["up_s"] = round(time.monotonic() - t, 2)
        try:
            yield bed
        finally:
            t = time.monotonic()
            testbed.down(NAME)
            RECORD["down_s"] = round(time.monotonic() - t, 2)
        os.makedirs(ARTIFACTS, exist_ok=True)
        with open(os.path.join(ARTIFACTS, "testbed.json"), "w") as f:
            json.dump(RECORD, f, indent=1)


def _train(tb, out, *extra, np_=4, env=None, timeout=300, popen=False):
    cmd = [sys.executable, "-m", "pilab", "train", "--np", str(np_), *TINY, "--out", str(out), *extra]
    env = tb.env(mpi_env()) if env is None else env
    if popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=REPO)
    return run_on_testbed(tb, cmd, env=env, timeout=timeout, cwd=REPO)


def _single_host_env():
    env = mpi_env()
    for k in testbed.Testbed().env_vars():
        env.pop(k, None)
    return env


# ----------------------------------------------------------------------------------------------
# the testbed itself
# ----------------------------------------------------------------------------------------------
def test_up_is_idempotent_and_refuses_a_range_in_use(tb):
    assert testbed.up(tb) == tb  # again: nothing to do, nothing broken
    st = testbed.status(NAME)
    assert st["namespaces"] == [tb.netns(h) for h in tb.hosts]
    assert all(n["link"] == "up" for n in st["nodes"].values())
    with open(tb.hostfile) as f:
        lines = [x for x in f.read().splitlines() if not x.startswith("#")]
    assert lines == ["10.79.0.11:2", "10.79.0.12:2"]  # addresses: no name lookup leaves the machine
    # the machine's own routes are off limits: take the range of its default interface
    ours = [str(n) for n, dev in testbed.routes_and_addresses() if not n.is_loopback and dev != tb.bridge]
    if ours:
        with pytest.raises(testbed.TestbedError, match="overlaps"):
            testbed.check_range(testbed.Testbed(nodes=1, subnet=ours[0], name="pilabx"))
    with pytest.raises(testbed.TestbedError, match="down"):
        testbed.up(testbed.Testbed(nodes=3, subnet=SUBNET, name=NAME))
    # Each node is its own host: hostname, address, no route off the bridge.
    p = tb.run_on("node02", ["sh", "-c", "hostname; ip -4 -o addr show eth0; ip route"],
                  capture_output=True, text=True, timeout=30)
    assert p.stdout.splitlines()[0] == "node02" and "10.79.0.12/24" in p.stdout
    assert "default" not in p.stdout
    # while this module's testbed is up, the machine's testbed lock is ours: another process cannot take it
    p = subprocess.run([sys.executable, "-c", "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                        "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", testbed.LOCK_PATH],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "BlockingIOError" in p.stderr, p.stderr
    assert testbed.holder() == f"pid {os.getpid()} (pytest tests/test_testbed.py)", testbed.holder()


_HOLD = ("import sys, time\nfrom pilab import testbed\n"
         "with testbed.exclusive(sys.argv[2], path=sys.argv[1], say=lambda s: print(s, flush=True)):\n"
         "    print('got it', flush=True)\n    sys.stdin.read()\n")


def test_a_second_testbed_user_waits_naming_the_first(tmp_path):
    """Two processes that make testbeds: the second waits for the lock, saying which process holds it,
    and goes on as soon as the first lets go (the lock is an flock: a holder killed by a signal frees it)."""
    lock = str(tmp_path / "testbed.lock")
    def hold(who):
        return subprocess.Popen([sys.executable, "-c", _HOLD, lock, who], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=REPO)
    procs = [hold("first")]
    assert procs[0].stdout.readline() == "got it\n"
    procs.append(hold("second"))
    said = procs[1].stdout.readline()
    assert said.startswith(f"testbed: second: waiting for {lock}, held by pid {procs[0].pid} (first)"), said
    procs[0].kill()  # not a clean exit: the kernel frees an flock with its holder
    assert procs[0].wait(timeout=30) == -signal.SIGKILL
    said = procs[1].stdout.readline()
    assert said.startswith("testbed: second: got ") and procs[1].stdout.readline() == "got it\n", said
    procs[1].stdin.close()
    assert procs[1].wait(timeout=30) == 0


def test_down_removes_everything_after_a_crash(testbed_lock):
    bed = testbed.up(testbed.Testbed(nodes=1, rate="none", subnet="10.79.1.0/24", name="pilabz"))
    subprocess.run(["rm", "-rf", bed.state_dir], check=True)  # the process that made it is gone
    removed = testbed.down("pilabz")
    assert any("netns pilabz-node01" in r for r in removed)
    assert not [ns for ns in testbed.netns_list() if ns.startswith("pilabz-")]
    assert not [link for link in testbed.link_names() if link.startswith("pilabz-")]


def test_shared_memory_inside_a_node_tcp_between_nodes(tb, tmp_path):
    # 8 MB Allreduce x 5: two ranks on one node must not touch its link (MPICH's shared memory, not
    # even its loopback); one rank on each node must send the data over the link.
    script = tmp_path / "ar.py"
    script.write_text(
        "import numpy as np\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\nb = np.ones(2**21, np.float32)\n"
        "for _ in range(6):\n    c.Allreduce(MPI.IN_PLACE, b)\n")
    from pilab.launch import find_mpiexec
    mpiexec = find_mpiexec()
    out = {}
    for case, hosts in (("one_node", f"{tb.address('node01')}:2"),
                        ("two_nodes", f"{tb.address('node01')}:1,{tb.address('node02')}:1")):
        before = testbed.traffic(tb)
        p = subprocess.run([mpiexec, *tb.mpiexec_args(), "-hosts", hosts, "-n", "2", sys.executable,
                            str(script)], env=tb.env(mpi_env()), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        out[case] = testbed.traffic_delta(before, testbed.traffic(tb))
    RECORD["traffic_8MB_allreduce_x6"] = out
    payload = 6 * 2 ** 23
    one, two = out["one_node"]["node01"], out["two_nodes"]["node01"]
    # the one-node job: only Hydra's control traffic on the link, the loopback nearly idle
    assert one["link_tx"] < 0.01 * payload and one["lo_tx"] < 0.01 * payload, out
    # the two-node job: at least the whole buffer each Allreduce, each way
    assert two["link_tx"] > payload and two["link_rx"] > payload, out


# ----------------------------------------------------------------------------------------------
# multi-node training
# ----------------------------------------------------------------------------------------------
def test_two_nodes_train_exactly_as_one_host(tb, tmp_path):
    import torch

    args = ("--epochs", "2", "--checkpoint-every", "1", "--threads", "0")
    before = testbed.traffic(tb)
    t = time.monotonic()
    multi = _train(tb, tmp_path / "multi", *args)
    RECORD["train_2x2_s"] = round(time.monotonic() - t, 2)
    assert multi.returncode == 0, multi.stderr[-3000:]
    RECORD["train_2x2_traffic"] = testbed.traffic_delta(before, testbed.traffic(tb))
    t = time.monotonic()
    single = _train(tb, tmp_path / "single", *args, env=_single_host_env())
    RECORD["train_1host_s"] = round(time.monotonic() - t, 2)
    assert single.returncode == 0, single.stderr[-3000:]
    a = json.loads((tmp_path / "multi" / "result.json").read_text())
    b = json.loads((tmp_path / "single" / "result.json").read_text())
    assert [e["train_loss"] for e in a["epochs"]] == [e["train_loss"] for e in b["epochs"]]
    assert [e["test_loss"] for e in a["epochs"]] == [e["test_loss"] for e in b["epochs"]]
    wa = torch.load(tmp_path / "multi" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "single" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # rank order follows the hostfile: ranks 0-1 on its first host
    assert a["env"]["hostnames"] == ["node01", "node01", "node02", "node02"]
    # threads per rank: the node's cores shared by its 2 ranks
    assert a["threads"] == max(1, (os.cpu_count() or 1) // 2)
    # the gradients crossed the links (each step's bucket bytes at least once per direction)
    sent = RECORD["train_2x2_traffic"]["node02"]["link_tx"]
    assert sent > a["bytes_per_step"] * a["total_steps"], RECORD["train_2x2_traffic"]


def test_an_unreachable_host_in_the_hostfile_is_named(tb, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(f"{tb.address('node01')}:2\n10.79.0.99:2\n")  # not a node of the testbed
    env = dict(tb.env(mpi_env()), HYDRA_HOST_FILE=str(hosts))
    t = time.monotonic()
    p = _train(tb, tmp_path / "out", "--epochs", "1", env=env, timeout=120)
    RECORD["unreachable_host_s"] = round(time.monotonic() - t, 2)
    text = p.stdout + p.stderr
    RECORD["unreachable_host_output"] = text[-600:]
    assert p.returncode != 0
    assert "10.79.0.99" in text and "not a host of pilab testbed" in text
    # mpiexec ends within milliseconds of the failed launch, possibly before the reachable node's
    # shim has started its proxy: the shim's parent check and pid namespace leave nothing behind
    left = no_processes_left(tb, 5)
    RECORD["unreachable_host_left"] = {h: len(p) for h, p in left.items()}
    assert not any(left.values()), left


# ----------------------------------------------------------------------------------------------
# faults (a lost link, a killed node, a slow node, a slow link on one CLI job: tests/test_longruns_testbed.py)
# ----------------------------------------------------------------------------------------------
def _cpu_rate(pid: int, over_s: float = 1.5) -> float:
    """Cores a process used over ``over_s`` seconds of wall time (its /proc CPU ticks)."""
    def ticks():
        with open(f"/proc/{pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        return int(st[11]) + int(st[12])
    t0, c0 = time.monotonic(), ticks()
    time.sleep(over_s)
    return (ticks() - c0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0)


def test_throttle_a_node_while_a_job_runs(tb):
    # `testbed throttle NODE CPUS` from the CLI while a busy process already runs on node02: it joins the
    # node's quota at once (the quota bounds it from above: a cap, not a speed), and `none` frees it
    busy = subprocess.Popen([sys.executable, "-m", "pilab", "testbed", "exec", "--name", NAME, "node02", "--",
                             sys.executable, "-c", "while True: pass"], env=tb.env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (pids := [p for p in testbed.processes(tb)["node02"]
                                                          if _cmdline(p) == f"{sys.executable} -c while True: pass"]):
            time.sleep(0.1)
        assert pids, testbed.ps(tb)
        cli = [sys.executable, "-m", "pilab", "testbed", "throttle", "--name", NAME, "node02"]
        p = subprocess.run([*cli, "0.2"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "0.2 core" in p.stdout, p.stderr
        assert testbed.quota(tb, "node02") == pytest.approx(0.2) and testbed.quota(tb, "node01") is None
        assert f"{NAME}-node02" in _cgroups(pids[0])  # the running process, moved in
        RECORD["throttled_rate"] = rate = _cpu_rate(pids[0])
        assert rate < 0.3, rate
        assert "cpus=0.2" in testbed.ps(tb)
        status = json.loads(subprocess.run([sys.executable, "-m", "pilab", "testbed", "status", "--name", NAME],
                                           capture_output=True, text=True, timeout=60).stdout)
        assert status["nodes"]["node02"]["cpus"] == pytest.approx(0.2)
        p = subprocess.run([*cli, "none"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "no CPU quota" in p.stdout, p.stderr
        assert testbed.quota(tb, "node02") is None and f"{NAME}-node02" not in _cgroups(pids[0])
        bad = subprocess.run([*cli, "fast"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "give cores as a number" in bad.stderr
    finally:
        testbed.throttle(tb, "node02", 0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(busy.pid, signal.SIGKILL)
        busy.wait()
    assert not any(no_processes_left(tb).values())


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _cgroups(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        return f.read()


# ----------------------------------------------------------------------------------------------
# the Pi profile's engines across the nodes
# ----------------------------------------------------------------------------------------------
def test_pi_profile_engines_register_across_the_nodes(tb, monkeypatch):
    # The controller listens on, and advertises, only the head node's bridge address; the engines in
    # the nodes' namespaces reach it over their links (no loopback, no address of this machine's own).
    ipp = pytest.importorskip("ipyparallel")
    from dataclasses import replace

    @ipp.interactive  # sent by value: the engines cannot import this test module
    def _allreduce_rank():
        from mpi4py import MPI

        return MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank())

    from pilab.lab import cluster
    from pilab.config import Config

    for k, v in tb.env_vars().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    t = time.monotonic()
    lab = cluster.start(profile="pi", n=None)
    RECORD["pi_profile_start_s"] = round(time.monotonic() - t, 2)
    try:
        assert lab.size == 4
        info = json.load(open(lab.ipp_cluster.cluster_file))["cluster"]
        assert info["controller_ip"] == tb.bridge_address == info["controller_location"]
        engine_info = json.load(open(os.path.join(lab.ipp_cluster.profile_dir, "security",
                                                  f"ipcontroller-{lab.ipp_cluster.cluster_id}-engine.json")))
        assert engine_info["interface"] == f"tcp://{tb.bridge_address}", engine_info
        assert [r["host"] for r in lab.ranks] == ["node01", "node01", "node02", "node02"]
        assert lab.apply(_allreduce_rank) == [6, 6, 6, 6]
        # a %%px-style cell: the same code on every engine
        cfg = Config(width=0.25, train_subset=256, test_subset=100, epochs=1, batch_size=16, threads=1)
        lab.push(cfg=cfg)
        lab.view.execute("from mpi4py import MPI\nimport pilab\n"
                         "px_result = pilab.train(cfg, MPI.COMM_WORLD)", block=True)
        hosts = lab.view.pull("px_result", block=True)[0]["env"]["hostnames"]
        assert hosts == ["node01", "node01", "node02", "node02"]
        # rank 0 scatters the shards: the nodes need no copy of the data
        t = time.monotonic()
        result = lab.train(replace(cfg, sharding="static"), scatter=True).wait(timeout=300)
        RECORD["pi_profile_scatter_train_s"] = round(time.monotonic() - t, 2)
        assert result["np"] == 4 and result["env"]["hostnames"][2] == "node02"
    finally:
        lab.stop()
    assert not any(no_processes_left(tb, 30).values())


def test_a_notebook_run_losing_a_link_names_the_node(tb, monkeypatch):
    # A %%px-style notebook run on the Pi profile's engines; node02's cable is pulled mid-run. The
    # ranks' watchdogs (hang_s) find node02 unreachable and end themselves; the notebook's run.wait()
    # raises an error naming the ranks and host -- by itself, before wait's own timeout of hang_s + 30.
    pytest.importorskip("ipyparallel")
    from pilab.lab import cluster
    from pilab.config import Config

    for k, v in tb.env_vars().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    hang_s = 10
    lab = cluster.start(profile="pi", n=None)
    try:
        cfg = Config(width=0.25, train_subset=256, test_subset=100, epochs=200, batch_size=16, threads=1)
        run = lab.train(cfg, hang_s=hang_s)
        deadline = time.monotonic() + 120
        while not any(e.get("kind") == "step" for e in run.events):
            assert not run.done, run.describe()
            assert time.monotonic() < deadline, "no step within 120 s"
            time.sleep(0.1)
        testbed.link(tb, "node02", "down")
        t = time.monotonic()
        try:
            with pytest.raises(cluster.ClusterError) as err:
                run.wait(timeout=hang_s + 30)
        finally:
            took = time.monotonic() - t
            testbed.link(tb, "node02", "up")
        message = str(err.value)
        RECORD["notebook_link_down"] = {"hang_s": hang_s, "reported_after_s": round(took, 1),
                                        "status": run.status, "message": message}
        assert "did not end within" not in message, message  # it ended by itself, within hang_s + 30
        assert "unreachable" in message and "node02" in message and "ranks 2, 3" in message, message
    finally:
        _stop_within(lab, 20, RECORD.setdefault("notebook_link_down", {}))
    assert not any(no_processes_left(tb, 30).values())


def _stop_within(lab, timeout, record):
    """lab.stop(), bounded. Engines.stop asks every registered engine to shut down and waits for the
    replies; engines whose node was cut off die without unregistering (the controller drops them only
    after ~10 missed heartbeats), so that wait can outlast the test. Then stop the ipyparallel cluster
    directly (what Engines.stop does next) and record it."""
    import threading
    import warnings

    t = time.monotonic()
    th = threading.Thread(target=lab.stop, daemon=True)
    th.start()
    th.join(timeout)
    record["lab_stop_s"] = round(time.monotonic() - t, 1)
    if th.is_alive():
        record["lab_stop_returned"] = False
        warnings.warn(f"lab.stop() did not return within {timeout} s after a node was cut off "
                      "(Engines.stop waits for shutdown replies from dead engines); stopping the "
                      "ipyparallel cluster directly")
        lab.ipp_cluster.stop_cluster_sync()
    else:
        record["lab_stop_returned"] = True


# ----------------------------------------------------------------------------------------------
# a shared cluster: no open doors, nothing run as root that need not be (docs/security.md)
# ----------------------------------------------------------------------------------------------
def _listeners(tb) -> list[dict]:
    """Every TCP listener in the nodes' namespaces now (``ss -tlnp``): node, address, port, backlog, process."""
    out = []
    for h in tb.hosts:
        p = subprocess.run(["ip", "netns", "exec", tb.netns(h), "ss", "-Htlnp"], capture_output=True, text=True)
        for line in p.stdout.splitlines():
            f = line.split()
            if len(f) >= 5 and f[0] == "LISTEN":
                addr, _, port = f[3].rpartition(":")
                out.append({"node": h, "addr": addr.strip("[]"), "port": int(port), "backlog": int(f[2]),
                            "process": " ".join(f[5:])})
    return out


def test_a_stranger_on_the_network_cannot_end_a_job_or_mark_its_result(tb, tmp_path):
    # A 2-node job; a TCP client on the testbed (in node02's namespace) sends a crafted failure line to
    # every rank's watchdog (`ss`'s listeners of the watchdog's backlog), without the job's secret and with
    # a guessed one. The job ends normally, its result says nothing of it, and at no moment does anything
    # on the nodes listen on every address.
    from pilab.engine import watchdog
    out = tmp_path / "run"
    proc = _train(tb, out, "--epochs", "3", "--train-subset", "1024", popen=True)
    seen, wd = [], []
    try:
        while proc.poll() is None and len(wd) < 4:
            now = _listeners(tb)
            seen += now
            wd = [x for x in now if x["backlog"] == watchdog.BACKLOG and "python" in x["process"]]
            time.sleep(0.2)
        assert len(wd) == 4, f"the job's 4 watchdog listeners did not all show (saw {wd}; the job ended: " \
                             f"{proc.poll() is not None})"
        forged = [json.dumps({"failed": "rank 3 (node02) failed: forged by a stranger"}),
                  json.dumps({"secret": "0" * 32, "failed": "forged with a guess"})]
        client = ("import socket, sys\nfor a in sys.argv[2:]:\n    h, p = a.rsplit(':', 1)\n"
                  "    for line in sys.argv[1].split('\\n'):\n"
                  "        with socket.create_connection((h, int(p)), timeout=5) as s:\n"
                  "            s.sendall(line.encode() + b'\\n')\n"
                  "            print(a, repr(s.recv(100)))\n")
        sent = tb.run_on("node02", [sys.executable, "-c", client, "\n".join(forged),
                                    *(f"{x['addr']}:{x['port']}" for x in wd)],
                         capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        seen += _listeners(tb)
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    res = json.loads((out / "result.json").read_text())
    RECORD["forged_failure"] = {"exit": proc.returncode, "answers": sent.stdout.splitlines(),
                                "listeners": sorted({(x["node"], x["addr"], x["backlog"]) for x in seen}),
                                "said": [ln for ln in text.splitlines() if watchdog.FOREIGN in ln]}
    assert proc.returncode == 0, text[-3000:]
    assert not res.get("stopped_early") and not res.get("aborted") and not res.get("stop_reason"), res
    assert res["steps_done"] == res["total_steps"]
    assert all(ans.endswith("b''") for ans in sent.stdout.splitlines()), sent.stdout  # no answer at all
    # each rank logs the first stranger once (the guess is not logged again)
    said = RECORD["forged_failure"]["said"]
    assert said and all(f"from {tb.address('node02')}" in ln for ln in said), text[-3000:]
    assert len(said) == 4, said
    # every listener on the nodes is on the node's own address
    assert seen and all(x["addr"] == tb.address(x["node"]) for x in seen), seen


TEST_USER = "pilabtest"  # a real unprivileged account (tests/test_testbed.py makes it with useradd)


def _unprivileged_user() -> tuple[int, int]:
    """(uid, gid) of ``TEST_USER``, made now (a system account, no home, no login shell) if it does not exist."""
    import pwd
    try:
        pw = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        TEST_USER], check=True, capture_output=True, text=True)
        pw = pwd.getpwnam(TEST_USER)
    return pw.pw_uid, pw.pw_gid


MARKING_MODEL = '''import os, socket
import torch.nn as nn
HERE = os.path.dirname(os.path.abspath(__file__))


def build(num_classes):
    # who runs your code: every process that builds the model leaves its real/effective/saved uids
    with open(os.path.join(HERE, "ran", f"{socket.gethostname()}-{os.getpid()}"), "w") as f:
        f.write(" ".join(map(str, os.getresuid())))
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, num_classes))
'''


def _python_for(as_user: list[str]) -> tuple[str, dict]:
    """A Python the unprivileged user can run, with this one's packages: this interpreter where the user
    can reach it, else the system's python3 of the same version over this venv's site-packages (a venv
    made from a Python under /root, as pyenv's, is root's alone); the interpreter and the environment it
    needs. Skips (fails under CI=true) where there is none."""
    import site
    import sysconfig

    def runs(py, env):
        return subprocess.run([*as_user, "sh", "-c", 'exec "$0" -c "import torch, pilab; from mpi4py import MPI"', py],
                              env=env, capture_output=True, timeout=120, cwd=REPO).returncode == 0
    base = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin"}
    if runs(sys.executable, base):
        return sys.executable, {}
    system = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    extra = {"PYTHONPATH": os.pathsep.join([REPO, *site.getsitepackages(), sysconfig.get_paths()["purelib"]]),
             "LD_LIBRARY_PATH": os.path.join(sys.prefix, "lib")}  # pip's MPICH: libmpi beside the venv's Python
    if os.path.exists(system) and runs(system, {**base, **extra}):
        return system, extra
    skip_or_fail(f"no Python that {TEST_USER} can run has pilab's packages ({sys.executable} is not reachable "
                 f"by other accounts, and {system} cannot import them)", "the unprivileged testbed test must run")


def test_a_users_testbed_runs_every_job_as_that_user_never_as_root(tb, tmp_path):
    # `sudo pilab testbed up` records the user who ran sudo; that user's own unprivileged `train` then
    # reaches the nodes (a sudo rule for the shim alone), its model code runs under the user's uid on every
    # node, the files in --out are the user's; another account cannot start jobs there.
    import shutil
    import tempfile
    from pathlib import Path
    if shutil.which("sudo") is None:
        skip_or_fail("sudo is not installed (apt-get install sudo; ./lab.sh test installs it)",
                     "CI installs sudo and must run the unprivileged testbed test")
    uid, gid = _unprivileged_user()
    name, subnet = "pilabu", "10.79.3.0/24"
    work = Path(tempfile.mkdtemp(prefix="pilab-user-"))  # pytest's tmp_path is root's alone
    try:
        work.chmod(0o755)
        (work / "ran").mkdir()
        (work / "mine.py").write_text(MARKING_MODEL)
        for p in (work, work / "ran"):
            os.chown(p, uid, gid)
        up = subprocess.run([sys.executable, "-m", "pilab", "testbed", "up", "--name", name, "--nodes", "2",
                             "--slots", "1", "--subnet", subnet, "--rate", "none"],
                            env=dict(mpi_env(), SUDO_USER=TEST_USER), cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # SUDO_USER: what `sudo` tells the command about who ran it
        assert up.returncode == 0, up.stderr
        assert f"run as {TEST_USER}, who starts them with its own mpiexec" in up.stdout, up.stdout
        bed = testbed.load(name)
        assert bed.user == TEST_USER
        st = os.stat(bed.state_dir)
        assert st.st_uid == 0 and not st.st_mode & 0o022
        as_user = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups"]
        python, extra = _python_for(as_user)
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
               "PILAB_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               **extra, **bed.env_vars()}
        p = run_on_testbed(bed, [*as_user, python, "-m", "pilab", "train", "--np", "2", *TINY, "--epochs",
                                 "1", "--model", f"{work / 'mine.py'}:build", "--out", str(work / "out")],
                           env=env, cwd=REPO, timeout=300)
        RECORD["user_train"] = {"exit": p.returncode, "tail": (p.stdout + p.stderr)[-600:]}
        assert p.returncode == 0, p.stderr[-3000:]
        res = json.loads((work / "out" / "result.json").read_text())
        assert res["env"]["hostnames"] == ["node01", "node02"]
        ran = {f.name: f.read_text() for f in (work / "ran").iterdir()}
        RECORD["user_train"]["model_built_by"] = ran
        assert {n.split("-")[0] for n in ran} >= {"node01", "node02"}, ran  # both nodes' ranks (and the head)
        assert set(ran.values()) == {f"{uid} {uid} {uid}"}, ran  # never root, not even as the saved uid
        owners = {str(f.relative_to(work)): f.stat().st_uid for f in (work / "out").rglob("*")}
        assert owners and set(owners.values()) == {uid}, owners
        # the user's mpiexec killed: sudo outlives it, the shim's watcher ends the nodes' processes
        job = subprocess.Popen([*as_user, os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", python,
                                "-c", "import time; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
                                "MPI.COMM_WORLD.rank or print('up', flush=True); time.sleep(600)"], env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
        try:
            assert job.stdout.readline().strip() == "up"
            assert all(testbed.processes(bed).values())
            job.kill()
            job.wait()
            left = no_processes_left(bed, 15)
        finally:
            if job.poll() is None:
                job.kill()
        assert not any(left.values()), left
        # another account may not use the shim: one line naming who may
        nobody = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                 python, "-m", "pilab", "testbed", "exec", "--name", name, "node01", "--",
                                 "id"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert nobody.returncode != 0 and "nobody cannot start jobs on its nodes" in nobody.stderr, nobody.stderr
    finally:
        removed = testbed.down(name)
        shutil.rmtree(work, ignore_errors=True)
    assert any("sudo rule" in r for r in removed) and not os.path.exists(f"/etc/sudoers.d/pilab-testbed-{name}")


def test_a_planted_state_directory_is_refused_and_left_alone():
    # Root runs the shim and sources mounts.sh from the state directory: one made first in /tmp by another
    # account is refused (one line, exit 2) before anything is made, and `down` does not touch it.
    _need_testbed()
    name = "pilabq"
    planted = f"/tmp/{name}-testbed"
    subprocess.run(["rm", "-rf", planted], check=True)
    os.mkdir(planted)
    os.chown(planted, 65534, 65534)  # nobody's
    env = dict(mpi_env(), PILAB_TESTBED_DIR="/tmp")
    try:
        for action in (["up", "--nodes", "1", "--subnet", "10.79.4.0/24", "--rate", "none"], ["env"]):
            p = subprocess.run([sys.executable, "-m", "pilab", "testbed", action[0], "--name", name, *action[1:]],
                               env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stderr
            assert f"{planted} belongs to nobody, not root" in lines[0] and "Traceback" not in p.stderr, lines
        assert not [ns for ns in testbed.netns_list() if ns.startswith(f"{name}-")]
        p = subprocess.run([sys.executable, "-m", "pilab", "testbed", "down", "--name", name], env=env, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "NOT removed" in p.stdout and os.path.isdir(planted), p.stdout
    finally:
        subprocess.run(["rm", "-rf", planted], check=True)
