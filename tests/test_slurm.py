"""pilab under a real Slurm (pilab.testbed.slurmd): Debian's munged, slurmctld on the testbed's head namespace
and a slurmd in each node namespace. A 2-node testbed x 2 slots serves the module and is always torn down.
Inside an allocation (train, doctor, notebook engines), and a study as batch jobs (scale/remedies
--launcher slurm: pilab.launch.slurm, pilab.study.batch), faults by real means: scancel, SIGKILL, SIGINT, SIGSTOP,
SIGABRT, a partition taken down and Slurm's own time limit.

Needs root, ip/tc (the testbed) and the slurmctld, slurmd and munge packages (``./lab.sh test`` installs
them where it can): skipped with the reason elsewhere, a failure under CI=true.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import mpi_env, run_on_testbed, skip_or_fail, holding_testbed

from pilab import resultfile, testbed
from pilab.testbed import slurmd as slurm

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "pilabs"  # neither the default testbed's name nor test_testbed's
SUBNET = "10.83.0.0/24"
TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet", "--epochs", "1"]


# a study's tiny points (scale takes the training flags, not train's --quiet)
STUDY = [sys.executable, "-m", "pilab", "scale", "--simulate-nps", "", "--target", "this",
         *[a for a in TINY if a != "--quiet"]]
BATCH = ["--launcher", "slurm", "--partition", "pi", "--time", "5"]


def _need_slurm():
    why = testbed.available() or slurm.available()
    if why:
        skip_or_fail(why, "CI runs as root with Slurm installed by lab.sh and must run the Slurm tests")


@pytest.fixture(scope="module")
def tb(request):
    _need_slurm()
    with holding_testbed(request):
        testbed.down(NAME)  # whatever a crashed earlier run left (a live one would hold the lock)
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
    a, b, c = (resultfile.load(str(tmp_path / d / "result.json")) for d in ("alloc", "hostfile", "batch"))
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


def _study(tb, cmd, cwd, *, timeout=300):
    return run_on_testbed(tb, cmd, env=tb.env(mpi_env()), timeout=timeout, cwd=cwd)


def _per_node(hostnames: list[str]) -> list[int]:
    """Ranks on each node in rank order: [2, 2] for node01, node01, node02, node02 (the placement's shape)."""
    return [hostnames.count(h) for h in dict.fromkeys(hostnames)]


def _jobs(out) -> dict:
    with open(os.path.join(out, "slurm.json")) as f:
        return json.load(f)["points"]


def _job_of(out, p: int, wait_s: float = 60) -> str:
    """The job id of point ``p`` once the study has submitted it (its slurm.json says)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (out / "slurm.json").exists() and str(p) in _jobs(out):
            return _jobs(out)[str(p)]["job"]
        time.sleep(0.2)
    raise AssertionError(f"np={p} was not submitted within {wait_s} s")


def _squeue(tb) -> str:
    return subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=tb.env(), timeout=30).stdout


def test_scale_as_slurm_jobs_equals_the_mpiexec_study(tb, tmp_path):
    """Each point one sbatch job (np 1, 2, 4 on 2 nodes x 2 CPUs: np=4 waits for the others); the study's
    numbers are the mpiexec study's, bitwise, the ranks placed alike (nodes filled in order)."""
    from pilab.study import scaling
    args = [*STUDY, "--nps", "1,2,4", "--baseline", "1"]
    sl = _study(tb, [*args, *BATCH, "--out", str(tmp_path / "slurm")], tmp_path)
    assert sl.returncode == 0, sl.stderr[-3000:]
    for p in (1, 2, 4):
        assert f"np={p:<3} submitted" in sl.stderr and re.search(rf"np={p} +job \d+ +RUNNING on node", sl.stderr)
        assert re.search(rf"np={p} +job \d+ +done", sl.stderr), sl.stderr
    script = (tmp_path / "slurm" / "np4" / "job.sbatch").read_text()
    assert "#SBATCH --partition=pi\n#SBATCH --time=5\n#SBATCH --nodes=2\n#SBATCH --ntasks=4\n" in script
    assert f"-m pilab train --np 4 --quiet" in script and f"--out {tmp_path}/slurm/np4" in script
    jobs = _jobs(tmp_path / "slurm")
    assert sorted(jobs) == ["1", "2", "4"] and all(j["state"] == "COMPLETED" for j in jobs.values())
    assert (tmp_path / "slurm" / "np4" / f"slurm-{jobs['4']['job']}.log").exists()
    mp = _study(tb, [*args, "--out", str(tmp_path / "mpiexec")], tmp_path)  # the testbed's hostfile
    assert mp.returncode == 0, mp.stderr[-3000:]
    a, b = scaling.load_study(str(tmp_path / "slurm")), scaling.load_study(str(tmp_path / "mpiexec"))
    assert a["complete"] and [r["np"] for r in a["rows"]] == [1, 2, 4]
    for p in ("1", "2", "4"):
        ra, rb = a["runs"][p], b["runs"][p]
        shape = {"1": [1], "2": [2], "4": [2, 2]}[p]  # which node does not matter, how many on each does
        assert _per_node(ra["env"]["hostnames"]) == _per_node(rb["env"]["hostnames"]) == shape
        assert ra["steps"]["loss"] == rb["steps"]["loss"]  # bitwise
        assert [e["test_loss"] for e in ra["epochs"]] == [e["test_loss"] for e in rb["epochs"]]
    assert [r["final_test_acc"] for r in a["rows"]] == [r["final_test_acc"] for r in b["rows"]]


def test_a_study_in_a_folder_with_a_space_and_a_percent_sign(tb, tmp_path):
    """--out and the working directory with a space and a '%' (Slurm's file name patterns use %): the
    #SBATCH lines quote them and keep '%' literal, the job runs there and its log lands where the study
    looks; a path a batch script cannot carry (a line break) is refused in one line, nothing submitted."""
    import shlex
    here = tmp_path / "50% of my runs"
    here.mkdir()
    out = here / "a study"
    p = _study(tb, [*STUDY, "--nps", "2", "--baseline", "2", *BATCH, "--out", str(out)], here)
    assert p.returncode == 0, p.stderr[-3000:]
    script = (out / "np2" / "job.sbatch").read_text()
    log_pattern = os.path.join(str(out).replace("%", "%%"), "np2", "slurm-%j.log")
    assert f"#SBATCH --output={shlex.quote(log_pattern)}\n#SBATCH --chdir={shlex.quote(str(here))}\n" in script
    job = _jobs(out)["2"]
    assert job["state"] == "COMPLETED" and (out / "np2" / f"slurm-{job['job']}.log").exists()
    res = json.loads((out / "np2" / "result.json").read_text())
    assert res["steps_done"] == res["total_steps"] and res["config"]["out"] == str(out / "np2")
    bad = tmp_path / "line\nbreak"
    p = _study(tb, [*STUDY, "--nps", "2", *BATCH, "--out", str(bad)], tmp_path)
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("pilab: error:")]
    assert p.returncode == 2 and len(errors) == 1 and "control character" in errors[0], p.stderr
    assert not bad.exists() and _squeue(tb).strip() == ""


