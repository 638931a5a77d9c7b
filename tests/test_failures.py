"""The failure matrix: what a user sees when input is bad, a run is interrupted, a checkpoint or the disk
is at fault, and whether results are deterministic and every sample is used once.

Each case runs the real command (``python -m pilab ...``, real ``mpiexec`` ranks, real files under
tmp_path) and asserts the message, the exit code and what is left on disk. Seconds per case are
recorded (never asserted) in test-artifacts/failure_matrix.json for the README's table.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import MPIEXEC, REPO, mpi_env
from pilab import resultfile

HERE = Path(__file__).parent
ARTIFACTS = REPO / "test-artifacts"
MATRIX: dict = {}
TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet"]
SCALE = TINY[:-1]  # scale has no progress bar to quiet
NO_MPI = {"MPI4PY_LIBMPI": "/nonexistent/libmpi.so"}  # mpi4py then cannot load any MPI library


@pytest.fixture(scope="module", autouse=True)
def _record():
    yield
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "failure_matrix.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(MATRIX)
    path.write_text(json.dumps(old, indent=1, sort_keys=True))


def note(case: str, **facts) -> None:
    MATRIX[case] = facts


def pilab(*args, cwd, timeout=300, launcher=None, env=None, user=None):
    cmd = [sys.executable, "-m", "pilab", *args]
    if launcher:
        cmd = [MPIEXEC, "-n", str(launcher)] + cmd
    if user:
        cmd = ["setpriv", f"--reuid={user}", "--regid=nogroup", "--clear-groups"] + cmd
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env())
    p.seconds = round(time.monotonic() - t, 2)
    return p


def error_lines(p) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("launching:")]


def one_line_error(p, code: int, *words: str) -> str:
    assert p.returncode == code, (p.returncode, p.stderr[-3000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = error_lines(p)
    assert len(lines) == 1 and lines[0].startswith("pilab: error:"), p.stderr[-3000:]
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def files_in(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()) if d.exists() else []


def start(args, *, cwd, env=None):
    """``python -m pilab ARGS`` in a session of its own: a signal to its group is what a terminal's
    Ctrl-C does (the shell's foreground group), never reaching pytest."""
    return subprocess.Popen([sys.executable, "-m", "pilab", *args], cwd=cwd, env=env or mpi_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(path: Path, proc, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited {proc.returncode} before {path} appeared: {proc.stderr.read()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.05)


def descendants_alive(pids) -> list[int]:
    import psutil
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


def tree(pid: int) -> list[int]:
    import psutil
    with contextlib.suppress(psutil.NoSuchProcess):
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return []


def checkpoint_run(out: Path, cwd: Path, *extra, epochs=2):
    p = pilab("train", *TINY, "--epochs", str(epochs), "--checkpoint-every", "1", "--out", str(out), *extra,
              cwd=cwd)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


# ----------------------------------------------------------------------------------------------
# 1. bad input and a machine without MPI: one line, exit 2, nothing written
# ----------------------------------------------------------------------------------------------
def test_resume_from_a_file_that_is_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(4096))
    p = pilab("train", *TINY, "--epochs", "1", "--resume", str(junk), "--out", str(tmp_path / "o"), cwd=tmp_path)
    one_line_error(p, 2, "not a pilab checkpoint")
    assert not (tmp_path / "o").exists()
    note("resume: not a checkpoint", exit=p.returncode, seconds=p.seconds, message=error_lines(p)[0])


def test_perfmodel_predict_np0(tmp_path):
    p = pilab("perfmodel", "predict", "--np", "0", cwd=tmp_path)
    one_line_error(p, 2, "--np 0 must be >= 1")
    note("perfmodel predict --np 0", exit=2, seconds=p.seconds, message=error_lines(p)[0])


def test_no_mpi_library_is_reproduced_by_the_environment(tmp_path):
    p = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True,
                       env=mpi_env(**NO_MPI))
    assert p.returncode != 0 and "cannot load MPI library" in p.stderr


@pytest.mark.parametrize("args", [
    ["--help"], ["train", "--help"],
    ["simulate", "--np", "2", *TINY, "--epochs", "1", "--out", "sim"],
    ["train", *TINY, "--epochs", "1", "--out", "alone"],
    ["perfmodel", "table"], ["perfmodel", "predict", "--np", "4"],
    ["data", "info"], ["data", "cache"],
], ids=["help", "train-help", "simulate", "train-one-process", "perfmodel-table", "perfmodel-predict",
        "data-info", "data-cache"])
def test_commands_that_need_no_mpi_work_without_it(tmp_path, args):
    p = pilab(*args, cwd=tmp_path, env=mpi_env(**NO_MPI))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    note(f"no MPI library: {' '.join(args[:2])}", exit=0, seconds=p.seconds)


@pytest.mark.parametrize("args, launcher", [
    (["train", *TINY, "--np", "2", "--epochs", "1"], None),
    (["train", *TINY, "--epochs", "1"], 2),
    (["scale", *SCALE, "--nps", "1,2", "--simulate-nps", "", "--epochs", "1"], None),
    (["perfmodel", "bench", "--np", "2", "--sizes", "4"], None),
], ids=["train--np", "mpiexec-train", "scale", "perfmodel-bench"])
def test_commands_that_need_mpi_say_how_to_get_it(tmp_path, args, launcher):
    p = pilab(*args, cwd=tmp_path, launcher=launcher, env=mpi_env(**NO_MPI), timeout=120)
    one_line_error(p, 2, "pip install mpich")
    assert not (tmp_path / "runs").exists()
    note(f"no MPI library: {' '.join(([f'mpiexec -n {launcher}'] if launcher else []) + args[:1])}",
         exit=2, seconds=p.seconds, message=error_lines(p)[0])


@pytest.mark.mpi
def test_a_failed_job_names_itself_its_exit_code_and_its_stderr(tmp_path):
    # Every launcher in pilab goes through launch.run_job: a job that fails is one error naming it,
    # its exit code and the end of what it said (here: a setting one rank refuses, exit 2).
    from pilab import launch
    from pilab.study import scaling
    from pilab.config import Config
    cfg = Config(width=0.25, train_subset=8, test_subset=20, batch_size=16, threads=1, epochs=1)
    with pytest.raises(launch.JobError) as e:
        scaling.run_measured(cfg, 2, str(tmp_path / "np2"))
    assert e.value.code == 2 and isinstance(e.value, RuntimeError)
    text = str(e.value)
    assert text.startswith("np=2 run failed (exit 2):") and "fewer than its batch of 16" in text, text
    assert os.listdir(tmp_path / "np2") == []  # the job's answer folder is gone again
    with pytest.raises(launch.JobError, match=r"(?s)the pilab.nope job \(np=1\) failed \(exit 1\).*No module"):
        launch.run_job(1, "pilab.nope", mpiexec=MPIEXEC)


def test_a_job_payload_becomes_the_entry_modules_flags():
    from pilab.launch import job_argv
    assert job_argv({"quick": True, "dry": False, "skip": None, "sizes": [4, 64], "batch_size": 8,
                     "config": {"width": 0.5}}) == \
        ["--quick", "--sizes", "4", "64", "--batch-size", "8", "--config", '{"width": 0.5}']


def test_python_entry_points_import_without_mpi(tmp_path):
    code = ("from pilab import dist, engine; from pilab.engine import checkpoint; "
            "from pilab.lab import cluster; from pilab.study import scaling; "
            "from pilab.config import Config; "
            "r = engine.train(Config(width=0.25, train_subset=64, test_subset=20, batch_size=16, epochs=1, "
            "threads=1)); print(dist.MPI is None, r['np'])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=mpi_env(**NO_MPI), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["True", "1"]


# ----------------------------------------------------------------------------------------------
# 2. an interrupted run keeps what it did
# ----------------------------------------------------------------------------------------------
def _ctrl_c(proc) -> tuple[str, float]:
    """Ctrl-C to ``proc``'s group; its stderr and the seconds until it exited."""
    t = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    return stderr, round(time.monotonic() - t, 2)


def _interrupt(tmp_path, args, out: Path, sig, *, target="group", after="checkpoint-e0001.pt", twice=False):
    proc = start(args, cwd=tmp_path)
    try:
        wait_for(out / after, proc)
        kids = tree(proc.pid)
        t = time.monotonic()
        send = (lambda s: os.killpg(proc.pid, s)) if target == "group" else proc.send_signal
        send(sig)
        if twice:
            time.sleep(0.3)
            send(sig)
        stdout, stderr = proc.communicate(timeout=120)
        seconds = round(time.monotonic() - t, 2)
        import psutil
        _, alive = psutil.wait_procs([psutil.Process(k) for k in kids if descendants_alive([k])], timeout=10)
        assert not alive, f"left behind: {alive}"
        return proc.returncode, stdout, stderr, seconds
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("how", ["one-process", pytest.param("--np2", marks=pytest.mark.mpi)])
def test_ctrl_c_stops_after_a_step_and_keeps_the_result(tmp_path, how):
    out = tmp_path / "run"
    args = ["train", *TINY, "--epochs", "40", "--checkpoint-every", "1", "--out", str(out)]
    args += ["--np", "2"] if how == "--np2" else []
    code, stdout, stderr, seconds = _interrupt(tmp_path, args, out, signal.SIGINT)
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    r = json.loads((out / "result.json").read_text())
    assert r["stopped_early"] is True and r["stop_reason"] == "interrupted by SIGINT"
    assert 1 <= r["epochs_done"] < 40 and r["steps_done"] < r["total_steps"]
    assert len(r["epochs"]) in (r["epochs_done"], r["epochs_done"] + 1)
    ck = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ck["epoch"] == r["epochs_done"]  # the last full epoch's checkpoint is there and readable
    assert f"--resume {out / 'checkpoint.pt'}" in stderr and "stopped after step" in stderr
    note(f"Ctrl-C: train {how}", exit=code, seconds=seconds, kept=files_in(out))
    # ...and resuming from it goes on where it stopped
    p = pilab("train", *TINY, "--epochs", str(r["epochs_done"] + 1), "--out", str(tmp_path / "more"),
              "--resume", str(out / "checkpoint.pt"), cwd=tmp_path)
    one_line_error(p, 2, "epochs=40", "--epochs 40")  # a checkpoint of a 40-epoch schedule


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["--np2-parent", "mpiexec"])
def test_sigterm_from_a_batch_system(tmp_path, how):
    out = tmp_path / "run"
    args = ["train", *TINY, "--epochs", "40", "--checkpoint-every", "1", "--out", str(out)]
    if how == "mpiexec":  # SIGTERM to the launcher: it passes it on to every rank
        proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "pilab", *args], cwd=tmp_path,
                                env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            wait_for(out / "checkpoint-e0001.pt", proc)
            t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=120)
            code, seconds = proc.returncode, round(time.monotonic() - t, 2)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    else:  # SIGTERM to `python -m pilab train --np 2` only: it forwards it to mpiexec
        code, _, stderr, seconds = _interrupt(tmp_path, args + ["--np", "2"], out, signal.SIGTERM,
                                              target="parent")
    assert code == 143, stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["stopped_early"] and r["stop_reason"] == "interrupted by SIGTERM" and r["np"] == 2
    assert "Traceback" not in stderr
    note(f"SIGTERM: {how}", exit=code, seconds=seconds, kept=files_in(out))


