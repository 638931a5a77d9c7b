"""`python -m pilab doctor` on a real testbed (3 namespaces, 1 Gbit/s links), one real fault at a time:
all ✔ on the healthy testbed, then another torch version visible on one node only (a bind mount in
that node's mount namespace), the data file missing or changed on one node, a link taken down, a host
that does not answer, a node with too little memory (a memory cgroup), each asserted to give ✗ on the
right host and the right check and ✔ everywhere else; bad input exits 2 with one line.

One testbed serves the module and is always torn down (with its cgroups and mount state). Needs root,
`ip` and `tc`: skipped with the reason elsewhere, a failure under CI=true.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import mpi_env, skip_or_fail, holding_testbed

from pilab import testbed
from pilab.cli import main as cli_main
from pilab.doctor import CHECKS

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "pldoc"
SUBNET = "10.81.0.0/24"
# the run being checked: small, so that 2 ranks of it fit on a healthy node of this shared machine
RUN = ["--width", "0.25", "--batch-size", "16", "--threads", "1"]


@pytest.fixture(scope="module")
def tb(request):
    why = testbed.available()
    if why:
        skip_or_fail(why, "CI runs as root here and must run the multi-node tests")
    with holding_testbed(request):
        testbed.down(NAME)
        bed = testbed.up(testbed.Testbed(nodes=3, slots=2, rate="1gbit", subnet=SUBNET, name=NAME))
        try:
            yield bed
        finally:
            testbed.down(NAME)
            assert not [d for d in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/cpu", "/sys/fs/cgroup") if os.path.isdir(d)
                        for e in os.listdir(d) if e.startswith(f"{NAME}-")]


def doctor(tb, tmp_path, *args, data=None, env=None):
    """Run the CLI as a user would (after `eval "$(pilab testbed env)"`); (exit code, stdout, report)."""
    out = tmp_path / "doctor.json"
    speed = "--speed" in args  # the speed check only where a test asks for it: seconds a node otherwise
    args = [a for a in args if a != "--speed"]
    cmd = [sys.executable, "-m", "pilab", "doctor", *RUN, "--answer-s", "30", "--json", str(out), *args,
           *([] if speed else ["--no-speed"])]
    if data:
        cmd += ["--data", str(data)]
    p = subprocess.run(cmd, env=env or tb.env(mpi_env()), capture_output=True, text=True, timeout=400,
                       cwd=REPO)
    report = json.loads(out.read_text()) if out.exists() else None
    return p.returncode, p.stdout + p.stderr, report


def failing(report, speed: bool = False) -> set:
    """(host, check) of every ✗. A speed ✗ counts only with ``speed``: healthy nodes of this shared machine
    differ by up to ~15% in the CPU time a step takes (other helpers' work), the check's own threshold;
    a real fault (the throttled test's quota) is far beyond it."""
    return {(h, k) for h, row in report["checks"].items() for k, c in row.items()
            if c["ok"] is False and (speed or k != "speed")}


def test_healthy_testbed_passes_and_calibrates(tb, tmp_path, cifar_archive):
    rc, out, rep = doctor(tb, tmp_path, "--speed", data=cifar_archive)
    noise = failing(rep, speed=True)  # a speed ✗ here is this shared machine's noise (see failing)
    assert (rc == 0) == (not noise) and failing(rep) == set(), out
    assert rep["hosts"] == [tb.address(h) for h in tb.hosts]
    checked = [k for k in CHECKS if k != "speed"]
    for h, node in zip(rep["hosts"], tb.hosts):
        assert rep["checks"][h]["answers"]["detail"].startswith(node)  # its own hostname
        assert all(rep["checks"][h][k]["ok"] is True for k in checked)
    # the table: every host, every check, ✔ only
    lines = out.splitlines()
    assert lines[0].split() == ["host", *CHECKS]
    for h in rep["hosts"]:
        row = next(ln for ln in lines if ln.startswith(h + " "))
        assert [m for k, m in zip(CHECKS, row.split()[1:]) if k != "speed"] == ["✔"] * len(checked)
    # every host timed the run's own step (16 images, 1 thread), one node after the other (one machine)
    speeds = rep["net"]["speeds"]
    assert [s["batch"] for s in speeds] == [16] * 3 and all(s["images_per_s"] > 0 for s in speeds), speeds
    assert all(rep["checks"][h]["speed"]["ok"] is not None for h in rep["hosts"])
    # one job, one rank per host, over the shaped links: each link's bandwidth both ways is below
    # 1 Gbit/s (plus the token bucket's burst), so the bytes did cross them
    net = rep["net"]
    assert net["np"] == 3 and sorted(r["host"] for r in net["ranks"]) == tb.hosts
    for link in net["links"].values():
        assert 1e6 < link["to_peer_Bps"] < 1.6e9 / 8 and 1e6 < link["from_peer_Bps"] < 1.6e9 / 8
        assert 0 < link["latency_s"] < 0.1
    # the doctor's JSON is the inter-node calibration `perfmodel calibrate --inter-bench` reads
    assert rep["runs"][0]["np"] == 3 and rep["runs"][0]["ranks_per_node"] == 1
    cluster = tmp_path / "cluster.json"
    assert cli_main(["perfmodel", "calibrate", "--result",
                     os.path.join(REPO, "experiments/fast-but-wrong/naive/np1/result.json"),
                     "--bench", str(tmp_path / "doctor.json"), "--out", str(tmp_path / "cal.json"),
                     "--inter-bench", str(tmp_path / "doctor.json"), "--nodes", "3",
                     "--ranks-per-node", "2", "--cluster-out", str(cluster)]) == 0
    inter = json.loads(cluster.read_text())["inter"]
    assert inter["beta"] == pytest.approx(rep["fit"]["beta"]) and inter["beta"] > 0


def test_other_torch_on_one_node(tb, tmp_path, cifar_archive):
    import torch
    fake = tmp_path / "version.py"
    text = open(torch.version.__file__).read()
    fake.write_text(text.replace(f"__version__ = '{torch.__version__}'", "__version__ = '2.0.0+cpu'"))
    assert fake.read_text() != text
    testbed.overlay(tb, "node02", str(fake), torch.version.__file__)
    try:
        rc, out, rep = doctor(tb, tmp_path, data=cifar_archive)
    finally:
        testbed.clear_overlays(tb, "node02")
    assert rc == 1, out
    bad = tb.address("node02")
    assert failing(rep) == {(bad, "software")}, out
    c = rep["checks"][bad]["software"]
    assert "torch 2.0.0+cpu" in c["detail"] and torch.__version__ in c["detail"] and "pip install" in c["fix"]
    assert f"✗ {bad} software: torch 2.0.0+cpu" in out


def test_data_missing_or_changed_on_one_node(tb, tmp_path, cifar_archive):
    empty = tmp_path / "empty"
    empty.mkdir()
    testbed.overlay(tb, "node03", str(empty), str(cifar_archive.parent))  # the data directory, empty
    try:
        rc, out, rep = doctor(tb, tmp_path, data=cifar_archive)
    finally:
        testbed.clear_overlays(tb, "node03")
    bad = tb.address("node03")
    assert rc == 1 and failing(rep) == {(bad, "data")}, out
    c = rep["checks"][bad]["data"]
    assert "missing" in c["detail"] and c["fix"].endswith(f"rsync -a {cifar_archive} {bad}:{cifar_archive}")
    # one byte changed on node02
    changed = tmp_path / "changed.tar.gz"
    shutil.copyfile(cifar_archive, changed)
    with open(changed, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 1]))
    testbed.overlay(tb, "node02", str(changed), str(cifar_archive))
    try:
        rc, out, rep = doctor(tb, tmp_path, data=cifar_archive)
    finally:
        testbed.clear_overlays(tb, "node02")
    bad = tb.address("node02")
    assert rc == 1 and failing(rep) == {(bad, "data")}, out
    assert "differs" in rep["checks"][bad]["data"]["detail"]


