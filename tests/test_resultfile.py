"""A run's result on disk (pilab/resultfile.py): result.json and its per-step series in result.steps.npz,
read back by the one reader; the committed results in that form and within their size; the old form
refused with its fix; a data set compared by what it is, not the path it was read from."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO

import pilab
from pilab import resultfile
from pilab.config import Config
from pilab.files import save_json

EXPERIMENTS = REPO / "experiments"
CONVERT = REPO / "scripts" / "convert_results.py"


@pytest.fixture(scope="module")
def real_run(cifar_archive, tmp_path_factory):
    """A short real run on a slice of the real archive (the simulator at np=2), written to its --out."""
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = Config(data=str(cifar_archive), width=0.25, train_subset=256, test_subset=100, batch_size=16,
                 epochs=2, threads=1, simulate_mode="exact", out=str(out))
    return pilab.simulate(cfg, 2), out / "result.json"


def test_the_reader_gives_back_the_run_the_engine_returned(real_run):
    result, path = real_run
    assert sorted(os.listdir(path.parent)) == ["result.json", "result.steps.npz"]
    raw = json.loads(path.read_text())
    assert set(raw["steps"]) == {"file", "sha256", "count", "series"} and raw["steps"]["count"] == 16
    back = resultfile.load(str(path))
    assert {k: v for k, v in back.items() if k != "steps"} == json.loads(json.dumps(
        {k: v for k, v in result.items() if k != "steps"}))
    steps, mine = back["steps"], result["steps"]
    assert list(steps) == list(mine)
    assert steps["loss"] == mine["loss"] and steps["lr"] == mine["lr"]  # bit for bit
    for k in resultfile.SECONDS:
        if k in mine:
            worst = max(abs(a - b) for a, b in zip(steps[k], mine[k]))
            assert worst <= (2e-6 if k == "time" else 0.5e-6), (k, worst)  # kept to the microsecond
    # each epoch's mean training loss is the mean of its steps' losses (what the series is, read back)
    spe = back["steps_per_epoch"]
    for e, rec in enumerate(back["epochs"]):
        assert np.isclose(np.mean(steps["loss"][e * spe:(e + 1) * spe]), rec["train_loss"], rtol=1e-9)
    # what is read, written again, is the same file: the form loses nothing more a second time
    again = path.parent.parent / "again" / "result.json"
    resultfile.save(back, str(again))
    assert Path(resultfile.sidecar(str(again))).read_bytes() == Path(resultfile.sidecar(str(path))).read_bytes()
    assert resultfile.load(str(again)) == back  # and reads back as the same dict, every value exactly


def test_a_pair_split_apart_is_refused(real_run, tmp_path):
    _, path = real_run
    d = tmp_path / "copy"
    d.mkdir()
    shutil.copy(path, d / "result.json")  # result.json alone
    with pytest.raises(resultfile.ResultFileError, match="result.steps.npz is missing"):
        resultfile.load(str(d / "result.json"))
    other = {"np": 1, "steps": {"loss": [1.0, 2.0]}}
    resultfile.save(other, str(tmp_path / "other" / "result.json"))
    shutil.copy(tmp_path / "other" / "result.steps.npz", d / "result.steps.npz")  # another run's series
    with pytest.raises(resultfile.ResultFileError, match="SHA-256 differs"):
        resultfile.load(str(d / "result.json"))


def test_the_old_form_is_refused_with_its_fix_and_the_converter_keeps_every_number(real_run, tmp_path):
    result, _ = real_run
    out = tmp_path / "old"
    save_json(result, str(out / "result.json"))  # every series inside result.json: the form before
    with pytest.raises(resultfile.OldFormError) as e:
        resultfile.load(str(out / "result.json"))
    msg = str(e.value)
    assert "\n" not in msg and f"python scripts/convert_results.py {out / 'result.json'}" in msg
    # a command given that --out says the same, in one line, exit 2, and writes nothing
    before = sorted(os.listdir(out))
    p = subprocess.run([sys.executable, "-m", "pilab", "simulate", "--np", "2", "--data", "embedded",
                        "--epochs", "1", "--train-subset", "64", "--test-subset", "20", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 2 and "convert_results.py" in p.stderr and len(p.stderr.strip().splitlines()) == 1, \
        p.stderr[-2000:]
    assert sorted(os.listdir(out)) == before
    # converted once: the same numbers, read by the one reader
    p = subprocess.run([sys.executable, str(CONVERT), str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "converted 1 result.json" in p.stdout, p.stderr[-2000:]
    back = resultfile.load(str(out / "result.json"))
    assert back["steps"]["loss"] == result["steps"]["loss"] and back["steps"]["lr"] == result["steps"]["lr"]
    assert back["epochs"] == json.loads(json.dumps(result["epochs"]))


def _result_files() -> list[Path]:
    return [p for p in EXPERIMENTS.rglob("*") if p.is_file() and p.name.endswith((".json", ".jsonl", ".npz"))]


def test_the_committed_results_are_in_the_new_form_and_small():
    points = sorted(EXPERIMENTS.rglob("result.json"))
    assert len(points) > 100
    for p in points:
        resultfile.load(str(p))  # none in the old form, none split from its series
    # what a clone carries: each content once (a point copied into a second table is one blob in git)
    assert sum(len(b) for b in {p.read_bytes() for p in _result_files()}) <= 6_000_000
    # a 10-epoch np=1 point (15,620 steps): its two files within 150 KB, its series whole
    for d in ("paper-batch/cpu/linear-warmup-8/np1-seed0", "paper-size/sqrt-warmup/np1"):
        files = [Path(f) for f in resultfile.files(str(EXPERIMENTS / d / "result.json"))]
        assert sum(f.stat().st_size for f in files) <= 150_000, d
        r = resultfile.load(str(files[0]))
        assert r["np"] == 1 and len(r["epochs"]) == 10
        assert all(len(v) == r["total_steps"] == 15620 for v in r["steps"].values())


def test_one_archive_named_by_two_paths_is_one_data_set():
    """compare (and `compare --paper`) names a data set by what its runs recorded (sizes and digest), so
    the committed 50k studies, read from ../shared/... and from an absolute path, differ in no data."""
    from pilab.study import compare, scaling
    a = scaling.load_study(str(EXPERIMENTS / "paper-size" / "naive"))
    b = scaling.load_study(str(EXPERIMENTS / "paper-batch" / "cpu" / "linear-warmup-5-few-step-zero-init-residual"))
    small = scaling.load_study(str(EXPERIMENTS / "fast-but-wrong" / "naive"))
    absolute = os.path.abspath(str(REPO.parent / "shared" / "data" / "cifar10-jpeg.tar.gz"))
    b = {**b, "config": {**b["config"], "data": absolute}}
    assert a["config"]["data"] != b["config"]["data"]
    assert compare.data_set(a) == compare.data_set(b) == "50000 train / 10000 test, sha256 7da6a56bd03f"
    cmp = compare.compare({"50k naive": a, "50k few-step": b})
    assert "data" not in cmp["varies"] and cmp["configs"]["50k few-step"]["data"] == absolute
    cmp = compare.compare({"50k naive": a, "15k naive": small})
    assert set(cmp["varies"]["data"]) == {"data", "train_subset", "test_subset"}  # another data set: said so
    committed = json.loads((EXPERIMENTS / "paper-size" / "compare.json").read_text())
    assert set(committed["varies"]["data"]["data"].values()) == {
        "50000 train / 10000 test, sha256 7da6a56bd03f", compare.data_set(small)}


def test_a_new_step_series_is_kept_exactly_unless_it_is_seconds(tmp_path):
    from pilab.engine import records
    assert set(records.STEP_KEYS) <= {"loss", "lr", *resultfile.SECONDS}
    r = {"steps": {"loss": [0.1, float("nan")], "new": [1 / 3, 2 / 3], "time": [0.25, 0.5],
                  "compute": [0.2, 0.4], "comm_exposed": [0.0, 0.0], "data": [0.05, 0.1]}}
    resultfile.save(r, str(tmp_path / "r.json"))
    assert (tmp_path / "r.steps.npz").exists()
    back = resultfile.load(str(tmp_path / "r.json"))["steps"]
    assert back["new"] == [1 / 3, 2 / 3] and back["loss"][0] == 0.1 and np.isnan(back["loss"][1])
    assert back["time"] == [0.25, 0.5]


def test_a_runs_series_file_is_one_of_its_files(tmp_path):
    """--overwrite and a re-run clear a run's files (pilab.engine.records.RUN_FILES): its series go with it."""
    from pilab.cli import common
    from pilab.engine import records
    cfg = Config(data="embedded", width=0.25, train_subset=64, test_subset=20, batch_size=8, epochs=1,
                 threads=1, out=str(tmp_path / "run"))
    pilab.simulate(cfg, 2)
    assert sorted(os.listdir(cfg.out)) == ["result.json", "result.steps.npz"]
    assert set(resultfile.files("result.json")) <= set(records.RUN_FILES)
    common.clear_out_dir(cfg.out)
    assert os.listdir(cfg.out) == []