@pytest.mark.parametrize("how", ["one-process", pytest.param("--np2", marks=pytest.mark.mpi)])
def test_a_second_ctrl_c_exits_at_once(tmp_path, how):
    out = tmp_path / "run"
    args = ["train", *TINY, "--epochs", "40", "--checkpoint-every", "1", "--out", str(out), "--eval-every", "40"]
    args += ["--np", "2"] if how == "--np2" else []
    code, _, stderr, seconds = _interrupt(tmp_path, args, out, signal.SIGINT, twice=True)
    assert code != 0
    assert "interrupted" in stderr or "force abort" in stderr or "again" in stderr, stderr[-2000:]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["epoch"] >= 1  # still readable
    assert not [f for f in files_in(out) if ".tmp" in f], "no temporary file left behind"
    note(f"second Ctrl-C: train {how}", exit=code, seconds=seconds, kept=files_in(out))


def test_simulate_interrupted_keeps_its_result(tmp_path):
    out = tmp_path / "sim"
    proc = start(["simulate", "--np", "4", *TINY, "--epochs", "40", "--out", str(out)], cwd=tmp_path)
    try:
        time.sleep(8)  # set up and training (no file to wait for: the simulator writes only at the end)
        assert proc.poll() is None, proc.stderr.read()
        stderr, seconds = _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-2000:]
    r = json.loads((out / "result.json").read_text())
    assert r["stopped_early"] and r["simulated"] and r["steps_done"] < r["total_steps"]
    note("Ctrl-C: simulate --np 4", exit=130, seconds=seconds, kept=files_in(out))


