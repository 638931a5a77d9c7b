"""The command line, as a user runs it: `python -m pilab ...` and `mpiexec -n N python -m pilab ...`,
from a directory that is not the repository."""
import json
import re
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from conftest import MPIEXEC, mpi_env
from pilab.config import Config

TINY = ["--width", "0.25", "--train-subset", "200", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet"]


def pilab(*args, cwd, timeout=300, launcher=None, env=None):
    cmd = [sys.executable, "-m", "pilab", *args]
    if launcher:
        cmd = [MPIEXEC, "-n", str(launcher)] + cmd
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env or mpi_env())


def test_help_documents_every_option(tmp_path):
    p = pilab("train", "--help", cwd=tmp_path)
    assert p.returncode == 0
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        assert flag in p.stdout, flag
        assert Config.help(f.name), f"no help text for {f.name}"
    assert "--np" in p.stdout and "--mpiexec" in p.stdout


@pytest.mark.parametrize("args, words", [
    (["--np", "0"], "--np 0"),
    (["--batch-size", "0"], "batch_size=0"),
    (["--np", "2", "--batch-mode", "global", "--batch-size", "33"], "not divisible by np=2"),
    (["--np", "11", "--train-subset", "10"], "exceeds the 10 training images"),
    (["--bogus-option", "1"], "unrecognized arguments: --bogus-option"),
    (["--model", "resnet"], "model='resnet' is unknown"),
    (["--width", "3"], "out of range"),
    (["--bucket-tail-mb", "-1"], "bucket_tail_mb=-1.0 must be >= 0"),
    (["--lr-scaling", "cubic"], "invalid choice"),
    (["--data", "/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--hostfile", "hosts"], "--hostfile goes with --np N"),
    (["--np", "2", "--hostfile", "/nonexistent/hosts"], "--hostfile: hostfile /nonexistent/hosts does not exist"),
], ids=["np0", "batch0", "global-indivisible", "np-too-large", "unknown-option", "model", "width", "tail",
        "choice", "missing-data", "hostfile-without-np", "hostfile-missing"])
def test_bad_input_is_one_line_exit_2(tmp_path, args, words):
    p = pilab("train", *TINY, *args, cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("pilab: error:") and words in lines[0], lines[0]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "runs").exists(), "nothing may be written on bad input"


@pytest.mark.mpi
def test_bad_input_under_mpiexec_is_one_line_from_one_rank(tmp_path):
    p = pilab("train", *TINY, "--batch-size", "300", cwd=tmp_path, launcher=2, timeout=120)
    assert p.returncode == 2
    lines = [l for l in p.stderr.splitlines() if l.strip() and "launching" not in l]
    assert len(lines) == 1 and "fewer than its batch" in lines[0], p.stderr


@pytest.mark.mpi
def test_launcher_mismatch_is_refused(tmp_path):
    # What a rank sees when Open MPI's mpirun starts a program linked to pip's MPICH: the launcher
    # says 2 processes, MPI says a world of 1.
    p = pilab("train", *TINY, cwd=tmp_path, env=mpi_env(OMPI_COMM_WORLD_SIZE=2), timeout=120)
    assert p.returncode == 2
    assert "world of size 1" in p.stderr and "don't match" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["--np", "--hostfile", "mpiexec"])
def test_train_two_ranks_from_any_directory(tmp_path, how):
    """Also ``--np 2 --hostfile FILE``, the launch options every command that starts ranks shares: the
    hostfile goes to mpiexec (its -f), which places one rank on each of its two lines."""
    out = tmp_path / "run"
    args = ["train", *TINY, "--epochs", "1", "--out", str(out)]
    (tmp_path / "hosts").write_text("localhost:1\n127.0.0.1:1\n")
    p = pilab(*args, "--np", "2", "--quiet", cwd=tmp_path) if how == "--np" \
        else pilab(*args, "--np", "2", "--hostfile", "hosts", cwd=tmp_path) if how == "--hostfile" \
        else pilab(*args, cwd=tmp_path, launcher=2)
    assert p.returncode == 0, p.stderr[-3000:]
    launched = [line for line in p.stderr.splitlines() if line.startswith("launching: ")]
    assert ("-f hosts -n 2" in launched[0] and "--hostfile" not in launched[0]) if how == "--hostfile" else \
        "-f " not in "".join(launched), launched
    r = json.loads((out / "result.json").read_text())
    assert r["np"] == 2 and r["per_rank_batch"] == 16 and r["global_batch"] == 32
    assert r["config"]["width"] == 0.25 and r["data"]["sharding"] == "static"
    assert len(r["env"]["hostnames"]) == 2 and "MPICH" in r["env"]["mpi_library"]
    assert len(r["peak_mem_mb"]) == 2 and min(r["peak_mem_mb"]) > 50
    e = r["epochs"][0]
    assert e["images"] == r["steps_per_epoch"] * 32
    assert 0 <= e["test_acc"] <= 1 and e["comm"] > 0 and e["compute"] > 0
    assert len(e["per_rank"]["compute"]) == 2
    assert r["data"]["leftover"] == 200 - r["steps_per_epoch"] * 32
    assert p.stdout.count("final test acc") == 1, "only rank 0 prints"
    # what it prints is what it wrote
    m = re.search(r"np=(\d+) threads/rank=(\d+) global batch=(\d+) .*final test acc (\S+)", p.stdout)
    assert m, p.stdout
    assert (int(m[1]), int(m[2]), int(m[3])) == (2, r["threads"], 32)
    assert float(m[4]) == pytest.approx(e["test_acc"])
    assert f"result: {out / 'result.json'}" in p.stdout


@pytest.mark.mpi
def test_resume_gives_bitwise_the_same_weights(tmp_path):
    common = ["train", *TINY, "--epochs", "3", "--checkpoint-every", "1", "--np", "2"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert pilab(*common, "--out", str(full), cwd=tmp_path).returncode == 0
    spe = json.loads((full / "result.json").read_text())["steps_per_epoch"]
    # "interrupted" after one epoch (its checkpoint is written), then resumed to the end
    p = pilab(*common, "--out", str(part), "--max-steps", str(spe), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    first = torch.load(part / "checkpoint.pt", weights_only=False)
    assert first["epoch"] == 1
    p = pilab(*common, "--out", str(part), "--resume", str(part / "checkpoint.pt"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    a = torch.load(full / "checkpoint.pt", weights_only=False)
    b = torch.load(part / "checkpoint.pt", weights_only=False)
    assert a["epoch"] == b["epoch"] == 3
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    r = json.loads((part / "result.json").read_text())
    assert r["resumed_from_epoch"] == 1 and len(r["epochs"]) == 3


def test_resume_with_other_settings_is_refused(tmp_path):
    # One process, no --np: trains in this process, launches no mpiexec (hence no `mpi` mark).
    out = tmp_path / "r"
    first = pilab("train", *TINY, "--epochs", "1", "--checkpoint-every", "1", "--out", str(out),
                  cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "launching" not in first.stderr
    before = (out / "checkpoint.pt").read_bytes()
    p = pilab("train", *TINY, "--epochs", "1", "--lr", "0.2", "--resume",
              str(out / "checkpoint.pt"), cwd=tmp_path)
    assert p.returncode == 2 and "different lr" in p.stderr
    assert "Traceback" not in p.stderr
    # refused before training: the checkpoint is untouched and the default --out was never created
    assert (out / "checkpoint.pt").read_bytes() == before
    assert not (tmp_path / "runs").exists()