def test_a_point_cancelled_from_outside_is_reported_and_resume_reruns_only_it(tb, tmp_path):
    out = tmp_path / "s"
    cmd = [*STUDY, "--nps", "1,2", "--baseline", "1", *BATCH, "--out", str(out)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          env=tb.env(mpi_env())) as proc:
        victim = _job_of(out, 2)
        subprocess.run(["scancel", victim], env=tb.env(), check=True, timeout=30)  # someone else's scancel
        _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err[-3000:]
    assert f"np=2: job {victim} ended CANCELLED" in err
    assert f"failed np=2 (job {victim} CANCELLED); the same command with --resume submits only those" in err
    st = json.loads((out / "study.json").read_text())
    assert st["complete"] is False and st["missing"] == [2] and sorted(st["runs"]) == ["1"]
    kept = _jobs(out)["1"]["job"]
    again = _study(tb, [*cmd, "--resume"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "np=1   kept: finished earlier" in again.stderr and f"job {victim} ended CANCELLED: submitting it again" \
        in again.stderr
    jobs = _jobs(out)
    assert jobs["1"]["job"] == kept and jobs["2"]["job"] != victim and jobs["2"]["earlier"] == [victim]
    assert json.loads((out / "study.json").read_text())["complete"] is True
    assert _squeue(tb).strip() == ""


def test_ctrl_c_cancels_the_studys_jobs_and_says_how_to_resume(tb, tmp_path):
    out = tmp_path / "c"
    cmd = [*STUDY, "--nps", "1,2", "--baseline", "1", *BATCH, "--out", str(out)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          env=tb.env(mpi_env())) as proc:
        ids = [_job_of(out, 1), _job_of(out, 2)]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("pilab: scale interrupted")]
    assert line == [f"pilab: scale interrupted; cancelled job {ids[0]} (np=1), job {ids[1]} (np=2); the same "
                    "command with --resume submits the unfinished points again and keeps the finished ones"], err
    p = subprocess.run(["squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%T"], capture_output=True,
                       text=True, env=tb.env(), timeout=30)
    assert p.stdout.split() == ["CANCELLED", "CANCELLED"], p.stdout + p.stderr


@contextlib.contextmanager
def _partition_down(tb, name="pi"):
    """Partition ``name`` DOWN: Slurm takes jobs but starts none (PENDING, PartitionDown), as a busy
    cluster holds them -- so that a test decides when they run, on a slow machine too; UP again after."""
    def state(s):
        subprocess.run(["scontrol", "update", f"PartitionName={name}", f"State={s}"], env=tb.env(), check=True,
                       timeout=30)
    state("DOWN")
    try:
        yield lambda: state("UP")
    finally:
        state("UP")


def _wait_for(path, text: str, wait_s: float = 120) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} within {wait_s} s:\n{path.read_text(errors='replace')[-3000:]}")


