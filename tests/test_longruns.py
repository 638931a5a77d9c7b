"""Long runs (issue 19): mid-epoch checkpoints that resume bitwise, a resume at another np with a fixed
global batch, aborts that keep what was done, live straggler warnings.

Real commands (``python -m pilab train``, real ``mpiexec`` ranks), real stops (``--max-steps``,
SIGTERM), real files under tmp_path; the simulator in this process. Testbed cases (a lost link, a
killed node, a CPU-limited node, a slow link) are in tests/test_longruns_testbed.py. Figures (diffs,
checkpoint cost) go to test-artifacts/longruns.json for the README and the closing note.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import MPIEXEC, REPO, mpi_env
from served import served_batches

from pilab import engine, resultfile
from pilab.config import Config

ARTIFACTS = REPO / "test-artifacts"
RECORD: dict = {}
TINY = ["--width", "0.25", "--train-subset", "256", "--test-subset", "100", "--batch-size", "16",
        "--threads", "1", "--quiet"]
# the simulator: 8 virtual ranks of 4 images (a fixed global batch of 32), 8 steps per epoch
SIM = Config(width=0.25, train_subset=256, test_subset=100, batch_mode="global", batch_size=32, epochs=2,
             threads=1)


@pytest.fixture(scope="module", autouse=True)
def _record():
    yield
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "longruns.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(RECORD)
    path.write_text(json.dumps(old, indent=1, sort_keys=True))


def pilab(*args, cwd, timeout=300, launcher=None, env=None):
    cmd = [sys.executable, "-m", "pilab", *args]
    if launcher:
        cmd = [MPIEXEC, "-n", str(launcher)] + cmd
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or mpi_env())
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


def result(d: Path) -> dict:
    return resultfile.load(str(d / "result.json"))


def weights(path: Path) -> dict:
    return torch.load(path, weights_only=True)["model"]


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0 for k in a)


def loss_diff(a: list, b: list) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# 1. mid-epoch checkpoints: --resume continues bitwise as if never stopped
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("np_", [1, pytest.param(2, marks=pytest.mark.mpi)])
def test_a_mid_epoch_checkpoint_resumes_bitwise(tmp_path, np_):
    # np 1: stopped by --max-steps in the middle of epoch 2; np 2 (real mpiexec): stopped by SIGTERM at
    # whatever step it arrives, which writes a checkpoint at that step. Both resume to the end.
    launch = ["--np", "2"] if np_ == 2 else []
    run = ["train", *TINY, "--epochs", "2", "--checkpoint-every", "2", *launch]
    whole, part = tmp_path / "whole", tmp_path / "part"
    p = pilab(*run, "--out", str(whole), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    spe = result(whole)["steps_per_epoch"]
    if np_ == 1:
        p = pilab(*run, "--max-steps", str(spe + 5), "--checkpoint-every-steps", "3", "--out", str(part),
                  cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        code = 0
    else:
        proc = subprocess.Popen([sys.executable, "-m", "pilab", *run, "--checkpoint-every-steps", "3",
                                 "--out", str(part)], cwd=tmp_path, env=mpi_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 200
            while not list(part.glob("checkpoint-e0000-s*.pt")):  # one mid-epoch save done
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            t = time.monotonic()
            _, stderr = proc.communicate(timeout=120)
            RECORD["sigterm_mid_epoch_np2_exit_s"] = round(time.monotonic() - t, 1)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.returncode
        assert code == 143, stderr[-3000:]
    first = result(part)
    assert first["checkpoints"]["every_minutes"] == 0.0  # one host: no default time-based checkpoints
    ck = torch.load(part / "checkpoint.pt", weights_only=True)
    stopped_at = first["steps_done"]
    assert ck["step"] == stopped_at and first["last_checkpoint"] == str(part / "checkpoint.pt")
    if stopped_at % spe:  # mid-epoch: the file says where, and holds every rank's state
        assert ck["step_in_epoch"] == stopped_at % spe and len(ck["ranks"]) == np_
        assert (part / f"checkpoint-e{stopped_at // spe:04d}-s{stopped_at % spe:05d}.pt").exists()
    p = pilab(*run, "--out", str(part), "--resume", str(part / "checkpoint.pt"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    second, ref = result(part), result(whole)
    assert second["resumed_from_step"] == stopped_at and second["steps_done"] == ref["steps_done"]
    losses = loss_diff(ref["steps"]["loss"], first["steps"]["loss"][:stopped_at] + second["steps"]["loss"])
    w = max_diff(weights(whole / "checkpoint.pt"), weights(part / "checkpoint.pt"))
    epoch_loss = loss_diff([e["train_loss"] for e in ref["epochs"]], [e["train_loss"] for e in second["epochs"]])
    RECORD[f"mid_epoch_resume_np{np_}"] = {"stopped_at_step": stopped_at, "steps_per_epoch": spe,
                                           "stop": "SIGTERM" if np_ == 2 else "--max-steps", "exit": code,
                                           "step_loss_max_diff": losses, "weights_max_diff": w,
                                           "epoch_loss_max_diff": epoch_loss,
                                           "save_s": first["checkpoints"]["seconds"],
                                           "checkpoint_bytes": first["checkpoints"]["bytes"]}
    assert losses == 0.0 and w == 0.0 and epoch_loss == 0.0, RECORD[f"mid_epoch_resume_np{np_}"]


@pytest.fixture(scope="module")
def sim_whole(tmp_path_factory):
    """The uninterrupted simulator run at np 8, with the training indices of every (epoch, step)."""
    d = tmp_path_factory.mktemp("sim")
    with recorded_batches() as used:
        res, model = engine.fit(replace(SIM, out=str(d / "whole")), engine.VirtualRanks(8))
    return res, model.state_dict(), dict(used)


class recorded_batches:
    """Record which training images each (epoch, step) used, over all (virtual) ranks: the loader's own
    indices, read as it serves each batch (``served.served_batches``)."""

    def __enter__(self):
        self.used = {}

        def record(loader, epoch, step, y):
            self.used.setdefault((epoch, step), []).extend(int(i) for i in loader.global_indices(epoch)[step])
        self.served = served_batches(record).__enter__()
        return self.used

    def __exit__(self, *exc):
        self.served.__exit__(*exc)


def test_the_simulator_resumes_mid_epoch_bitwise(sim_whole, tmp_path):
    ref, ref_w, _ = sim_whole
    part = str(tmp_path / "part")
    first, _ = engine.fit(replace(SIM, out=part, max_steps=11, checkpoint_every_steps=4), engine.VirtualRanks(8))
    assert os.path.exists(os.path.join(part, "checkpoint-e0001-s00003.pt"))  # 8 + 3 steps
    second, model = engine.fit(replace(SIM, out=part, resume=os.path.join(part, "checkpoint.pt")),
                                 engine.VirtualRanks(8))
    losses = loss_diff(ref["steps"]["loss"], first["steps"]["loss"] + second["steps"]["loss"])
    w = max_diff(ref_w, model.state_dict())  # every virtual rank's BatchNorm rows included
    RECORD["mid_epoch_resume_sim8"] = {"stopped_at_step": 11, "step_loss_max_diff": losses,
                                       "weights_max_diff": w, "checkpoint_bytes": first["checkpoints"]["bytes"],
                                       "save_s": first["checkpoints"]["seconds"]}
    assert losses == 0.0 and w == 0.0


# ----------------------------------------------------------------------------------------------
# 3. resume at another np with a fixed global batch
# ----------------------------------------------------------------------------------------------
def test_resume_at_another_np_keeps_the_data_order_and_step_count(sim_whole, tmp_path):
    ref, _, ref_used = sim_whole
    part = str(tmp_path / "part")
    with recorded_batches() as used:
        first, _ = engine.fit(replace(SIM, out=part, max_steps=11, checkpoint_every_steps=11),
                                engine.VirtualRanks(8))
        second, _ = engine.fit(replace(SIM, out=part, resume=os.path.join(part, "checkpoint.pt")),
                                 engine.VirtualRanks(4))
    assert second["np"] == 4 and second["resumed_from_np"] == 8 and second["per_rank_batch"] == 8
    assert second["global_batch"] == ref["global_batch"] == 32
    assert second["steps_done"] == ref["steps_done"] == ref["total_steps"] == 16
    assert second["steps"]["lr"] == ref["steps"]["lr"][11:]  # the same schedule
    # the same images in every global step, the interrupted epoch's rest included
    assert {k: sorted(v) for k, v in used.items()} == {k: sorted(v) for k, v in ref_used.items()}
    for epoch in (0, 1):  # and every image at most once per epoch
        seen = [i for (e, _), v in used.items() if e == epoch for i in v]
        assert len(seen) == len(set(seen)) == 8 * 32  # 8 steps of 32: all 256 images
    RECORD["resume_other_np_sim"] = {"from_np": 8, "to_np": 4, "steps": second["steps_done"],
                                     "same_images_per_step": True}


# ----------------------------------------------------------------------------------------------
# 2. an abort keeps what was done
# ----------------------------------------------------------------------------------------------
@pytest.mark.mpi
def test_a_rank_raising_under_mpiexec_keeps_the_result(tmp_path):
    # plain mpiexec -n 2, the CLI on every rank; rank 1's loader raises at its 6th batch (step 6 of 8)
    out = tmp_path / "run"
    t = time.monotonic()
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(REPO / "tests" / "failure_worker.py"),
                        "raise_in_train", str(out), *TINY, "--epochs", "2", "--checkpoint-every-steps", "2",
                        "--hang-s", "60"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=mpi_env())
    seconds = round(time.monotonic() - t, 1)
    assert p.returncode != 0 and "injected failure on rank 1" in p.stderr, p.stderr[-3000:]
    r = result(out)
    host = r["env"]["hostnames"][1]
    assert r["stopped_early"] is True and r["aborted"] is True
    assert r["stop_reason"].startswith(f"rank 1 ({host}) failed: RuntimeError: injected failure"), r["stop_reason"]
    assert r["steps_done"] == 5 and r["epochs_done"] == 0  # rank 0 finished step 5, then waited
    assert r["last_checkpoint"] == str(out / "checkpoint.pt")
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 4
    RECORD["abort_rank_raising"] = {"exit": p.returncode, "seconds": seconds, "stop_reason": r["stop_reason"],
                                    "steps_done": r["steps_done"], "last_checkpoint_step": 4}


def test_the_bench_reports_the_cost_of_one_checkpoint():
    from pilab.bench import local
    from pilab.bench.report import markdown_report
    c = local.checkpoint_cost(Config(width=0.25, train_subset=256, test_subset=100, batch_size=16, threads=1),
                              saves=2)
    assert c["bytes"] > 1e6 and c["save_s"]["n"] == 2 and c["share_of_interval"] > 0
    text = markdown_report({"quick": True, "command": "x", "machine": {
        "cpu": "c", "cpu_count": 2, "usable_cores": 2, "platform": "p", "python": "3", "torch": torch.__version__,
        "date": "d", "loadavg_start": [0, 0, 0]}, "checkpoint": c})
    assert "## One mid-epoch checkpoint" in text and "MiB" in text
    RECORD["bench_checkpoint_tiny"] = {"save_s": c["raw"], "bytes": c["bytes"],
                                       "share_of_10_min": c["share_of_interval"]}


@pytest.mark.mpi
def test_resume_at_another_np_with_sync_bn_matches_to_float_tolerance(tmp_path):
    # np 2 under mpiexec, stopped mid-epoch at step 6 (--max-steps), resumed at np 1: with BatchNorm over
    # the whole global batch (bn=sync), no augmentation and a model without dropout (augmentation draws
    # and dropout masks are per rank, so they regroup), the rest of the run matches the uninterrupted
    # np 2 run up to the order of float sums.
    run = ["train", "--model", "spiking_cnn", "--timesteps", "1", *TINY, "--bn", "sync", "--batch-mode", "global",
           "--no-augment", "--epochs", "1"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    p = pilab(*run, "--np", "2", "--out", str(whole), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    # --checkpoint-minutes as short as it gets: rank 0's clock asks for a save after every step, and its
    # vote (riding with the step's last bucket) makes rank 1 save after the same one
    p = pilab(*run, "--np", "2", "--max-steps", "6", "--checkpoint-minutes", "0.000001", "--out", str(part),
              cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (part / "checkpoint-e0000-s00006.pt").exists()
    assert result(part)["checkpoints"]["count"] == 6
    p = pilab(*run, "--out", str(part), "--resume", str(part / "checkpoint.pt"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    ref, second = result(whole), result(part)
    assert second["np"] == 1 and second["resumed_from_np"] == 2 and second["global_batch"] == ref["global_batch"]
    assert second["steps_done"] == ref["steps_done"] and second["steps"]["lr"] == ref["steps"]["lr"][6:]
    a, b = ref["steps"]["loss"][6:], second["steps"]["loss"]
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    RECORD["resume_np2_to_np1_sync_bn"] = {"steps_compared": len(a), "max_rel_loss_diff": rel,
                                           "max_abs_loss_diff": loss_diff(a, b)}
    assert rel <= 1e-4, RECORD["resume_np2_to_np1_sync_bn"]


def test_a_network_straggler_is_a_slow_link_not_a_small_batch():
    # The monitor rank 0 feeds (pilab.trace.stragglers): 4 ranks on 2 nodes whose exchange is half of a
    # 0.1 s step -- what 4 images per rank on a healthy gigabit link look like, and what a 100 Mbit/s link
    # does to 32. Only the payload's rate tells them apart: 4 MB in 0.05 s is 80 MB/s, 0.5 MB is 10 MB/s.
    from pilab.trace.stragglers import MIN_RATE, Monitor
    hosts = ["node01", "node01", "node02", "node02"]

    def run(nbytes, compute=(0.1, 0.1, 0.1, 0.1), steps=12):
        mon = Monitor(hosts, steps=4, window=8, every_s=60.0, clock=lambda: 0.0)
        lines = [x for step in range(1, steps + 1) for x in mon.add(step, compute, [0.05] * 4, nbytes)]
        return lines, mon.summary()

    lines, found = run(4_000_000)  # a healthy link: a large share, but at 80 MB/s
    assert lines == [] and found == [] and 4_000_000 / 0.05 > MIN_RATE
    lines, found = run(500_000)  # a slow link: 10 MB/s
    assert len(lines) == 1 and lines[0].startswith("pilab: straggler (network): ranks 0, 1 (node01); ranks 2, 3 (node02)")
    assert "moving its payload at 10.0, 10.0, 10.0, 10.0 MB/s" in lines[0] and "ethtool" in lines[0]
    assert [(f["rank"], f["kind"], f["mb_per_s"]) for f in found] == [(r, "network", 10.0) for r in range(4)]
    # judged from the 4th step (the first window of 4), flagged after 4 steps beyond it in a row: 7, ..., 12
    assert found[0]["first_step"] == 7 and found[0]["steps"] == 6
    lines, found = run(None)  # payload unknown: the share alone decides, as before
    assert len(lines) == 1 and "MB/s" not in lines[0] and {f["kind"] for f in found} == {"network"}
    # a slow node is a compute straggler whatever its exchange: node02's rank 3 computes 50% longer
    lines, found = run(4_000_000, compute=(0.1, 0.1, 0.1, 0.15))
    assert len(lines) == 1 and lines[0].startswith("pilab: straggler (compute): rank 3 (node02) computes 50% slower")
    # and while it is one, the others' exchange (stalled on the slow node's core) names no network straggler
    lines, found = run(500_000, compute=(0.1, 0.1, 0.1, 0.15))
    assert [(f["rank"], f["kind"]) for f in found] == [(3, "compute")], found