def _wait_for_child(proc, prefix: list[str], timeout: float = 120) -> None:
    import psutil
    deadline = time.monotonic() + timeout
    while True:
        for c in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if c.cmdline()[:len(prefix)] == prefix:
                    return
        assert proc.poll() is None and time.monotonic() < deadline, f"no {prefix} started"
        time.sleep(0.05)


@pytest.mark.mpi
def test_scale_interrupted_keeps_finished_points_and_resume_runs_only_the_missing(tmp_path):
    out = tmp_path / "study"
    args = ["scale", *SCALE, "--epochs", "1", "--nps", "1,2", "--simulate-nps", "", "--target", "this",
            "--out", str(out)]
    proc = start(args, cwd=tmp_path)
    try:
        wait_for(out / "np1" / "result.json", proc, timeout=240)
        _wait_for_child(proc, [MPIEXEC, "-n", "2"])  # np=1 is done and counted, np=2 is running
        stderr, seconds = _ctrl_c(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr[-3000:]
    st = json.loads((out / "study.json").read_text())
    assert st["complete"] is False and st["missing"] == [2] and list(st["runs"]) == ["1"]
    assert "missing np [2]" in stderr and "--resume" in stderr
    np1 = (out / "np1" / "result.json").read_bytes()
    note("Ctrl-C: scale (mid-sweep)", exit=130, seconds=seconds, kept=files_in(out))
    # the same command again is refused (it would start over), with the way to continue
    p = pilab(*args, cwd=tmp_path, timeout=120)
    one_line_error(p, 2, "unfinished study", "--resume")
    p = pilab(*args, "--resume", cwd=tmp_path, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads((out / "study.json").read_text())
    assert st["complete"] is True and st["missing"] == [] and st["kept"] == [1]
    assert (out / "np1" / "result.json").read_bytes() == np1, "the finished point was not rerun"
    assert [r["np"] for r in st["rows"]] == [1, 2]
    note("scale --resume", exit=0, seconds=p.seconds, kept=files_in(out))


def test_scale_reuse_takes_another_rules_np1_point_and_reruns_the_rest(tmp_path):
    # Two LR-rule studies share their np=1 point (linear x 1 rank = the base lr); the second takes
    # it from the first instead of training it again, and reruns np=2, where the rules differ.
    base = ["scale", *SCALE, "--epochs", "1", "--lr-ref-batch", "16", "--nps", "", "--simulate-nps", "1,2",
            "--target", "this"]
    p = pilab(*base, "--out", str(tmp_path / "naive"), cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    naive = json.loads((tmp_path / "naive" / "np1" / "result.json").read_text())
    p = pilab(*base, "--lr-scaling", "linear", "--reuse", str(tmp_path / "naive"),
              "--out", str(tmp_path / "linear"), cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "reused from" in p.stderr and p.stderr.count("reused from") == 1, p.stderr[-3000:]
    from pilab.study import scaling
    st = scaling.load_study(str(tmp_path / "linear"))  # its runs read back from their result.json files
    assert st["kept"] == [1] and st["config"]["lr_scaling"] == "linear"
    copied = json.loads((tmp_path / "linear" / "np1" / "result.json").read_text())
    assert copied["reused_from"].endswith("np1") and copied["epochs"] == naive["epochs"]
    assert st["runs"]["2"]["peak_lr"] == 2 * naive["peak_lr"]  # np=2 ran with the linear rule
    # A directory with no study in it is refused before anything runs.
    p = pilab(*base, "--reuse", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), cwd=tmp_path)
    one_line_error(p, 2, "--reuse", "no finished study points")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# 3. checkpoints you can trust
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-epoch run with a checkpoint every epoch, the last 2 kept."""
    d = tmp_path_factory.mktemp("ck")
    checkpoint_run(d / "run", d, "--keep", "2", epochs=3)
    return d / "run"


def test_keep_k_checkpoints_and_a_checksum(trained):
    assert files_in(trained) == ["checkpoint-e0002.pt", "checkpoint-e0003.pt", "checkpoint.pt", "result.json",
                                "result.steps.npz"]
    from pilab.engine import checkpoint
    latest = torch.load(trained / "checkpoint.pt", weights_only=True)
    assert latest["epoch"] == 3 and latest["np"] == 1 and latest["format"] == checkpoint.FORMAT
    assert latest["sha256"] == checkpoint.digest(latest)
    assert (trained / "checkpoint.pt").read_bytes() == (trained / "checkpoint-e0003.pt").read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "bytes-flipped", "tensor-changed", "wrong-width", "wrong-lr"])
def test_a_bad_checkpoint_is_refused_with_the_fix(trained, tmp_path, damage):
    src = trained / "checkpoint-e0002.pt"
    bad = tmp_path / "checkpoint.pt"
    data = bytearray(src.read_bytes())
    extra, words = [], []
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
        words = ["truncated or corrupt"]
    elif damage == "bytes-flipped":
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        bad.write_bytes(data)
        words = ["corrupt"]
    elif damage == "tensor-changed":  # a valid torch file whose payload no longer matches its checksum
        ck = torch.load(src, weights_only=True)
        k = next(iter(ck["model"]))
        ck["model"][k] = ck["model"][k] + 1e-3
        torch.save(ck, bad)
        words = ["checksum does not match"]
    else:
        bad.write_bytes(data)
        extra = ["--width", "0.5"] if damage == "wrong-width" else ["--lr", "0.2"]
        words = ["width=0.25 (this run: 0.5)", "--width 0.25"] if damage == "wrong-width" else \
            ["lr=0.05 (this run: 0.2)", "--lr 0.05"]
    out = tmp_path / "o"
    p = pilab("train", *TINY, "--epochs", "3", *extra, "--resume", str(bad), "--out", str(out), cwd=tmp_path)
    line = one_line_error(p, 2, *words)
    assert not out.exists(), "nothing is written when the checkpoint is refused"
    note(f"resume: {damage} checkpoint", exit=2, seconds=p.seconds, message=line)


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["--np", "mpiexec"])
def test_a_checkpoint_of_another_np_is_refused(trained, tmp_path, how):
    args = ["train", *TINY, "--epochs", "3", "--resume", str(trained / "checkpoint.pt"), "--out",
            str(tmp_path / "o")]
    p = pilab(*args, "--np", "2", cwd=tmp_path) if how == "--np" else pilab(*args, cwd=tmp_path, launcher=2)
    line = one_line_error(p, 2, "np=1 (this run: 2)", "--np 1")
    if how == "--np":
        assert "launching" not in p.stderr, "refused before any rank starts"
    assert not (tmp_path / "o").exists()
    note(f"resume: checkpoint of np=1 at np=2 ({how})", exit=2, seconds=p.seconds, message=line)


def test_resuming_the_checkpoint_gives_the_same_result(trained, tmp_path):
    # resume epoch 2 -> 3 in a copy of the run directory: the same weights as the uninterrupted run
    import shutil
    d = tmp_path / "run"
    shutil.copytree(trained, d)
    (d / "checkpoint-e0003.pt").unlink()
    p = pilab("train", *TINY, "--epochs", "3", "--checkpoint-every", "1", "--keep", "2", "--out", str(d),
              "--resume", str(d / "checkpoint-e0002.pt"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    a = torch.load(trained / "checkpoint-e0003.pt", weights_only=True)["model"]
    b = torch.load(d / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@contextlib.contextmanager
def tiny_disk(path: Path, size: str):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_keeps_the_previous_checkpoint_and_says_so(trained, tmp_path):
    size = (trained / "checkpoint-e0003.pt").stat().st_size
    with tiny_disk(tmp_path / "disk", f"{int(size * 1.6) // 1024}k") as disk:
        out = disk / "run"
        p = pilab("train", *TINY, "--epochs", "3", "--checkpoint-every", "1", "--out", str(out), cwd=tmp_path)
        line = one_line_error(p, 74, "cannot write the checkpoint of epoch 2", "No space left on device",
                              "checkpoint-e0001.pt) is intact")
        kept = files_in(out)
        assert kept == ["checkpoint-e0001.pt", "checkpoint.pt", "result.json", "result.steps.npz"], kept
        ck = torch.load(out / "checkpoint.pt", weights_only=True)
        from pilab.engine import checkpoint
        assert ck["epoch"] == 1 and checkpoint.digest(ck) == ck["sha256"]
        r = json.loads((out / "result.json").read_text())
        assert r["stopped_early"] and r["epochs_done"] == 2 and "No space left" in r["write_error"]
    note("disk full during a checkpoint", exit=74, seconds=p.seconds, kept=kept, message=line)


@pytest.fixture
def public_tmp():
    """A directory an unprivileged user can reach (pytest's own is root's alone)."""
    import shutil
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="pilab-failures-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_read_only_directory_for_a_non_root_user(public_tmp):
    # As an unprivileged user: a first epoch is written, then the directory becomes read-only and the
    # run resumed there cannot write its next checkpoint or its result.
    tmp_path = public_tmp
    out = tmp_path / "run"
    out.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    for d in (out, cache):
        os.chown(d, 65534, 65534)
    env = mpi_env(PILAB_CACHE=str(cache), HOME=str(cache))
    p = pilab("train", *TINY, "--epochs", "2", "--max-steps", "16", "--checkpoint-every", "1", "--out",
              str(out), cwd=tmp_path, env=env, user="nobody")  # 16 steps: the first of 2 epochs
    if p.returncode != 0 and "setpriv" in p.stderr:
        pytest.skip(f"cannot run as nobody: {p.stderr.strip()}")
    assert p.returncode == 0, p.stderr[-2000:]
    before = {f: (out / f).read_bytes() for f in files_in(out)}
    out.chmod(0o555)
    try:
        p = pilab("train", *TINY, "--epochs", "2", "--checkpoint-every", "1", "--out", str(out),
                  "--resume", str(out / "checkpoint.pt"), cwd=tmp_path, env=env, user="nobody")
    finally:
        out.chmod(0o755)
    assert p.returncode == 74, p.stderr[-2000:]
    lines = error_lines(p)
    assert len(lines) == 1 and "Permission denied" in lines[0] and "checkpoint-e0001.pt) is intact" in lines[0]
    assert "result.json" in lines[0] and "Traceback" not in p.stderr
    assert {f: (out / f).read_bytes() for f in files_in(out)} == before, "earlier files untouched"
    note("read-only directory (non-root user)", exit=74, seconds=p.seconds, kept=sorted(before),
         message=lines[0])


def test_an_output_directory_of_another_run_is_refused_unless_overwrite(trained, tmp_path):
    import shutil
    d = tmp_path / "run"
    shutil.copytree(trained, d)
    before = {f: (d / f).read_bytes() for f in files_in(d)}
    p = pilab("train", *TINY, "--epochs", "1", "--lr", "0.1", "--out", str(d), cwd=tmp_path)
    line = one_line_error(p, 2, "holds the results of another run", "epochs=3 there, 1 now", "--overwrite")
    assert {f: (d / f).read_bytes() for f in files_in(d)} == before
    note("--out holds another run", exit=2, seconds=p.seconds, message=line)
    p = pilab("train", *TINY, "--epochs", "1", "--lr", "0.1", "--out", str(d), "--overwrite", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert files_in(d) == ["result.json", "result.steps.npz"], "the old run's checkpoints went with it"
    assert json.loads((d / "result.json").read_text())["config"]["lr"] == 0.1
    # the same command again is a re-run: allowed (the README's commands can be run twice)
    p = pilab("train", *TINY, "--epochs", "1", "--lr", "0.1", "--out", str(d), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    note("--out: the same command again", exit=0, seconds=p.seconds, kept=files_in(d))


def test_an_unfinished_run_is_continued_not_restarted(tmp_path):
    out = tmp_path / "run"
    checkpoint_run(out, tmp_path, "--max-steps", "16", epochs=3)  # 16 steps = 1 epoch of 3
    p = pilab("train", *TINY, "--epochs", "3", "--checkpoint-every", "1", "--out", str(out), cwd=tmp_path)
    one_line_error(p, 2, "unfinished run", f"--resume {out / 'checkpoint.pt'}")
    note("--out holds an unfinished run of the same settings", exit=2, seconds=p.seconds,
         message=error_lines(p)[0])


# ----------------------------------------------------------------------------------------------
# 4. determinism
# ----------------------------------------------------------------------------------------------
def _losses(path: Path):
    r = resultfile.load(str(path))
    return ([(e["train_loss"], e["test_loss"], e["test_acc"]) for e in r["epochs"]], r["steps"]["loss"])


@pytest.mark.mpi
def test_same_seed_same_np_gives_bitwise_the_same_losses(tmp_path):
    # Two runs at np=2, one launched by `--np 2`, one under our own mpiexec: every per-epoch and
    # per-step loss identical as floats (JSON keeps a float's exact repr).
    args = ["train", *TINY, "--epochs", "2"]
    a = pilab(*args, "--np", "2", "--out", str(tmp_path / "np"), cwd=tmp_path)
    b = pilab(*args, "--out", str(tmp_path / "mpiexec"), cwd=tmp_path, launcher=2)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr + b.stderr)[-3000:]
    la, lb = _losses(tmp_path / "np" / "result.json"), _losses(tmp_path / "mpiexec" / "result.json")
    assert la == lb
    assert len(set(la[1])) > 1, "the losses moved: a real comparison"
    note("determinism: --np 2 vs mpiexec -n 2", bitwise_equal=True, seconds=a.seconds + b.seconds,
         epoch_losses=la[0])


# ----------------------------------------------------------------------------------------------
# 5. data integrity at more process counts
# ----------------------------------------------------------------------------------------------
def _check_integrity(r: dict, np_: int) -> None:
    assert set(r["policies"]) == {"static", "reshuffle"}
    for policy, a in r["policies"].items():
        assert a["per_epoch"], policy
        for ep in a["per_epoch"]:
            assert ep["unique"] == ep["used"], f"{policy}: a sample was used twice in an epoch"
            assert ep["used"] == a["steps_per_epoch"] * a["global_batch"] == a["n_train"] - a["reported_leftover"]
            assert ep["steps_per_rank"] == [a["steps_per_epoch"]] * np_, "every rank takes the same steps"
            assert ep["labels_ok"], "each image arrived with its own label"
        assert a["images_per_epoch"] == [ep["used"] for ep in a["per_epoch"]]
        if policy == "reshuffle":
            assert a["reported_leftover"] < a["global_batch"]
        assert a["evaluations"] >= 1 and a["test_exactly_once"], (policy, a["test_seen"], a["n_test"])


@pytest.mark.mpi
@pytest.mark.parametrize("np_", [1, 2, 3, 5, 7])
def test_every_sample_once_per_epoch_on_real_ranks(tmp_path, np_):
    out = tmp_path / "integrity.json"
    t = time.monotonic()
    p = subprocess.run([MPIEXEC, "-n", str(np_), sys.executable, str(HERE / "failure_worker.py"), "integrity",
                        str(out)], capture_output=True, text=True, timeout=600, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    _check_integrity(json.loads(out.read_text()), np_)
    note(f"data integrity: mpiexec -n {np_}", seconds=round(time.monotonic() - t, 2), ok=True)


def test_every_sample_once_per_epoch_in_the_simulator_at_48(tmp_path):
    out = tmp_path / "integrity48.json"
    t = time.monotonic()
    p = subprocess.run([sys.executable, str(HERE / "failure_worker.py"), "simulate48", str(out)],
                       capture_output=True, text=True, timeout=600, env=mpi_env())
    assert p.returncode == 0, p.stderr[-3000:]
    _check_integrity(json.loads(out.read_text()), 48)
    note("data integrity: simulate --np 48", seconds=round(time.monotonic() - t, 2), ok=True)


# ----------------------------------------------------------------------------------------------
# 6. notebook faults: kernel shutdown and restart with engines running, a second cluster.start
#    (interrupting run.wait() / panel.wait() and a %%px cell: tests/test_cluster.py)
# ----------------------------------------------------------------------------------------------
_KERNEL = """
import json, os, signal, sys
from pilab.lab import cluster
profile, how = sys.argv[1], sys.argv[2]
lab = cluster.start(n=2, profile=profile)
pids = [lab.ipp_cluster.controller.process.pid] + [r["pid"] for r in lab.ranks] + \\
    [es.pid for es in lab.ipp_cluster.engines.values()]
print(json.dumps(pids), flush=True)
if how == "second":
    again = cluster.start(n=1, profile=profile)
    print(json.dumps([r["pid"] for r in again.ranks]), flush=True)
    stopped = cluster.stop_stale(profile)
    print(json.dumps(stopped), flush=True)
    again.stop(); lab.stop()
elif how == "killed":
    os.kill(os.getpid(), signal.SIGKILL)    # the kernel dies without any clean-up
# "exit": the kernel shuts down without lab.stop()
"""


@pytest.mark.mpi
def test_kernel_shutdown_restart_and_a_second_start_leave_no_orphan_engines(tmp_path):
    pytest.importorskip("ipyparallel")
    import shutil

    import psutil
    profile = tmp_path / "profile_mpi"
    shutil.copytree(REPO / "profiles" / "profile_mpi", profile, ignore=shutil.ignore_patterns("security", "log", "pid"))

    def kernel(how):
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-c", _KERNEL, str(profile), how], capture_output=True, text=True,
                           timeout=300, cwd=REPO, env=mpi_env())
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("[")]
        return p, lines, round(time.monotonic() - t, 2)

    def gone(pids, timeout=20):
        _, alive = psutil.wait_procs([psutil.Process(q) for q in pids if psutil.pid_exists(q)], timeout=timeout)
        return [q.pid for q in alive if q.status() != psutil.STATUS_ZOMBIE]

    # kernel shutdown without lab.stop(): the engines and the controller go with it
    p, (pids,), seconds = kernel("exit")
    assert p.returncode == 0, p.stderr[-2000:]
    assert gone(pids) == [], "orphans after a kernel shutdown"
    note("kernel shutdown without lab.stop()", exit=0, seconds=seconds, orphans=0)

    # a kernel killed (a forced restart) leaves them; the next start says so, stop_stale ends them
    p, (stale,), _ = kernel("killed")
    assert p.returncode == -signal.SIGKILL
    try:
        assert len([q for q in stale if psutil.pid_exists(q)]) >= 3, "the killed kernel's engines run on"
        p, (pids, again, stopped), seconds = kernel("second")
        assert p.returncode == 0, p.stderr[-3000:]
        assert "did not start still running" in p.stderr and "cluster.stop_stale(" in p.stderr
        assert "already running in this kernel" in p.stderr, "the second start in one kernel is named"
        assert len(stopped) == 1
        assert gone(stale) == [] and gone(pids + again) == []
        assert not list((profile / "security").glob("cluster-*.json")), "no cluster file left behind"
        note("kernel killed with engines running; next cluster.start + stop_stale", exit=0, seconds=seconds,
             orphans=0, message=[x for x in p.stderr.splitlines() if "stop_stale" in x][0])
    finally:
        for q in stale:
            with contextlib.suppress(psutil.Error):
                psutil.Process(q).kill()