def test_the_study_process_gone_its_jobs_run_on_and_resume_waits_for_them(tb, tmp_path):
    """The study's process killed (the login session gone) while its jobs wait in the queue: a new study
    over them is refused, --resume waits for the same jobs and finishes the study. The jobs are held
    PENDING (partition down) until the resumed study says it waits: tiny jobs would otherwise end, on a
    loaded machine, before the test looks."""
    out = tmp_path / "h"
    cmd = [*STUDY, "--nps", "1,2", "--baseline", "1", *BATCH, "--out", str(out)]
    with _partition_down(tb) as up:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=tb.env(mpi_env())) as proc:
            ids = [_job_of(out, 1), _job_of(out, 2)]
            proc.kill()  # the login session gone, and the study's process with it: no chance to clean up
            proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        # a new study over it, while its jobs are queued, is refused: they would write into the same points
        again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=tb.env(mpi_env()),
                               timeout=120)
        assert again.returncode == 2 and "still run; the same command with --resume waits for them" in again.stderr
        err = tmp_path / "resumed.err"
        with open(err, "w") as f, subprocess.Popen([*cmd, "--resume"], stdout=subprocess.DEVNULL, stderr=f,
                                                   cwd=tmp_path, env=tb.env(mpi_env())) as resumed:
            try:
                for i in ids:
                    _wait_for(err, f"job {i} is still PENDING: waiting for it")
                up()
                resumed.wait(timeout=300)
            except (AssertionError, subprocess.TimeoutExpired):
                resumed.kill()
                raise AssertionError(f"on the nodes:\n{testbed.ps(tb)}\n{err.read_text()[-3000:]}") from None
    said = err.read_text()
    assert resumed.returncode == 0, said[-3000:]
    assert "submitted" not in said, said[-3000:]
    jobs = _jobs(out)
    assert [jobs["1"]["job"], jobs["2"]["job"]] == ids and all(not j["earlier"] for j in jobs.values())
    assert json.loads((out / "study.json").read_text())["complete"] is True


