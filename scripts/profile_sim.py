"""Where the simulator's step time goes, against its physical bound: one process training the same global
batch (issue 42). Times the median step after warm-up of one process on the global batch
(``MPIRanks(None)``, batch np*b) and of ``VirtualRanks(np)`` in each simulate_mode, alternated; with
``--profile`` also prints torch.profiler's top operators of each::

    python scripts/profile_sim.py --b 4,32 --np 48 --width 0.25 --threads 2 --rounds 5
    python scripts/profile_sim.py --b 4 --np 48 --profile --modes exact
    python scripts/profile_sim.py --b 4 --np 48 --compare-run 2    # a small np=48 run in both modes: loss, accuracy
    python scripts/profile_sim.py --b 64 --np 48 --memory --modes fast   # peak RSS against the global batch's
    python scripts/profile_sim.py --b 32 --np 48 --memory --modes fast:off,fast:on   # ... BatchNorm eager, compiled
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

from pilab.bench.local import stepper
from pilab.bench.stats import alternate, ratios, summary
from pilab.config import Config
from pilab import engine


def sessions(cfg: Config, np_: int, modes: list[str]) -> dict:
    """One session per contender: "global" (one process, batch np*b) and one per simulate_mode."""
    out = {"global": engine.Session(replace(cfg, batch_size=np_ * cfg.batch_size), engine.MPIRanks(None))}
    for m in modes:
        out[m] = engine.Session(mode_config(cfg, m), engine.VirtualRanks(np_))
    return out


def mode_config(cfg: Config, mode: str) -> Config:
    """``cfg`` in ``mode``: a simulate_mode, or ``MODE:COMPILE`` with a compile_bn (``fast:on``)."""
    m, _, compile_bn = mode.partition(":")
    return replace(cfg, simulate_mode=m, compile_bn=compile_bn or cfg.compile_bn)


def profile(name: str, f, steps: int = 2, top: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile as prof
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            f()
    print(f"--- {name}: top operators over {steps} steps (self CPU time)")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40))


def compare_run(a, epochs: int) -> dict:
    """The same small simulated run (``epochs`` over 40 steps' images) in the exact and the fast mode:
    per-step losses, their largest difference, and the final test accuracy of each."""
    b = int(a.b.split(",")[0])
    cfg = Config(model=a.model, width=a.width, batch_size=b, threads=a.threads, epochs=epochs,
                 train_subset=10 * a.np * b, test_subset=1000, lr=a.lr, lr_ref_batch=64, warmup_epochs=0.5)
    runs = {m: engine.simulate(replace(cfg, simulate_mode=m), a.np) for m in ("exact", "fast")}
    loss = {m: r["steps"]["loss"] for m, r in runs.items()}
    diff = [abs(x - y) for x, y in zip(loss["exact"], loss["fast"])]
    out = {"np": a.np, "per_rank_batch": b, "steps": len(diff), "max_step_loss_diff": max(diff),
           "first_step_loss_diff": diff[0], "loss": loss,
           "mean_loss_last10": {m: sum(v[-10:]) / len(v[-10:]) for m, v in loss.items()},
           "test_acc": {m: [e["test_acc"] for e in r["epochs"]] for m, r in runs.items()},
           "used": {m: r["simulate_mode_used"] for m, r in runs.items()}}
    print(json.dumps({k: v for k, v in out.items() if k != "loss"}))
    return out


_PEAK = """
import sys, json
from dataclasses import replace
from pilab.config import Config
from pilab import engine
from pilab.engine.backend import peak_mem_mb
mode, np_, b, model, width, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5]), int(sys.argv[6])
sys.path.insert(0, sys.argv[7])
from profile_sim import mode_config  # MODE:COMPILE read in one place
cfg = Config(model=model, width=width, batch_size=b, threads=threads, epochs=10, test_subset=10)
if mode == "global":
    s = engine.Session(replace(cfg, batch_size=np_ * b), engine.MPIRanks(None))
else:
    s = engine.Session(mode_config(cfg, mode), engine.VirtualRanks(np_))
for k in range(2):
    s.step(0, k % s.steps_per_epoch)
# the fast mode takes fewer ranks per forward by itself where the global batch would not fit: say so
print(json.dumps({"mode": mode, "peak_mem_mb": peak_mem_mb(), "ranks_per_chunk": getattr(s.ranks, "chunk", None),
                  "why": getattr(s.ranks, "chunk_why", None)}))
"""


def peaks(a, modes) -> dict:
    """Peak RSS (MiB) of two steps in a fresh process: one process on the global batch, and each mode."""
    import subprocess
    b = int(a.b.split(",")[0])
    out = {}
    for m in ["global", *modes]:
        p = subprocess.run([sys.executable, "-c", _PEAK, m, str(a.np), str(b), a.model, str(a.width), str(a.threads),
                            os.path.dirname(os.path.abspath(__file__))], capture_output=True, text=True, check=True)
        got = json.loads(p.stdout.strip().splitlines()[-1])
        out[m] = got["peak_mem_mb"]
        if got["ranks_per_chunk"] is not None:
            out[f"{m} ranks per forward"] = f'{got["ranks_per_chunk"]} ({got["why"]})'
    out.update({f"{m}/global": out[m] / out["global"] for m in modes})
    print(json.dumps({f"{b}x{a.np}": out}))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--b", default="4,32", help="per-rank batches, comma-separated")
    ap.add_argument("--np", type=int, default=48)
    ap.add_argument("--model", default="mobilenetv2_cifar")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="exact,fast",
                    help="simulate_modes to time against the global batch (MODE:COMPILE sets compile_bn: fast:on)")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top operators")
    ap.add_argument("--compare-run", type=int, default=0, metavar="EPOCHS",
                    help="instead: a small run at --np in both modes, EPOCHS epochs of 10 global batches each")
    ap.add_argument("--lr", type=float, default=0.05, help="--compare-run's lr per 64 images")
    ap.add_argument("--memory", action="store_true", help="instead: peak RSS of each mode against the global batch's")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",")
    if a.memory:
        return peaks(a, modes)
    if a.compare_run:
        return compare_run(a, a.compare_run)
    res = {}
    for b in (int(v) for v in a.b.split(",")):
        cfg = Config(model=a.model, width=a.width, batch_size=b, threads=a.threads, epochs=100,
                     train_subset=max(a.np * b, 2 * a.np * b if a.np * b <= 2500 else 0), test_subset=10)
        ss = sessions(cfg, a.np, modes)
        fns = {n: stepper(s) for n, s in ss.items()}
        t = alternate(fns, a.rounds, warmup=2)
        res[f"{b}x{a.np}"] = row = {n: summary(v)["median"] for n, v in t.items()}
        for m in modes:
            row[f"{m}/global"] = summary(ratios(t, m, "global"))
        print(json.dumps({f"{b}x{a.np}": {k: (v if not isinstance(v, dict) else
                                              {q: round(v[q], 3) for q in ("median", "min", "max")})
                                          for k, v in row.items()}}), flush=True)
        if a.profile:
            for n, f in fns.items():
                profile(f"{n} b={b} np={a.np}", f)
        del ss, fns
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
