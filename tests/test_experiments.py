"""Experiment drivers kept beside their results (experiments/<name>/): their code paths run, tiny, on a CPU."""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _driver(experiment: str, script: str):
    """An experiment's script as a module (registered, so its worker functions pickle by name)."""
    name = f"{experiment.replace('-', '_')}_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / experiment / script)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_paper_batch_screen_runs_a_candidate_and_tables_it(tmp_path):
    rows = _driver("paper-batch", "screen.py").main(["--device", "cpu", "--data", "embedded", "--epochs", "1", "--train-subset", "96",
                           "--test-subset", "40", "--nps", "3", "--candidates", "naive", "--reference-seeds", "",
                           "--np1-seeds", "0", "--top", "0", "--workers", "1", "--threads", "1", "--out", str(tmp_path)])
    assert sorted((r["candidate"], r["np"], r["error"]) for r in rows) == [("naive", 1, None), ("naive", 3, None)]
    big = next(r for r in rows if r["np"] == 3)
    assert big["global_batch"] == 96 and 0 <= big["final_test_acc"] <= 1
    saved = [json.loads(line) for line in open(tmp_path / "results.jsonl")]
    assert saved[0]["config"]["simulate_mode"] == "fast" and saved[0]["config"]["lr"] == 0.025
    text = (tmp_path / "table.md").read_text()
    assert "| naive | 3 | 0 |" in text and "| naive | 1 | 0 |" in text
    # the summary: both np with their seed counts, the gap in points, the Pi's predicted speedup over one node
    acc = {r["np"]: r["final_test_acc"] for r in rows}
    row = next(line for line in text.splitlines() if line.startswith("| naive | ") and "×" in line)
    assert f"| {acc[1]:.4f} (1) | {acc[3]:.4f} (1) | {(acc[3] - acc[1]) * 100:+.1f} points |" in row, row
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_the_paper_batch_driver_resumes_a_killed_point_and_skips_a_finished_one(tmp_path):
    """A real SIGKILL to the driver's process group mid-point: the rerun leaves the finished point as it
    was and takes the cut one on from its checkpoint, to its last step."""
    out = tmp_path / "out"
    args = ["--device", "cpu", "--data", "embedded", "--epochs", "2", "--train-subset", "192", "--test-subset", "40",
            "--nps", "3", "--candidates", "naive", "--reference-seeds", "0", "--top", "0", "--workers", "1",
            "--threads", "1", "--simulate-mode", "exact", "--checkpoint-every-steps", "1", "--out", str(out)]
    finished, cut = out / "naive" / "np3-seed0", out / "naive" / "np1-seed0"  # run in that order (1 worker)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "experiments" / "paper-batch" / "screen.py"), *args],
                            env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600  # a guard against a hang, not a timing claim
        while not (cut / "checkpoint.pt").exists():  # np=1's first step (of 12) checkpointed
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert (finished / "result.json").exists() and not (cut / "result.json").exists()
    # the finished point as a run made before a setting existed (compile_bn): still this protocol's run
    old = json.loads((finished / "result.json").read_text())
    del old["config"]["compile_bn"]
    (finished / "result.json").write_text(json.dumps(old))
    before = (finished / "result.json").stat().st_mtime_ns, (finished / "result.json").read_bytes()
    listing = sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*"))
    # another protocol in the same --out: refused by the finished point, then by the cut one's checkpoint
    for other in (["--epochs", "3"], ["--candidates", "sqrt + warmup 2", "--nps", "4", "--test-subset", "20"]):
        with pytest.raises(SystemExit) as refused:
            _driver("paper-batch", "screen.py").main(args + other)
        assert refused.value.code == 2
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.rglob("*")) == listing  # nothing written
    with open(out / ".lock") as held:  # a live driver's lock on OUT: a second one is refused
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(SystemExit) as refused:
            _driver("paper-batch", "screen.py").main(args)
        assert refused.value.code == 2 and not (cut / "result.json").exists()

    rows = {r["np"]: r for r in _driver("paper-batch", "screen.py").main(args)}
    assert rows[3]["skipped"] and rows[3]["error"] is None and rows[1]["error"] is None
    assert before == ((finished / "result.json").stat().st_mtime_ns, (finished / "result.json").read_bytes())
    r = json.loads((cut / "result.json").read_text())
    assert not rows[1]["skipped"] and r["resumed_from_step"] >= 1 and r["steps_done"] == r["total_steps"] == 12
    assert r["config"]["resume"] == str(cut / "checkpoint.pt") and len(r["epochs"]) == 2
    table = (out / "table.md").read_text()
    assert "| naive | 3 | 0 |" in table and "| naive | 1 | 0 |" in table


def _remade_table(folder: str, tmp_path) -> str:
    """experiments/paper-batch/FOLDER's table as `screen.py --table` makes it from a copy of its points,
    checked equal to the committed table.md."""
    import shutil
    committed = ROOT / "experiments" / "paper-batch" / folder
    shutil.copytree(committed, tmp_path / folder, ignore=shutil.ignore_patterns("curves.png", "table.md"))
    text = _driver("paper-batch", "screen.py").table(str(tmp_path / folder))
    assert text == (committed / "table.md").read_text(), \
        f"re-run: python experiments/paper-batch/screen.py --table experiments/paper-batch/{folder}"
    return text