def test_remedies_as_slurm_jobs_equals_the_search_run_here(tb, tmp_path):
    """remedies --launcher slurm: the np=1 reference and each candidate one single-process job (the
    simulator); the search then keeps them all, and its numbers are those of the search run here."""
    args = [sys.executable, "-m", "pilab", "remedies", "--np", "4", "--only", "baseline,linear lr",
            "--target", "none", *[a for a in TINY if a != "--quiet"]]
    # --dry-run: the reference's and each candidate's script, nothing submitted or written; an unknown
    # partition: one line, exit 2, nothing written (remedies shares scale's batch path: checked, not assumed)
    dry = subprocess.run([*args, *BATCH, "--dry-run", "--out", str(tmp_path / "dry")], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120, env=tb.env(mpi_env()))
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert dry.stdout.count("#!/bin/bash") == 3 and "not submitted" in dry.stdout
    assert not (tmp_path / "dry").exists() and _squeue(tb).strip() == ""
    bad = subprocess.run([*args, "--launcher", "slurm", "--partition", "gpu", "--time", "5", "--out",
                          str(tmp_path / "bad")], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env=tb.env(mpi_env()))
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("pilab: error:")]
    assert bad.returncode == 2 and len(errors) == 1 and "Slurm knows no such partition" in errors[0], bad.stderr
    assert not (tmp_path / "bad").exists() and _squeue(tb).strip() == ""
    sl = _study(tb, [*args, *BATCH, "--out", str(tmp_path / "slurm")], tmp_path)
    assert sl.returncode == 0, sl.stderr[-3000:]
    jobs = _jobs(tmp_path / "slurm")
    assert sorted(jobs) == ["baseline", "linear-lr", "reference"], jobs
    assert all(j["state"] == "COMPLETED" for j in jobs.values())
    script = (tmp_path / "slurm" / "linear-lr" / "job.sbatch").read_text()
    assert "#SBATCH --ntasks=1\n" in script and "-m pilab simulate --np 4 --quiet" in script
    assert "--lr-scaling linear" in script
    here = _study(tb, [*args, "--out", str(tmp_path / "here")], tmp_path)
    assert here.returncode == 0, here.stderr[-3000:]
    a = json.loads((tmp_path / "slurm" / "remedies.json").read_text())
    b = json.loads((tmp_path / "here" / "remedies.json").read_text())
    assert a["reference_acc"] == b["reference_acc"]
    assert [(r["label"], r["final_test_acc"], r["kept"]) for r in a["candidates"]] == \
        [("baseline", b["candidates"][0]["final_test_acc"], "kept from the earlier search"),
         ("linear lr", b["candidates"][1]["final_test_acc"], "kept from the earlier search")]


def _ranks_of(point_dir: str) -> list[int]:
    """Pids of the processes of a point's job (the train front, mpiexec, the ranks): their command line
    names the point's --out."""
    found = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{d}/cmdline", "rb") as f:
                if point_dir.encode() in f.read():
                    found.append(int(d[6:]))
        except OSError:
            pass
    return found


