"""pilab under a real Slurm (pilab.slurm): Debian's munged, slurmctld on the testbed's head namespace and
a slurmd in each node namespace. A 2-node testbed x 2 slots serves the module and is always torn down.

Needs root, ip/tc (the testbed) and the slurmctld, slurmd and munge packages (``./lab.sh test`` installs
them where it can): skipped with the reason elsewhere, a failure under CI=true.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import mpi_env, run_on_testbed, skip_or_fail

from pilab import testbed
from pilab.testbed import slurm

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "pilabs"  # neither the default testbed's name nor test_testbed's
SUBNET = "10.83.0.0/24"
TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet", "--epochs", "1"]


def _need_slurm():
    why = testbed.available() or slurm.available()
    if why:
        skip_or_fail(why, "CI runs as root with Slurm installed by lab.sh and must run the Slurm tests")


@pytest.fixture(scope="module")
def tb():
    _need_slurm()
    testbed.down(NAME)  # whatever a crashed earlier run left
    # made by the CLI in a process of its own that then exits, as a teacher's `sudo pilab testbed up`
    p = subprocess.run([sys.executable, "-m", "pilab", "testbed", "up", "--nodes", "2", "--slots", "2",
                        "--subnet", SUBNET, "--name", NAME, "--slurm"], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert p.returncode == 0, p.stderr
    try:
        yield testbed.load(NAME)
    finally:
        testbed.down(NAME)


def _ours() -> list[str]:
    """Command lines of the daemons of this testbed still running."""
    p = subprocess.run(["pgrep", "-af", f"/{NAME}-testbed/"], capture_output=True, text=True)
    return [ln for ln in p.stdout.splitlines() if "pgrep" not in ln]


def _in_allocation(tb, cmd, cwd, *, timeout=300):
    """``salloc -N 2 --ntasks-per-node 2 cmd`` from the head (this machine's shell, as on a login node).
    ``cwd``: a test's tmp_path -- the ranks start there too (and anything they leave, a core file included)."""
    return run_on_testbed(tb, ["salloc", "-N", "2", "--ntasks-per-node", "2", *cmd], env=tb.env(mpi_env()),
                          timeout=timeout, cwd=cwd)


def test_sinfo_shows_the_nodes_idle_and_srun_runs_on_them(tb):
    env = tb.env()
    assert env["SLURM_CONF"] == slurm.conf_path(NAME)
    p = subprocess.run(["sinfo", "-h", "-o", "%P %a %D %t %N"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert p.stdout.split() == ["pi*", "up", "2", "idle", "node[01-02]"], p.stdout + p.stderr
    p = subprocess.run(["srun", "-N", "2", "hostname"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert sorted(p.stdout.split()) == ["node01", "node02"]
    # each step runs in its node's namespace, on the node's address
    p = subprocess.run(["srun", "-N", "2", "-n", "2", "sh", "-c", "ip -4 -o addr show eth0"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert sorted(ln.split()[3] for ln in p.stdout.splitlines()) == [f"{tb.address(h)}/24" for h in tb.hosts]
    conf = open(slurm.conf_path(NAME)).read()
    assert "ProctrackType=proctrack/linuxproc" in conf and "TaskPlugin=task/none" in conf


def test_train_in_an_allocation_or_a_batch_job_equals_mpiexec_with_a_hostfile(tb, tmp_path):
    import torch
    alloc = _in_allocation(tb, [sys.executable, "-m", "pilab", "train", "--np", "4", *TINY,
                                "--out", str(tmp_path / "alloc")], tmp_path)
    assert alloc.returncode == 0, alloc.stderr[-3000:]
    assert "-launcher slurm" in alloc.stderr  # the ranks went through Slurm, not the hostfile's shim
    hostfile = run_on_testbed(tb, [sys.executable, "-m", "pilab", "train", "--np", "4", *TINY,
                                   "--out", str(tmp_path / "hostfile")], env=tb.env(mpi_env()),
                              timeout=300, cwd=tmp_path)
    assert hostfile.returncode == 0, hostfile.stderr[-3000:]
    # a batch script runs on the allocation's first node (node01's namespace), with the submitter's
    # environment: the same launch from there
    script = tmp_path / "train.sbatch"
    script.write_text("#!/bin/sh\n#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n"
                      f"#SBATCH --output={tmp_path}/batch-%j.log\ncd {tmp_path}\n"
                      f"{sys.executable} -m pilab train --np 4 {' '.join(TINY)} --out {tmp_path / 'batch'}\n")
    batch = run_on_testbed(tb, ["sbatch", "--wait", str(script)], env=tb.env(mpi_env()), timeout=300,
                           cwd=tmp_path)
    logs = "".join(p.read_text() for p in tmp_path.glob("batch-*.log"))
    assert batch.returncode == 0, batch.stderr + logs[-3000:]
    a = json.loads((tmp_path / "alloc" / "result.json").read_text())
    b = json.loads((tmp_path / "hostfile" / "result.json").read_text())
    c = json.loads((tmp_path / "batch" / "result.json").read_text())
    assert a["env"]["hostnames"] == b["env"]["hostnames"] == c["env"]["hostnames"] == \
        ["node01", "node01", "node02", "node02"]
    assert a["steps"]["loss"] == b["steps"]["loss"] == c["steps"]["loss"]  # bitwise: same placement, same sums
    assert [e["test_loss"] for e in a["epochs"]] == [e["test_loss"] for e in b["epochs"]]
    wa = torch.load(tmp_path / "alloc" / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(tmp_path / "hostfile" / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_doctor_in_an_allocation_names_the_drained_node(tb, tmp_path):
    env = tb.env()
    report = tmp_path / "doctor.json"
    # drained while the allocation holds it: Slurm lets the running job be, but no new step starts there
    script = ("scontrol update nodename=node02 state=drain reason=fan-failed && "
              f"{sys.executable} -m pilab doctor --ranks-per-node 2 --json {report}")
    try:
        p = _in_allocation(tb, ["sh", "-c", script], tmp_path)
    finally:
        subprocess.run(["scontrol", "update", "nodename=node02", "state=resume"], env=env, capture_output=True)
    assert p.returncode == 1, p.stdout + p.stderr
    rep = json.loads(report.read_text())
    assert rep["hosts"] == ["node01", "node02"]  # the allocation's nodes, no hostfile given
    bad = rep["checks"]["node02"]["placement"]
    assert bad["ok"] is False and "drain" in bad["detail"] and "fan-failed" in bad["detail"], bad
    assert "state=resume" in bad["fix"]
    assert rep["checks"]["node01"]["placement"]["ok"] is True
    assert "node02" in p.stdout and "fan-failed" in p.stdout


def test_slurm_profile_engines_are_ranks_in_rank_order(tb, monkeypatch):
    """profiles/profile_slurm: ipyparallel's Slurm launcher submits one job whose engines are the ranks of
    one MPI job; they register with the controller on the head's bridge address; a %%px-style cell runs
    on every rank."""
    pytest.importorskip("ipyparallel")
    from pilab.lab import cluster
    for k, v in tb.env_vars().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    lab = cluster.start(profile="slurm", n=4, timeout=240)
    try:
        assert lab.size == 4
        info = json.load(open(lab.ipp_cluster.cluster_file))["cluster"]
        assert info["controller_ip"] == tb.bridge_address
        assert [r["host"] for r in lab.ranks] == ["node01", "node01", "node02", "node02"]
        lab.view.execute("from mpi4py import MPI\nimport socket\n"
                         "px = (MPI.COMM_WORLD.Get_rank(), socket.gethostname(), "
                         "MPI.COMM_WORLD.allreduce(MPI.COMM_WORLD.Get_rank()))", block=True)
        assert lab.view.pull("px", block=True) == [(0, "node01", 6), (1, "node01", 6), (2, "node02", 6),
                                                   (3, "node02", 6)]
    finally:
        lab.stop()
    left = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=tb.env(), timeout=30)
    assert left.stdout.strip() == ""  # the engines' job ended with them


def test_more_ranks_than_the_allocation_or_no_srun_is_one_line_exit_2(tb, tmp_path):
    out = tmp_path / "too-many"
    p = _in_allocation(tb, [sys.executable, "-m", "pilab", "train", "--np", "6", *TINY, "--out", str(out)],
                       tmp_path)
    assert p.returncode == 2, p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("pilab: error:")]
    assert len(errors) == 1 and "6 ranks but only 4 slots" in errors[0], p.stderr
    assert not out.exists() and "launching:" not in p.stderr
    # inside an allocation but srun not on PATH (a login shell without Slurm's module)
    bare = os.path.dirname(sys.executable)  # not /bin: merged /usr has srun there
    p = _in_allocation(tb, ["env", f"PATH={bare}", sys.executable, "-m", "pilab", "train", "--np", "4",
                            *TINY, "--out", str(out)], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "no srun on PATH" in p.stderr and not out.exists()


def test_down_stops_every_daemon_and_removes_the_head():
    _need_slurm()
    assert testbed.load(NAME, missing_ok=True) is not None  # the module's testbed, made by another process
    assert len(_ours()) == 4, _ours()  # munged, slurmctld, 2 x slurmd
    removed = testbed.down(NAME)
    assert {"daemon munged", "daemon slurmctld", f"netns {NAME}-head"} <= set(removed), removed
    assert _ours() == []
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{NAME}-" not in left
    assert not os.path.exists(testbed.state_dir(NAME))