def test_link_down(tb, tmp_path):
    testbed.link(tb, "node02", "down")
    try:
        rc, out, rep = doctor(tb, tmp_path)
    finally:
        testbed.link(tb, "node02", "up")
    bad = tb.address("node02")
    assert rc == 1 and failing(rep) == {(bad, "answers")}, out
    assert "node02" in rep["checks"][bad]["answers"]["detail"]  # Hydra: unable to connect from node02
    assert all(c["ok"] is None for k, c in rep["checks"][bad].items() if k != "answers")
    assert rep["net"]["np"] == 2 and rep["net"]["allreduce_ok"]  # the others still ran their job


def test_host_that_does_not_answer(tb, tmp_path):
    ghost = "10.81.0.99"  # in the hostfile, but no board answers there
    hosts = ",".join([tb.address("node01"), ghost, tb.address("node03")])
    rc, out, rep = doctor(tb, tmp_path, "--hosts", hosts)
    assert rc == 1 and failing(rep) == {(ghost, "answers")}, out
    assert "Could not resolve hostname" in rep["checks"][ghost]["answers"]["detail"]
    assert f"ssh {ghost} true" in rep["checks"][ghost]["answers"]["fix"]


def test_a_node_named_twice_is_checked_for_the_ranks_it_really_gets(tb, tmp_path):
    # node01 listed by its address and again by its name: Hydra puts 2 ranks on each line, so the one board
    # gets 4. The doctor names it (under both names) with 4 ranks, and its memory and CPU checks count 4.
    a, b = tb.address("node01"), tb.address("node02")
    rc, out, rep = doctor(tb, tmp_path, "--hosts", f"{a},node01,{b}", "--ranks-per-node", "2")
    assert rc == 1, out
    assert rep["ranks_here"] == {a: 4, "node01": 4, b: 2}, rep["ranks_here"]
    for name, other in ((a, "node01"), ("node01", a)):
        pl = rep["checks"][name]["placement"]
        assert pl["ok"] is False and "MPI puts 4 ranks on this machine, listed 2 times" in pl["detail"], pl
        assert f"also as {other}" in pl["detail"] and "count 4" in pl["detail"] and "name each machine once" in pl["fix"]
        assert "for 4 ranks x 1 threads" in rep["checks"][name]["cpu"]["detail"], rep["checks"][name]["cpu"]
        assert "4 ranks x" in rep["checks"][name]["memory"]["detail"], rep["checks"][name]["memory"]
    assert rep["checks"][b]["placement"]["ok"] and "2 ranks here" in rep["checks"][b]["placement"]["detail"]
    assert "for 2 ranks x 1 threads" in rep["checks"][b]["cpu"]["detail"]
    assert "node01" in out and "4 ranks" in out  # the table says it too