def test_a_point_that_hits_its_time_limit_keeps_its_checkpoint_and_resume_continues_it(tb, tmp_path):
    """The job's processes stopped right after their first mid-epoch checkpoint (SIGSTOP: a job that
    stalls), then its end time moved to now (``scontrol update EndTime=now``: its time limit is up, as an
    admin shortening it would make it) so that Slurm's limit, not the training's end, finishes it:
    TIMEOUT (slurmctld checks limits every 30 s), the checkpoint kept, and --resume continues the point
    from it. (``--time 1``, Slurm's smallest limit, would cost a minute of waiting.)"""
    out = tmp_path / "t"
    cmd = [*STUDY, "--nps", "2", "--baseline", "2", "--train-subset", "1024", "--epochs", "2",
           "--checkpoint-every-steps", "2", *BATCH, "--out", str(out)]
    point = str(out / "np2")
    stopped = []
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=tb.env(mpi_env())) as proc:
            deadline = time.monotonic() + 120

            def checkpointed():  # the numbered file is written first, checkpoint.pt linked to it after
                return glob.glob(f"{point}/checkpoint-e0000-s*.pt") and os.path.exists(f"{point}/checkpoint.pt")
            while time.monotonic() < deadline and not checkpointed():
                time.sleep(0.05)
            assert checkpointed(), "no mid-epoch checkpoint"
            for pid in _ranks_of(point):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            job = _job_of(out, 2)
            subprocess.run(["scontrol", "update", f"JobId={job}", "EndTime=now"], env=tb.env(), check=True,
                           timeout=30)
            _, err = proc.communicate(timeout=240)
    finally:
        for pid in stopped:  # those Slurm did not end (it does: SIGKILL after KillWait)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-3000:]
    assert f"np=2: job {job} ended TIMEOUT" in err
    assert os.path.exists(f"{point}/checkpoint.pt")
    again = _study(tb, [*cmd, "--resume"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"job {job} ended TIMEOUT: submitting it again, continued from" in again.stderr
    assert f"--resume {point}/checkpoint.pt" in open(f"{point}/job.sbatch").read()
    r = json.loads(open(f"{point}/result.json").read())
    assert r["resumed_from_step"] > 0 and r["steps_done"] == r["total_steps"] and not r["stopped_early"]


def _rank_pids(point_dir: str) -> list[int]:
    """The MPI ranks among a point's processes: those whose parent is Hydra's proxy."""
    ranks = []
    for pid in _ranks_of(point_dir):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            if open(f"/proc/{ppid}/comm").read().strip() == "hydra_pmi_proxy":
                ranks.append(pid)
        except (OSError, ValueError, IndexError):
            pass
    return ranks


def test_a_rank_that_dies_ends_its_job_and_the_report_shows_its_own_last_words(tb, tmp_path):
    """One rank of a running batch job aborted (SIGABRT, as an assertion in MPI or a C extension would):
    the other is not left hanging, the job ends FAILED, and the study's report shows the rank's Python
    stack (faulthandler) and mpiexec's banner folded into one line, not the banner alone."""
    out = tmp_path / "a"
    cmd = [*STUDY, "--nps", "2", "--baseline", "2", "--train-subset", "1024", "--epochs", "2",
           "--checkpoint-every-steps", "2", *BATCH, "--out", str(out)]
    point = str(out / "np2")
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                          env=tb.env(mpi_env())) as proc:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not glob.glob(f"{point}/checkpoint-e0000-s*.pt"):
            time.sleep(0.05)  # training: past the imports and MPI's start
        ranks = _rank_pids(point)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGABRT)
        _, err = proc.communicate(timeout=240)
    job = _job_of(out, 2)
    assert proc.returncode == 1, err[-3000:]
    assert f"np=2: job {job} ended FAILED; the end of its log:" in err, err[-3000:]
    report = err[err.index("the end of its log:"):]
    assert "| Fatal Python error: Aborted" in report and "ended: Aborted (signal 6)" in report, report
    assert "| mpiexec: a rank (pid " in report and "BAD TERMINATION" not in report, report
    assert f"(all of it: {point}/slurm-{job}.log)" in report
    assert not _rank_pids(point) and _squeue(tb).strip() == ""


def test_batch_study_bad_input_is_one_line_exit_2_and_nothing_submitted(tb, tmp_path):
    out = tmp_path / "bad"
    bare = os.path.dirname(sys.executable)  # Python's venv, without Slurm's commands
    cases = [
        (["--partition", "gpu", "--time", "5"], None, "Slurm knows no such partition"),
        (["--partition", "pi", "--time", "5", "--nps", "1,8"], None, "np=8 needs 8 CPUs"),
        (["--partition", "pi", "--time", "2", "--checkpoint-minutes", "5"], None,
         "--time 2 is shorter than one checkpoint interval"),
        (["--partition", "pi", "--time", "5"], {"PATH": bare}, "not on PATH"),
    ]
    for extra, env, said in cases:
        p = subprocess.run([*STUDY, "--nps", "1,2", "--launcher", "slurm", *extra, "--out", str(out)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120,
                           env={**tb.env(mpi_env()), **(env or {})})
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("pilab: error:")]
        assert p.returncode == 2 and len(errors) == 1 and said in errors[0], p.stderr
        assert not out.exists()
    # --dry-run: the scripts, nothing submitted or written
    p = subprocess.run([*STUDY, "--nps", "1,2", *BATCH, "--dry-run", "--out", str(out)], capture_output=True,
                       text=True, cwd=tmp_path, timeout=120, env=tb.env(mpi_env()))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("#!/bin/bash") == 2 and "#SBATCH --ntasks=2" in p.stdout and "not submitted" in p.stdout
    assert not out.exists() and _squeue(tb).strip() == ""


def test_down_stops_every_daemon_and_removes_the_head(tb):
    assert testbed.load(NAME, missing_ok=True) is not None  # the module's testbed, made by another process
    assert len(_ours()) == 4, _ours()  # munged, slurmctld, 2 x slurmd
    removed = testbed.down(NAME)
    assert {"daemon munged", "daemon slurmctld", f"netns {NAME}-head"} <= set(removed), removed
    assert _ours() == []
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{NAME}-" not in left
    assert not os.path.exists(testbed.state_dir(NAME))
