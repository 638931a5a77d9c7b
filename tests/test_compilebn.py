"""compile_bn (pilab/engine/compilebn.py): the fast simulator's per-rank BatchNorm compiled where it pays.
Its arithmetic against the exact mode is tests/test_performance.py::test_fast_mode_stays_close_to_exact_at_np48
(both settings); here: when it is on, and what a machine without a C++ compiler gets (a real missing
compiler: CXX pointing nowhere, with an empty inductor cache so nothing compiled before is reused)."""
import json
import os
import subprocess
import sys
from dataclasses import replace

from conftest import REPO

from pilab.config import Config

TINY = Config(width=0.25, train_subset=64, test_subset=20, batch_size=4, epochs=1, threads=1, seed=1,
              data="embedded", simulate_mode="fast")


def test_auto_compiles_only_long_cpu_runs_and_says_why_not():
    import torch

    from pilab.engine import compilebn, simulate
    r, _ = simulate.train(TINY, 4)  # 4 steps
    assert r["compile_bn_used"] == "4 steps < 200: compiling would not pay"
    assert r["simulate_mode_used"] == "fast"
    off, _ = simulate.train(replace(TINY, compile_bn="off"), 4)
    assert off["compile_bn_used"] == "compile_bn=off" and off["steps"]["loss"] == r["steps"]["loss"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert compilebn.why_not(Config(), cpu, 320) == ""  # a study's np=48 point: compiled
    assert compilebn.why_not(Config(), gpu, 320) != "" and compilebn.why_not(Config(compile_bn="on"), gpu, 12) == ""
    exact, _ = simulate.train(replace(TINY, simulate_mode="exact"), 4)
    assert "compile_bn_used" not in exact  # the exact mode has no vectorised BatchNorm to compile


def test_no_compiler_runs_eager_and_says_so_in_one_line(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "pilab", "simulate", "--np", "4", "--data", "embedded",
                        "--width", "0.25", "--batch-size", "4", "--train-subset", "64", "--test-subset", "20",
                        "--epochs", "1", "--threads", "1", "--simulate-mode", "fast", "--compile-bn", "on",
                        "--out", str(out)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    said = [x for x in p.stderr.splitlines() if x.startswith("pilab: torch.compile failed")]
    assert len(said) == 1 and "no-such-c++" in said[0] and "compile_bn=off" in said[0], p.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["compile_bn_used"].startswith("torch.compile failed") and r["config"]["compile_bn"] == "on"
    # ... and the eager run it went on with is the run compile_bn=off gives
    from pilab.engine import simulate
    ref, _ = simulate.train(replace(TINY, compile_bn="off", seed=0), 4)
    assert r["steps"]["loss"] == ref["steps"]["loss"]