def test_node_with_too_little_memory(tb, tmp_path):
    from pilab.config import Config
    from pilab.engine.memory import predict_peak_bytes
    need = 2 * predict_peak_bytes(Config(width=0.25, batch_size=16, threads=1), np_=2 * len(tb.hosts),
                                 allocator="lean")  # what a rank needs (doctor.predicted_peak)
    # enough for the probe itself (Python + torch), not for two ranks of the run
    limit = max(450 * 2 ** 20, int(0.6 * need))
    assert limit < need
    testbed.limit_memory(tb, "node03", limit)
    try:
        rc, out, rep = doctor(tb, tmp_path)
    finally:
        testbed.limit_memory(tb, "node03", 0)
    bad = tb.address("node03")
    assert rc == 1 and failing(rep) == {(bad, "memory")}, out
    c = rep["checks"][bad]["memory"]
    assert "cgroup limit" in c["detail"] and "will not fit" in c["detail"] and "--ranks-per-node" in c["fix"]
    assert 0 <= limit - rep["probes"][bad]["memory"]["cgroup"]["limit"] < 4096  # the kernel rounds to a page
    assert rep["predicted_peak_bytes"] * 2 == need


def test_a_throttled_node_is_named_with_its_fix(tb, tmp_path):
    # node03 at a fifth of a core (a CPU quota: a hot or a slower board). The speed check times the run's
    # own training step on every host at once, as the run will: node03's is a fraction of the others', and
    # the check says why (the quota held it back) and what to do; the cpu check already says its quota
    # cannot hold 2 ranks x 1 thread. Only node03 is named.
    testbed.throttle(tb, "node03", 0.2)
    try:
        rc, out, rep = doctor(tb, tmp_path, "--speed")
    finally:
        testbed.throttle(tb, "node03", 0)
    bad = tb.address("node03")
    assert rc == 1 and failing(rep) == {(bad, "cpu")}, out
    assert (bad, "speed") in failing(rep, speed=True), out
    c = rep["checks"][bad]["speed"]
    assert "a CPU quota of 0.2 cores for 1 thread(s)" in c["detail"] and "every step waits for it" in c["detail"]
    assert "testbed throttle node03 none" in c["fix"] and f"leave {bad} out of the hostfile" in c["fix"]
    assert "--balance static" in c["fix"]
    speeds = {h: s["images_per_s"] for h, s in zip(rep["net"]["hosts"], rep["net"]["speeds"])}
    assert speeds[bad] < 0.5 * max(speeds.values()), speeds  # a fifth of a core: far below the others'
    assert all(s["batch"] == 16 and s["threads"] == 1 for s in rep["net"]["speeds"])
    assert f"✗ {bad} speed: " in out and "images/s a rank" in out