def test_the_committed_paper_batch_table_is_what_its_points_make(tmp_path):
    """experiments/paper-batch/cpu/table.md is what `screen.py --table` makes of the committed points, and its
    images-to-accuracy section reads the curves right: the committed np=1 passes 0.60 between its epochs 2
    (0.576) and 3 (0.634), at 2.4 epochs of images."""
    screen = _driver("paper-batch", "screen.py")
    assert screen.epochs_to([0.47, 0.58, 0.63], 0.60) == pytest.approx(2.4)
    assert screen.epochs_to([0.47, 0.58], 0.40) == 1.0 and screen.epochs_to([0.47, 0.58], 0.60) is None
    text = _remade_table("cpu", tmp_path)
    assert "| np=1, committed recipe (seed 0) | 1.3 | 2.4 | 3.4 | 4.8 | 6.7 |" in text
    # the fitting section: warmup 8's last-epoch training accuracy, 0.748/0.744/0.746 at np=1 and
    # 0.654/0.602/0.653 at np=48 (cpu/results.jsonl), 11.0 points apart
    assert "| linear + warmup 8 | 0.746 | 0.636 | -11.0 | 0.784 | 0.678 | -10.6 |" in text


@pytest.mark.parametrize("folder", ["screen-cpu-2ep", "screen-cpu-fast-2ep"])
def test_the_committed_few_step_screens_tables_are_what_their_points_make(folder, tmp_path):
    """The 2-epoch screens' table.md is what `screen.py --table` makes of their committed points (so those
    points stay readable through Config as settings change)."""
    _remade_table(folder, tmp_path)


def test_the_time_to_accuracy_driver_extends_a_run_from_its_stable_phase_and_tables_it(tmp_path):
    """Two lengths of one seed (4 and 5 epochs, 3 of decay): the trunk trains 1 then 2 stable epochs, each
    branch goes on from the trunk's checkpoint at its length minus the decay; np=1 beside it; a rerun trains
    nothing again; the table has steps and images beside each accuracy."""
    args = ["--data", "embedded", "--train-subset", "192", "--test-subset", "100", "--nps", "4", "--candidate",
            "muon 0.004 wsd 3", "--ladder", "4,5", "--seeds", "0", "--np1-seeds", "0", "--epochs-np1", "4",
            "--workers", "1", "--target", "0.99", "--out", str(tmp_path)]
    rows = _driver("paper-batch", "to_accuracy.py").main(args)
    assert sorted((r["np"], sorted(r["reached"]), r["error"]) for r in rows) == [(1, [4], None), (4, [4, 5], None)]
    home = tmp_path / "muon-0-004-wsd-3" / "np4-seed0"
    four, five = (json.loads((home / f"e00{e}" / "result.json").read_text()) for e in (4, 5))
    assert four["resumed_from_step"] == 1 * four["steps_per_epoch"] and five["resumed_from_step"] == 2 * five["steps_per_epoch"]
    assert five["config"]["epochs"] == 5 and five["config"]["schedule"] == "wsd" and len(five["epochs"]) == 5
    assert five["epochs"][:2] == json.loads((home / "trunk" / "result.json").read_text())["epochs"][:2]
    stamps = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*.json"))
    _driver("paper-batch", "to_accuracy.py").main(args)  # all finished: nothing trains again
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*.json")) == stamps
    text = (tmp_path / "table.md").read_text()
    steps = 5 * five["steps_per_epoch"]
    assert f"| 4 | 5 | {steps} | {steps * five['global_batch']:,} | 0: {five['epochs'][-1]['test_acc']:.4f} |" in text
    # the speedup against the np=1 run that sets the target (here the committed one), the recipe's own beside it
    assert "× one node's np=1 (the target's run) | × one node's np=1 (this recipe's) |" in text
    assert "The committed np=1 that sets the target (experiments/paper-size/naive/np1/result.json" in text
    assert (tmp_path / "to_accuracy.png").read_bytes()[:4] == b"\x89PNG"
    # the fixed-budget points (np=1 and the 4-epoch run here) into a screen table folder, beside its recipes
    dest = tmp_path / "table"
    dest.mkdir()
    written = _driver("paper-batch", "to_accuracy.py").export(str(tmp_path), str(dest), epochs=4)
    assert sorted(os.path.relpath(w, dest) for w in written) == ["muon-0-004-wsd-3/np1-seed0", "muon-0-004-wsd-3/np4-seed0"]
    assert not list(dest.rglob("*.pt"))
    text = _driver("paper-batch", "screen.py").table(str(dest))
    assert "| muon 0.004 wsd 3 | 4 | 0 |" in text and "| muon 0.004 wsd 3 | 1 | 0 |" in text
