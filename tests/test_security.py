"""Safe on a shared cluster (issue 52, docs/security.md), the parts that need no testbed: the doctor's
listener answers only its run's secret on one address; host names a shell or ssh would read are refused;
batch scripts, the testbed's mounts script and the HTML reports keep a path or a name as text; a resume
or a study's reuse refuses changed data or an edited model builder; --overwrite removes every file of a
run; results reach the disk; an unreadable checkpoint is never taken for a damaged one; reading a result
never runs the code of the model builder it names.

The testbed's own tests (tests/test_testbed.py: a stranger's failure line to a running job's watchdog, `ss`
during a run, an unprivileged user's train, a planted state directory), the doctor's placement of a node
listed twice (tests/test_doctor.py) and a study in a folder with a space and a '%' under a real Slurm
(tests/test_slurm.py) are beside the tests of the same machinery.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import mpi_env

from pilab import resultfile

REPO = Path(__file__).resolve().parent.parent
TINY = ["--width", "0.25", "--batch-size", "16", "--threads", "1", "--quiet"]
STUDY_TINY = [a for a in TINY if a != "--quiet"]  # scale takes no --quiet


def pilab(*args, cwd, env=None, timeout=300, user=None):
    cmd = [sys.executable, "-m", "pilab", *args]
    if user:
        cmd = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups", *cmd]
    return subprocess.run(cmd, cwd=cwd, env=env or mpi_env(), capture_output=True, text=True, timeout=timeout)


def one_error(p, code=2) -> str:
    # a study's header line ("pilab scale: measured np ..., writing OUT") may come first
    lines = [ln for ln in p.stderr.splitlines()
             if ln.strip() and not ln.startswith(("launching:", "pilab scale: measured"))]
    assert p.returncode == code and len(lines) == 1 and lines[0].startswith("pilab: error:"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    return lines[0]


# ----------------------------------------------------------------------------------------------
# 1. listeners: one address, the run's secret
# ----------------------------------------------------------------------------------------------
def test_the_side_channel_binds_the_hosts_address_on_the_shared_network():
    from pilab.engine.watchdog import cluster_address
    # a node with a campus interface and the cluster's: the one the other hosts share is chosen
    assert cluster_address(["192.168.1.5/24", "10.0.0.5/24"], [["10.0.0.6/24", "172.16.0.6/16"],
                                                               ["10.0.0.7/24"]]) == "10.0.0.5"
    assert cluster_address(["10.0.0.5/24", "192.168.1.5/24"], [["192.168.1.9/24"]]) == "192.168.1.5"
    with pytest.raises(OSError):
        cluster_address([], [["10.0.0.6/24"]])


def test_the_doctors_listener_answers_only_its_runs_secret(capsys):
    from pilab.doctor.preflight import ClockListener
    from pilab.doctor.probe import talk_to_head
    listener = ClockListener("127.0.0.1")
    try:
        head = f"127.0.0.1:{listener.port}"
        for guess in ("", "0" * 32):  # a stranger: nothing back, logged once
            with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as s:
                s.sendall(f"{guess}\n1.0\n".encode())
                s.settimeout(5)
                assert s.recv(100) == b""
        assert talk_to_head(head)["reachable"] is False  # the probe without the secret gets no clock
        os.environ["PILAB_DOCTOR_SECRET"] = listener.secret
        try:
            ok = talk_to_head(head)
        finally:
            del os.environ["PILAB_DOCTOR_SECRET"]
        assert ok["reachable"] and abs(ok["offset_s"]) < 1.0
        assert listener.foreign == ["127.0.0.1"] * 3 and listener.peers == ["127.0.0.1"]
        said = [ln for ln in capsys.readouterr().err.splitlines() if "without this run's secret" in ln]
        assert len(said) == 1, said
    finally:
        listener.close()


def test_the_doctor_binds_the_address_it_advertises():
    from pilab.doctor import controller_address
    assert controller_address(None, {"PILAB_CONTROLLER_IP": "10.77.0.1"}) == ("10.77.0.1", "10.77.0.1")
    bind, told = controller_address(None, {})
    assert bind == told and bind != "0.0.0.0"


def test_the_cluster_profiles_listen_on_the_cluster_address_with_curvezmq(monkeypatch):
    # what ipyparallel reads: the controller's bind address is the one it advertises; CurveZMQ on, with
    # a message-signing key of its own
    from traitlets.config.loader import PyFileConfigLoader
    monkeypatch.setenv("PILAB_CONTROLLER_IP", "10.77.0.1")
    monkeypatch.setenv("PILAB_HOSTFILE", str(REPO / "profiles" / "profile_pi" / "hosts.template"))
    for name in ("profile_pi", "profile_slurm"):
        d = str(REPO / "profiles" / name)
        c = PyFileConfigLoader("ipcluster_config.py", path=d).load_config()
        assert c.Cluster.controller_ip == c.Cluster.controller_location == "10.77.0.1", name
        ctl = PyFileConfigLoader("ipcontroller_config.py", path=d).load_config()
        assert ctl.IPController.enable_curve is True and len(ctl.Session.key) == 64, name
    monkeypatch.delenv("PILAB_CONTROLLER_IP")
    c = PyFileConfigLoader("ipcluster_config.py", path=str(REPO / "profiles" / "profile_slurm")).load_config()
    assert c.Cluster.controller_ip == c.Cluster.controller_location != "0.0.0.0"


# ----------------------------------------------------------------------------------------------
# 5. paths and names
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/pilab-pwned", "pi01;id", "pi 01", "$(id)", "pi01`id`"])
def test_a_host_name_a_shell_or_ssh_would_read_is_refused_in_one_line(host, tmp_path):
    p = pilab("doctor", "--hosts", f"pi00,{host}", cwd=tmp_path)
    assert "is not a host name or address" in one_error(p) and repr(host) in p.stderr
    hosts = tmp_path / "hosts"
    hosts.write_text(f"pi00:2\n{host}:2\n")
    p = pilab("scale", "--nps", "2", "--simulate-nps", "", "--hostfile", str(hosts), *STUDY_TINY, "--out",
              str(tmp_path / "s"), cwd=tmp_path)
    assert f"hostfile {hosts} line 2" in one_error(p) and not (tmp_path / "s").exists()
    assert not os.path.exists("/tmp/pilab-pwned")


def test_batch_scripts_quote_paths_and_keep_a_percent_sign_literal():
    from pilab.launch import slurm
    out = "/home/me/my runs/50% data"
    text = slurm.job_script(["python", "-m", "pilab", "train", "--out", f"{out}/np2"], name="pilab-np2",
                            partition="pi", time="10", nodes=1, ntasks=2, ntasks_per_node=2,
                            log=os.path.join(slurm.literal(out), "np2", "slurm-%j.log"), chdir=out)
    lines = text.splitlines()
    assert "#SBATCH --output='/home/me/my runs/50%% data/np2/slurm-%j.log'" in lines
    assert "#SBATCH --chdir='/home/me/my runs/50% data'" in lines
    assert lines[-1] == "exec " + shlex.join(["python", "-m", "pilab", "train", "--out", f"{out}/np2"])
    for bad, word in ((f"{out}\nexec rm -rf ~", "control character"), ("C:\\runs", "backslash")):
        with pytest.raises(slurm.SlurmError, match=word):
            slurm.job_script(["true"], name="x", partition="pi", time="1", nodes=1, ntasks=1, ntasks_per_node=1,
                             log="x.log", chdir=bad)


def test_profile_slurms_batch_template_quotes_its_paths(monkeypatch, tmp_path):
    from traitlets.config.loader import PyFileConfigLoader
    odd = tmp_path / "my {venv} $(id)"
    odd.mkdir()
    mpx = odd / "mpiexec"
    mpx.write_text("#!/bin/sh\n")
    mpx.chmod(0o755)
    monkeypatch.setenv("PILAB_MPIEXEC", str(mpx))
    monkeypatch.setenv("PILAB_CONTROLLER_IP", "10.77.0.1")
    c = PyFileConfigLoader("ipcluster_config.py", path=str(REPO / "profiles" / "profile_slurm")).load_config()
    # ipyparallel fills the template with str.format, then sbatch runs it with sh
    script = c.SlurmEngineSetLauncher.batch_template.format(n=4, cluster_id="c1", program_and_args="prog")
    exec_line = script.strip().splitlines()[-1]
    assert shlex.split(exec_line)[1] == str(mpx), exec_line


def test_the_mounts_script_keeps_a_path_with_shell_text_as_text(tmp_path, monkeypatch):
    # root sources mounts.sh in every job's mount namespace: an overlay whose path holds `$(...)` must
    # be text there, also in the line that says the bind failed
    from pilab import testbed
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("sourcing the mounts script in a mount namespace of its own needs root and unshare")
    monkeypatch.setenv("PILAB_TESTBED_DIR", str(tmp_path))
    tb = testbed.Testbed(nodes=1, name="pilabm", subnet="10.79.9.0/24")
    testbed.check_state_dir(tb.name, create=True)
    marker = tmp_path / "ran"
    src = tmp_path / "a $(touch ran) `touch ran` b"  # run in tmp_path, it would leave `ran` there
    dst = tmp_path / "dst"
    src.write_text("x")
    dst.write_text("y")
    testbed.overlay(tb, "node01", str(src), str(dst))
    dst.unlink()  # the bind now fails: the message line runs too
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f". {shlex.quote(os.path.join(tb.state_dir, 'mounts.sh'))}", "sh", "node01"],
                       capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert p.returncode == 1 and f"cannot bind {src} over {dst} on node01" in p.stderr, p.stderr
    assert not marker.exists()


def test_html_reports_and_the_panel_show_names_and_errors_as_text():
    from pilab import plots
    from pilab.lab.widgets import ControlPanel
    evil = "<img src=x onerror=alert(1)>"
    live = plots.LivePlot()
    live({"kind": "start", "np": 2, "config": {"model": evil, "width": 1.0}, "epochs": 1, "steps_per_epoch": 3})
    assert evil not in live.title.text and "&lt;img" in live.title.text
    live({"kind": "error", "message": evil})
    assert evil not in live.title.text and "&lt;img" in live.title.text
    panel = ControlPanel(None, settings_only=True)

    def boom():
        raise ValueError(evil)
    panel._guard(boom)
    assert evil not in panel.status.value and "&lt;img" in panel.status.value
    from pilab.study import report
    from test_reports import _pi_study
    from pilab.config import Config
    st = {**_pi_study(), "config": {**Config().to_dict(), "model": f"nets.py:{evil}", "data": evil},
          "baseline_np": 2, "command": evil}
    page = report.report_html(st)
    # the page carries the Div's HTML inside an escaped JSON script: an unescaped name would read
    # "&lt;img" there (markup in the Div), an escaped one "&amp;lt;img" (text)
    assert "&lt;img" not in page and page.count("&amp;lt;img src=x onerror=alert(1)&amp;gt;") >= 3


# ----------------------------------------------------------------------------------------------
# 3. runs that cannot mix
# ----------------------------------------------------------------------------------------------
BUILDER = '''import torch.nn as nn


def build(num_classes):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, num_classes))
'''


@pytest.fixture
def folder(tmp_path):
    """A real ImageFolder (train/<class>/*.png, test/<class>/*.png): 8 + 2 images of each of the embedded
    subset's ten classes, written as PNG files."""
    from PIL import Image

    from pilab import data
    ds = data.load("embedded")
    root = tmp_path / "images"
    for split, xs, ys, per in (("train", ds.x_train, ds.y_train, 8), ("test", ds.x_test, ds.y_test, 2)):
        for c, name in enumerate(ds.classes):
            (root / split / name).mkdir(parents=True)
            for i, k in enumerate(np.flatnonzero(ys == c)[:per]):
                Image.fromarray(xs[k]).save(root / split / name / f"{i:03d}.png")
    return root


def test_resume_and_reuse_refuse_changed_data_or_an_edited_model(folder, tmp_path):
    env = mpi_env(PILAB_CACHE=str(tmp_path / "cache"))
    model = tmp_path / "nets.py"
    model.write_text(BUILDER)
    run = ["--data", str(folder), "--model", f"{model}:build", "--epochs", "2", *TINY]
    p = pilab("train", *run, "--checkpoint-every", "1", "--max-steps", "5", "--out", str(tmp_path / "r"),
              cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    ck = tmp_path / "r" / "checkpoint.pt"
    res = json.loads((tmp_path / "r" / "result.json").read_text())
    assert res["model_source"]["file"] == str(model) and len(res["model_source"]["sha256"]) == 64
    study = ["--data", str(folder), "--model", f"{model}:build", "--epochs", "1", "--nps", "", "--simulate-nps",
             "2", "--target", "this", "--train-subset", "80", "--test-subset", "20", *STUDY_TINY]
    p = pilab("scale", *study, "--out", str(tmp_path / "s"), cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    # one image of one class changed (its pixels, as an edit would)
    from PIL import Image
    img = folder / "train" / "cat" / "003.png"
    original = np.asarray(Image.open(img)).copy()
    edited = original.copy()
    edited[:4] = 255 - edited[:4]
    Image.fromarray(edited).save(img)
    p = pilab("train", *run, "--checkpoint-every", "1", "--resume", str(ck), "--out", str(tmp_path / "r"),
              cwd=tmp_path, env=env)
    line = one_error(p)
    assert f"{ck} was made on other data: the contents of {str(folder)!r} changed since" in line, line
    assert "--overwrite" in line
    p = pilab("scale", *study, "--resume", "--out", str(tmp_path / "s"), cwd=tmp_path, env=env)
    line = one_error(p)
    assert "np2/result.json was trained on other data" in line and str(folder) in line, line
    p = pilab("scale", *study, "--reuse", str(tmp_path / "s"), "--out", str(tmp_path / "s2"), cwd=tmp_path, env=env)
    assert "np2/result.json was trained on other data" in one_error(p)
    # the data put back, the model's file edited: named too
    Image.fromarray(original).save(img)
    model.write_text(BUILDER.replace("nn.Conv2d(3, 8, 3, padding=1)", "nn.Conv2d(3, 8, 5, padding=2)"))
    p = pilab("train", *run, "--checkpoint-every", "1", "--resume", str(ck), "--out", str(tmp_path / "r"),
              cwd=tmp_path, env=env)
    line = one_error(p)
    assert f"was made with another version of your model: {model} changed since" in line, line
    p = pilab("scale", *study, "--resume", "--out", str(tmp_path / "s"), cwd=tmp_path, env=env)
    assert f"trained with another version of your model: {model} changed since" in one_error(p)
    assert ck.exists() and (tmp_path / "s" / "np2" / "result.json").exists()  # nothing removed


def test_overwrite_removes_every_file_of_the_earlier_run(tmp_path):
    out = tmp_path / "r"
    p = pilab("train", *TINY, "--train-subset", "256", "--test-subset", "100", "--epochs", "1", "--trace",
              "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0 and (out / "trace.json").exists(), p.stderr[-3000:]
    p = pilab("train", *TINY, "--train-subset", "256", "--test-subset", "100", "--epochs", "1", "--lr", "0.01",
              "--overwrite", "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (out / "trace.json").exists()  # the earlier run's trace is not this run's
    from pilab.engine.records import RUN_FILES
    assert "trace.json" in RUN_FILES


def test_a_result_is_on_the_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    from pilab import files
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    files.save_json({"np": 2}, str(tmp_path / "result.json"))
    assert any(".tmp-result.json" in s for s in synced) and str(tmp_path) in synced
    # a run's result: its per-step sidecar too, before the result.json that names it
    from pilab import resultfile
    synced.clear()
    resultfile.save({"np": 2, "steps": {"loss": [2.3, 2.2], "lr": [0.1, 0.1]}}, str(tmp_path / "r" / "result.json"))
    npz = [i for i, s in enumerate(synced) if "result.steps.npz" in s]
    js = [i for i, s in enumerate(synced) if ".tmp-result.json" in s]
    assert npz and js and npz[0] < js[0], synced


def test_an_unreadable_checkpoint_is_left_as_it_is(tmp_path):
    # Read by another account than the one that wrote it (EACCES: the disk, not the file): not "corrupt",
    # not replaced -- the train says so in one line; a remedies search does not start the candidate over.
    if os.geteuid() != 0:
        pytest.skip("needs root to run as another account")
    shared = Path(tempfile.mkdtemp(prefix="pilab-security-"))
    try:
        shared.chmod(0o755)
        out = shared / "r"
        p = pilab("train", *TINY, "--train-subset", "256", "--test-subset", "100", "--epochs", "2",
                  "--max-steps", "16", "--checkpoint-every", "1", "--out", str(out), cwd=shared)  # one epoch
        assert p.returncode == 0, p.stderr[-3000:]
        ck = out / "checkpoint.pt"
        before = ck.read_bytes()
        ck.chmod(0o600)
        cache = shared / "cache"
        cache.mkdir()
        os.chown(cache, 65534, 65534)
        env = mpi_env(PILAB_CACHE=str(cache), HOME=str(cache))
        p = pilab("train", *TINY, "--train-subset", "256", "--test-subset", "100", "--epochs", "2",
                  "--checkpoint-every", "1", "--resume", str(ck), "--out", str(out), cwd=shared, env=env,
                  user="nobody")
        if "setpriv" in p.stderr:
            pytest.skip(f"cannot run as nobody: {p.stderr.strip()}")
        line = one_error(p)
        assert "could not be read ([Errno 13] Permission denied)" in line and "left as it is" in line, line
        code = ("import sys; from pilab.config import Config; from pilab.study.remedies import resumable_checkpoint\n"
                "from pilab.engine.checkpoint import ReadError\ntry:\n    resumable_checkpoint(sys.argv[1], Config(), 1)\n"
                "except ReadError as e:\n    print('ReadError', e)\n")
        q = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                            code, str(out)], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
        assert q.stdout.startswith("ReadError") and "Permission denied" in q.stdout, q.stdout + q.stderr
        assert ck.read_bytes() == before
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# 4. reading a result runs no code
# ----------------------------------------------------------------------------------------------
def test_analysis_reads_the_recorded_model_and_never_runs_a_builder_it_did_not_name(tmp_path):
    from test_perfmodel import _synthetic_bench
    marker = "PILAB-BUILDER-RAN"
    model = tmp_path / "studentnet.py"
    model.write_text(f"print({marker!r}, flush=True)\n" + BUILDER)
    spec = f"{model}:build"
    p = pilab("train", "--model", spec, *TINY, "--train-subset", "128", "--test-subset", "64", "--epochs", "1",
              "--trace", "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert p.returncode == 0 and marker in p.stdout, p.stderr[-3000:]  # training runs your code, of course
    res = json.loads((tmp_path / "r" / "result.json").read_text())
    prof = res["model_profile"]
    assert prof["model"] == spec and prof["flops_per_image"] > 0 and prof["bn_channels"] == [8]
    assert len(prof["gradient_layout"]) == 6  # conv w/b, BN w/b, linear w/b
    (tmp_path / "bench.json").write_text(json.dumps(_synthetic_bench(2e-5, 1e-9, nps=(2, 3), cores=2)))
    cal = ["perfmodel", "calibrate", "--result", str(tmp_path / "r" / "result.json"), "--bench",
           str(tmp_path / "bench.json"), "--out", str(tmp_path / "cal.json")]
    p = pilab(*cal, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert marker not in p.stdout + p.stderr
    c = json.loads((tmp_path / "cal.json").read_text())
    assert c["flops_per_image"] == prof["flops_per_image"] and len(c["gradient_layout"]) == 6
    p = pilab("perfmodel", "validate", str(tmp_path / "r"), "--calibration", str(tmp_path / "cal.json"),
              cwd=tmp_path)
    assert p.returncode == 0 and marker not in p.stdout + p.stderr, p.stderr[-3000:]
    # a result that records no profile (an older pilab's): refused in one line, unless you name the builder
    old = resultfile.load(str(tmp_path / "r" / "result.json"))  # with its per-step series (pilab.resultfile)
    del old["model_profile"]
    resultfile.save(old, str(tmp_path / "old.json"))
    cal[cal.index("--result") + 1] = str(tmp_path / "old.json")
    p = pilab(*cal, cwd=tmp_path)
    line = one_error(p)
    assert marker not in p.stdout and f"--model {spec}" in line and "would run" in line, line
    p = pilab(*cal, "--model", spec, cwd=tmp_path)
    assert p.returncode == 0 and marker in p.stdout, p.stderr[-3000:]