@pytest.mark.parametrize("args, words", [
    (["--hostfile", "/nonexistent/hosts"], "does not exist"),
    (["--hosts", ","], "names no host"),
    (["--hosts", "a:x"], "not host or host:slots"),
    (["--hosts", "a", "--ranks-per-node", "0"], "must be >= 1"),
    (["--hosts", "a", "--answer-s", "0"], "must be > 0"),
    (["--hosts", "a", "--data", "/nonexistent/cifar.tar.gz"], "does not exist"),
    (["--hosts", "a", "--hostfile", "x"], "not allowed with"),
])
def test_bad_input_exits_2_with_one_line(args, words, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli_main(["doctor", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pilab: error:") and words in err, err
    assert not out.exists()


def test_mpi_library_of_the_launcher():
    """The "every rank is 0 of 1" check compares these two names (no second MPI is installed here)."""
    from conftest import MPIEXEC
    from pilab.launch import mpiexec_library, same_family
    launcher = mpiexec_library(MPIEXEC)
    assert launcher.startswith("MPICH ") and launcher.endswith("(Hydra)")
    # mpi4py's library, asked in a process of its own (this one must not initialise MPI)
    lib = subprocess.run([sys.executable, "-c", "from pilab.doctor.probe import mpi_library; "
                          "print(mpi_library()['library'])"], capture_output=True, text=True,
                         env=mpi_env(), timeout=120, check=True).stdout.strip()
    assert lib.startswith("MPICH Version")
    assert same_family(lib, launcher)
    assert not same_family("Open MPI v4.1.4, package: Debian OpenMPI", launcher)
    assert not same_family(lib, "Open MPI 4.1.4")


def test_open_mpis_mpiexec_exits_2_with_the_fix(tmp_path, capsys):
    # What a Raspberry Pi OS user gets from `apt-get install mpich python3-mpi4py` (the emulated Pi of
    # docs/arm64.md): Open MPI's mpiexec, which answered every probe with 'unknown option "-f"' and a fix
    # about ssh. Its `--version`, as Debian bookworm's openmpi-bin 4.1.4 prints it; nothing is launched.
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] || { echo launched >> \"$0.log\"; exit 1; }\n"
                    "printf 'mpiexec (OpenRTE) 4.1.4\\n\\nReport bugs to http://www.open-mpi.org/community/help/\\n'\n")
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    assert cli_main(["doctor", "--hosts", "localhost", "--mpiexec", str(fake), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("pilab: error:"), err
    assert "Open MPI 4.1.4" in err and "mpiexec -f HOSTFILE" in err and "PILAB_SYSTEM_MPI" in err, err
    assert not out.exists() and not (tmp_path / "mpiexec.log").exists()
