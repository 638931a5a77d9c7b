"""compile_bn (pilab/engine/compilebn.py): the fast simulator's per-rank BatchNorm compiled where it pays.
Its arithmetic against the exact mode is tests/test_performance.py::test_fast_mode_stays_close_to_exact_at_np48
(both settings); here: when it is on, and what a machine without a C++ compiler gets (a real missing
compiler: CXX pointing nowhere, with an empty inductor cache so nothing compiled before is reused)."""
import os
import subprocess
import sys
from dataclasses import replace

from conftest import REPO

from pilab import resultfile
from pilab.config import Config
from pilab import engine

TINY = Config(width=0.25, train_subset=64, test_subset=20, batch_size=4, epochs=1, threads=1, seed=1,
              data="embedded", simulate_mode="fast")


def test_auto_compiles_only_long_cpu_runs_and_says_why_not():
    import torch

    from pilab.engine import compilebn
    r, _ = engine.fit(TINY, engine.VirtualRanks(4))  # 4 steps
    assert r["compile_bn_used"] == "4 steps < 200: compiling would not pay"
    assert r["simulate_mode_used"] == "fast"
    off, _ = engine.fit(replace(TINY, compile_bn="off"), engine.VirtualRanks(4))
    assert off["compile_bn_used"] == "compile_bn=off" and off["steps"]["loss"] == r["steps"]["loss"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert compilebn.why_not(Config(), cpu, 320) == ""  # a study's np=48 point: compiled
    assert compilebn.why_not(Config(), gpu, 320) != "" and compilebn.why_not(Config(compile_bn="on"), gpu, 12) == ""
    exact, _ = engine.fit(replace(TINY, simulate_mode="exact"), engine.VirtualRanks(4))
    assert "compile_bn_used" not in exact  # the exact mode has no vectorised BatchNorm to compile
    # the probe (run after the run is seeded) leaves the run's random stream where it was
    torch.manual_seed(7)
    assert compilebn.probe() == ""
    after = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(4))


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
    r = resultfile.load(str(out / "result.json"))
    assert r["compile_bn_used"].startswith("torch.compile failed") and r["config"]["compile_bn"] == "on"
    # ... and the eager run it went on with is the run compile_bn=off gives
    ref, _ = engine.fit(replace(TINY, compile_bn="off", seed=0), engine.VirtualRanks(4))
    assert r["steps"]["loss"] == ref["steps"]["loss"]


def test_compiled_layer_is_the_eager_mathematics_to_float_rounding():
    """The compiled form against per-group native BatchNorm in float64 (forward, the statistics that update
    the running ones, and every gradient), beside the eager form: both at float32 rounding. A trained
    run's accuracy still moves with it (4-image BatchNorm amplifies rounding: docs/simulator.md)."""
    import torch
    import torch.nn.functional as F

    from pilab.engine.layers import GroupedBN, compiled_grouped_bn
    g = torch.Generator().manual_seed(0)
    groups, c = 12, 16  # 12 virtual ranks of 4 images, 16 x 16 pixels: one kernel shape
    x = (torch.randn(48, c, 16, 16, generator=g) * 3 + 1).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g)
    dy = torch.randn(x.shape, generator=g).contiguous(memory_format=torch.channels_last)

    def run(f, dtype):
        xx, ww, bb = (t.to(dtype).clone().requires_grad_() for t in (x, w, b))  # own leaves
        y, mean, var = f(xx, ww, bb)
        y.backward(dy.to(dtype))
        return [t.detach().double() for t in (y, mean, var, xx.grad, ww.grad, bb.grad)]

    def native(xx, ww, bb):  # one BatchNorm call per virtual rank, as its MPI rank makes it
        parts = xx.unflatten(0, (groups, -1)).unbind(0)
        y = torch.cat([F.batch_norm(p, None, None, ww, bb, True, 0.0, 1e-5) for p in parts])
        var, mean = torch.var_mean(xx.unflatten(0, (groups, -1)), dim=(1, 3, 4), correction=0)
        return y, mean, var

    ref = run(native, torch.float64)
    forms = {"eager": lambda *a: GroupedBN.apply(*a, groups, 1e-5),
             "compiled": lambda *a: compiled_grouped_bn()(*a, groups, 1e-5)}
    for name, f in forms.items():
        got = run(f, torch.float32)
        for what, a, r in zip(("y", "mean", "var", "dx", "dweight", "dbias"), got, ref):
            rel = float((a - r).abs().max() / r.abs().max())
            assert rel < 2e-5, (name, what, rel)
