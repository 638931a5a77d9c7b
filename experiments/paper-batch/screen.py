"""Screening for issue 41: fast and right at the paper's own setting (np=48, 32 images per rank, global batch
1,536, MobileNetV2-CIFAR 0.25, all 50,000 / 10,000 images, 10 epochs).

Every candidate is a training recipe (an lr rule with its base lr per 32 images, and the large-batch
toolbox's settings), run at np=1 and/or as an emulated np=48 (the virtual-rank simulator) on one device.
Stage 1 runs each recipe once (seed 0) at np=48, with np=1's committed recipe on seeds 0, 1, 2 beside
it; stage 2 takes the best ``--top`` recipes and runs them on seeds 1 and 2 at np=48 and on seeds 0, 1, 2 at
np=1 (the goal compares against np=1 under the same recipe). Jobs run ``--workers`` at a time, in forked
processes that share the decoded data.

Each (candidate, np, seed) point is a folder ``OUT/<candidate>/np<N>-seed<S>/`` holding the engine's own
result.json (with its whole Config) and its checkpoints (every epoch, and every ``--checkpoint-minutes``
inside one). Run the same command again after an interruption (a signal, a reboot): a finished point is
skipped, an interrupted one goes on from its ``checkpoint.pt``, the rest start. Each point that finishes in a
run is also one line of ``OUT/results.jsonl`` (``OUT/table.md`` is made from it)::

    python experiments/paper-batch/screen.py --device cuda --workers 8 --budget-s 480 \\
        --out experiments/paper-batch/screen-h200
    python experiments/paper-batch/screen.py --device cpu --data embedded --epochs 1 --train-subset 192 \\
        --test-subset 100 --nps 4 --candidates naive --workers 1 --out runs/screen   # the code path, tiny

This is a screen, not the table: on CUDA the simulator runs several ranks per forward in bf16
(``simulate_mode=fast``: the same mathematics as MPI ranks, another float summation order; see
docs/simulator.md), so its accuracies are what the exact CPU runs would reach to within seed noise, not bit
for bit. The table of the issue is the exact protocol on the chosen rows.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import fcntl
import json
import multiprocessing
import os
import re
import sys
import time
from pilab import engine

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

# The study's protocol (experiments/paper-size/run.sh): lr quoted per 32 images, SGD momentum 0.9, weight
# decay 5e-4 on conv/linear weights, cosine schedule, static shards, per-rank BatchNorm.
PROTOCOL = dict(model="mobilenetv2_cifar", width=0.25, epochs=10, batch_size=32, lr_ref_batch=32)
# issue 20's few-step recipe: label smoothing, a weight EMA, Nesterov, the triangular schedule, flip TTA
FEW_STEP = dict(label_smoothing=0.2, ema_epochs=0.5, nesterov=True, schedule="linear", tta=True)

# issue 54's Muon recipe (airbench94_muon's settings; muon_lr is set per candidate). BatchNorm's running statistics
# at airbench's momentum (0.4) and averaged over the ranks: screen 2's first epoch trained to 0.29 but tested at
# 0.100 (every image one class) with torch's 0.1 -- statistics lagging weights Muon moves fast; the same
# checkpoint with its statistics recomputed on 3,200 training images tested at 0.451
MUON = dict(optimizer="muon", muon_momentum=0.6, bn_momentum=0.4, bn_buffers="average", lr=0.025, lr_scaling="linear", momentum=0.85, nesterov=True,
            label_smoothing=0.2, schedule="linear", tta=True, tta_translate=True, freeze_bn_scale=True,
            bn_lr_scale=64.0, dirac_init=True)

# name -> (Config overrides; the lr is per 32 images and the rule scales it to the global batch)
CANDIDATES: dict[str, dict] = {
    "naive": dict(lr=0.025),
    "sqrt + warmup 2": dict(lr=0.025, lr_scaling="sqrt", warmup_epochs=2.0),
    "linear + warmup 2": dict(lr=0.025, lr_scaling="linear", warmup_epochs=2.0),
    "linear + warmup 5": dict(lr=0.025, lr_scaling="linear", warmup_epochs=5.0),
    "linear x0.5 + warmup 2": dict(lr=0.0125, lr_scaling="linear", warmup_epochs=2.0),
    "linear x2 + warmup 2": dict(lr=0.05, lr_scaling="linear", warmup_epochs=2.0),
    "linear + warmup 2 + few-step": dict(lr=0.025, lr_scaling="linear", warmup_epochs=2.0, **FEW_STEP),
    "linear x0.5 + warmup 2 + few-step": dict(lr=0.0125, lr_scaling="linear", warmup_epochs=2.0, **FEW_STEP),
    "linear x2 + warmup 2 + few-step": dict(lr=0.05, lr_scaling="linear", warmup_epochs=2.0, **FEW_STEP),
    "linear x4 + warmup 2 + few-step": dict(lr=0.1, lr_scaling="linear", warmup_epochs=2.0, **FEW_STEP),
    "linear + warmup 1 + few-step": dict(lr=0.025, lr_scaling="linear", warmup_epochs=1.0, **FEW_STEP),
    "linear + warmup 5 + few-step": dict(lr=0.025, lr_scaling="linear", warmup_epochs=5.0, **FEW_STEP),
    "linear x2 + warmup 5": dict(lr=0.05, lr_scaling="linear", warmup_epochs=5.0),
    "linear + warmup 8": dict(lr=0.025, lr_scaling="linear", warmup_epochs=8.0),
    "sqrt x2 + warmup 2 + few-step": dict(lr=0.05, lr_scaling="sqrt", warmup_epochs=2.0, **FEW_STEP),
    "sqrt x4 + warmup 2 + few-step": dict(lr=0.1, lr_scaling="sqrt", warmup_epochs=2.0, **FEW_STEP),
    "linear x2 + warmup 2 + few-step, wd 1e-3": dict(lr=0.05, lr_scaling="linear", warmup_epochs=2.0,
                                                     weight_decay=1e-3, **FEW_STEP),
    "linear x2 + warmup 2 + few-step, wd on all": dict(lr=0.05, lr_scaling="linear", warmup_epochs=2.0,
                                                       weight_decay_on="all", **FEW_STEP),
    "linear x2 + warmup 2 + few-step, SyncBatchNorm": dict(lr=0.05, lr_scaling="linear", warmup_epochs=2.0,
                                                          bn="sync", **FEW_STEP),
    "LARS linear + warmup 2": dict(optimizer="lars", lr=0.025, lr_scaling="linear", warmup_epochs=2.0),
    "LARS linear x4 + warmup 2": dict(optimizer="lars", lr=0.1, lr_scaling="linear", warmup_epochs=2.0),
    "LARS linear x4 + warmup 5": dict(optimizer="lars", lr=0.1, lr_scaling="linear", warmup_epochs=5.0),
    "LARS linear x4 + warmup 2 + few-step": dict(optimizer="lars", lr=0.1, lr_scaling="linear",
                                                 warmup_epochs=2.0, **FEW_STEP),
    "LARS linear x16 + warmup 2 + few-step": dict(optimizer="lars", lr=0.4, lr_scaling="linear",
                                                  warmup_epochs=2.0, **FEW_STEP),
    # the rest of the toolbox (added 2026-12-06, not screened yet): LAMB (Adam's lr scale: 1e-3 per
    # 32 images, sqrt rule -> 6.9e-3 at 1,536; decoupled-style decay 0.01 as in You et al.), and the best
    # recipe with each of zero-initialised residual BatchNorm scales, Lookahead, BatchNorm/bias at 4x the lr
    "LAMB sqrt + warmup 5": dict(optimizer="lamb", lr=1e-3, lr_scaling="sqrt", warmup_epochs=5.0,
                                 weight_decay=0.01),
    "LAMB sqrt x2 + warmup 5 + few-step": dict(optimizer="lamb", lr=2e-3, lr_scaling="sqrt", warmup_epochs=5.0,
                                               weight_decay=0.01, **{**FEW_STEP, "nesterov": False}),
    "linear + warmup 5 + few-step + zero-init residual": dict(lr=0.025, lr_scaling="linear", warmup_epochs=5.0,
                                                             zero_init_residual=True, **FEW_STEP),
    "linear + warmup 5 + few-step + lookahead 5": dict(lr=0.025, lr_scaling="linear", warmup_epochs=5.0,
                                                      lookahead_steps=5, **FEW_STEP),
    "linear + warmup 5 + few-step + BN lr x4": dict(lr=0.025, lr_scaling="linear", warmup_epochs=5.0,
                                                   bn_lr_scale=4.0, **FEW_STEP),
    # added 2026-12-07: the best recipe that keeps np=1, with the stem started as a whitening of the data
    "linear + warmup 5 + few-step + zero-init residual + whitened stem": dict(
        lr=0.025, lr_scaling="linear", warmup_epochs=5.0, zero_init_residual=True, whiten_stem=True, **FEW_STEP),
    # added 2026-12-08 (issue 54): Muon on the convolutions (airbench94_muon's rule: Nesterov momentum 0.6,
    # orthogonalised, weights held at norm sqrt(c_out)), SGD (Nesterov 0.85) for BatchNorm, biases and the
    # head; muon_lr per 32 images on the linear rule (airbench's 0.24 at 2,000 is 0.0038 per 32); the rest of
    # airbench's few-step tricks: BatchNorm scales fixed at 1 with the shifts at 64x the lr, identity
    # convolutions, linear decay to 0 without warmup, flip + translate TTA, label smoothing 0.2
    **{f"muon {m:g}{name}": dict(MUON, muon_lr=m, **extra) for m in (0.002, 0.004, 0.008) for name, extra in (
        ("", {}),
        (" + EMA", dict(ema_epochs=0.5)),
        (" BN trained", dict(freeze_bn_scale=False, bn_lr_scale=1.0)),
        (" + depthwise", dict(muon_on="conv+depthwise")),
        (" + warmup 1", dict(warmup_epochs=1.0, schedule="linear")),
        (" + batch aug 2", dict(batch_aug=2)),
    )},
    # added after screen 1's first points (muon 0.004 at lr 0.025: the training loss rose to 50-130 in the
    # first epoch, test accuracy 0.100 -- the SGD side, head at 1.2 and BatchNorm shifts at 77 at np=48 from the
    # first step, blew up): the SGD side's lr on a log grid, and the head by Muon as well
    **{f"muon {m:g} sgd {lr:g}{name}": dict(MUON, muon_lr=m, lr=lr, **extra)
       for m in (0.001, 0.002, 0.004, 0.008) for lr in (0.0025, 0.00025) for name, extra in (
           ("", {}), (" + head", dict(muon_on="conv+head")), (" BN trained", dict(freeze_bn_scale=False, bn_lr_scale=1.0)),
           (" + depthwise", dict(muon_on="conv+depthwise")), (" + EMA", dict(ema_epochs=0.5)),
           (" + batch aug 2", dict(batch_aug=2)))},
    # the same with the warmup-stable-decay schedule (3 epochs of decay), for the time to accuracy
    # (to_accuracy.py: a run extended epoch by epoch from its stable phase)
    **{f"muon {m:g} wsd 3": dict(MUON, muon_lr=m, schedule="wsd", decay_epochs=3.0) for m in (0.002, 0.004, 0.008)},
    **{f"muon {m:g} sgd {lr:g}{name} wsd 3": dict(MUON, muon_lr=m, lr=lr, schedule="wsd", decay_epochs=3.0, **extra)
       for m in (0.001, 0.002, 0.004, 0.008) for lr in (0.0025, 0.00025) for name, extra in (
           ("", {}), (" + head", dict(muon_on="conv+head")), (" BN trained", dict(freeze_bn_scale=False, bn_lr_scale=1.0)))},
    "linear + warmup 5 + few-step + zero-init residual + wsd 3": dict(
        lr=0.025, lr_scaling="linear", warmup_epochs=5.0, zero_init_residual=True,
        **{**FEW_STEP, "schedule": "wsd"}, decay_epochs=3.0),
    # the best SGD recipe that keeps np=1, with a warmup short enough for the shorter screens
    "linear + warmup 2 + few-step + zero-init residual": dict(lr=0.025, lr_scaling="linear", warmup_epochs=2.0,
                                                             zero_init_residual=True, **FEW_STEP),
}
REFERENCE = "naive"  # np=1's committed recipe (0.785 on seed 0 at 50,000 images, CPU)
REFERENCE_NP1 = os.path.join(REPO, "experiments", "paper-size", "naive", "np1", "result.json")  # its committed run


def default_data() -> str:
    for path in (os.environ.get("PILAB_CIFAR_ARCHIVE", ""),
                 os.path.join(REPO, "..", "shared", "data", "cifar10-jpeg.tar.gz"),
                 os.path.join(REPO, "shared", "data", "cifar10-jpeg.tar.gz")):
        if path and os.path.isfile(path):
            return os.path.abspath(path)
    return "cifar10"


_DS = None  # the decoded data, loaded by the parent before the workers fork (they share its pages)
def slug(name: str) -> str:
    """A candidate's folder name: ``"linear + warmup 5 + few-step"`` -> ``linear-warmup-5-few-step``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def point_dir(out: str, name: str, np_: int, seed: int) -> str:
    """``OUT/<candidate slug>/np<NP>-seed<SEED>``: one point's result.json and checkpoints."""
    return os.path.join(out, slug(name), f"np{np_}-seed{seed}")


def seeds(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _same_run(saved: dict, wanted: dict, checksum: str) -> bool:
    """Whether a saved result is the run a Config (``wanted``, on the data whose digest is ``checksum``)
    computes; they may differ in what a resumption may change, and in the path the data was read from
    (the data set is the one its digest names). The saved config is read through Config, so a setting
    added since takes its default: compile_bn's ``auto`` acts only on the fast mode on CPU, so the exact
    points made before it are the same run."""
    from pilab.config import Config, ConfigError
    from pilab.engine.checkpoint import RESUMABLE
    strip = lambda c: json.loads(json.dumps({k: v for k, v in c.items() if k not in (*RESUMABLE, "data")}))  # noqa: E731
    try:
        cfg = Config.from_dict(saved["config"]).to_dict()
    except (ConfigError, TypeError, ValueError):
        return False
    return strip(cfg) == strip(wanted) and (saved.get("data") or {}).get("checksum") == checksum


def finished(path: str) -> dict | None:
    """The result at ``path`` (read by pilab.resultfile: result.json and its per-step file) if its run went
    to its last step, else None."""
    from pilab import resultfile
    if not os.path.isfile(path):
        return None
    r = resultfile.load(path)
    return r if not r.get("stopped_early") and r.get("steps_done") == r.get("total_steps") else None


def _row(job: dict, r: dict, wall_s: float, skipped: bool) -> dict:
    return {**job, "config": r["config"], "final_test_acc": r["epochs"][-1]["test_acc"], "epochs": [
        {k: e[k] for k in ("epoch", "train_loss", "train_acc", "test_acc", "time")} for e in r["epochs"]],
        "steps_per_epoch": r["steps_per_epoch"], "global_batch": r["global_batch"], "wall_s": wall_s,
        "train_s": r["train_time"], "resumed_from_step": r["resumed_from_step"], "skipped": skipped,
        "error": None}


def run_job(job: dict) -> dict:
    """One (candidate, np, seed) point in a worker, in its own folder (``job["dir"]``): skipped where its
    result.json is finished, resumed from its ``checkpoint.pt`` where one is there (a point cut short by a
    signal, a reboot), else run from the start; its result row (errors included, never raised)."""
    import torch

    from pilab.config import Config
    from pilab.engine import checkpoint
    t = time.perf_counter()
    # this worker's thread count before any torch op (the engine sets it only after its memory probe, a
    # forward): a forked child must not enter an OpenMP pool of more threads than it has (GNU OpenMP's
    # pool does not survive fork; a parent that ran torch on 2 threads left one behind)
    torch.set_num_threads(max(1, job["config"]["threads"]))
    try:
        done = finished(os.path.join(job["dir"], "result.json"))
        if done is not None:
            return _row(job, done, 0.0, skipped=True)
        ck = checkpoint.latest(job["dir"])
        cfg = Config(**job["config"], out=job["dir"], resume=ck or "")
        if cfg.device == "cuda":
            torch.backends.cudnn.benchmark = True
        where = f"np={job['np']:>2} seed {job['seed']} {job['candidate']}"
        print(f"screen: {where}: {'resumes from ' + ck if ck else 'starts'}", flush=True)

        cpu0 = time.process_time()  # this worker's CPU seconds (all its threads): the cost on a shared box

        def log(e: dict) -> None:
            if e["kind"] == "epoch":
                print(f"screen: {where}: epoch {e['epoch']} test acc {e['test_acc']:.4f} ({e['time']:.0f} s, "
                      f"{e['images_per_s']:.0f} img/s; {time.process_time() - cpu0:.0f} CPU s so far)", flush=True)
        r, _ = engine.fit(cfg, engine.VirtualRanks(job["np"]), data=_DS, callbacks=[log])
        if r.get("stopped_early"):
            raise RuntimeError(f"stopped early: {r.get('stop_reason')}")
        return _row(job, r, time.perf_counter() - t, skipped=False)
    except Exception as e:  # noqa: BLE001 -- a screen reports a broken candidate and goes on
        return {**job, "final_test_acc": None, "wall_s": time.perf_counter() - t, "error": repr(e)[:500]}


def job(name: str, np_: int, seed: int, a) -> dict:
    cfg = {**PROTOCOL, "epochs": a.epochs, **CANDIDATES[name], "seed": seed, "data": a.data,
           "train_subset": a.train_subset, "test_subset": a.test_subset, "device": a.device,
           "simulate_mode": a.simulate_mode, "threads": a.threads, "checkpoint_every": 1, "keep": 1,
           "checkpoint_minutes": a.checkpoint_minutes, "checkpoint_every_steps": a.checkpoint_every_steps}
    return {"candidate": name, "np": np_, "seed": seed, "config": cfg,
            "dir": point_dir(a.out, name, np_, seed)}


def check_points(jobs: list[dict], checksum: str) -> None:
    """Refuse an ``--out`` whose point folders hold another protocol's run, finished (its result.json) or
    cut short (its checkpoint.pt), or a result in the old form, and a candidate these settings cannot run
    (a warmup longer than ``--epochs``): one line, exit 2, before anything is written. ``checksum``: the
    digest of the data this command trains on."""
    from pilab import resultfile
    from pilab.config import Config, ConfigError
    from pilab.engine import checkpoint
    for j in jobs:
        path, problem = os.path.join(j["dir"], "result.json"), None
        try:
            cfg = Config(**j["config"])
        except ConfigError as e:
            print(f"screen: {j['candidate']} at np={j['np']}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if os.path.isfile(path):
            try:
                if not _same_run(resultfile.load(path), cfg.to_dict(), checksum):
                    problem = f"{path} is another protocol's run (its config or data differ from this command's)"
            except resultfile.ResultFileError as e:
                print(f"screen: {e}", file=sys.stderr)
                raise SystemExit(2) from None
        elif checkpoint.latest(j["dir"]):
            try:
                checkpoint.load(checkpoint.latest(j["dir"]), cfg, j["np"])
            except checkpoint.CheckpointError as e:
                problem = str(e)
        if problem:
            print(f"screen: {problem}; give another --out, or the flags that made it", file=sys.stderr)
            raise SystemExit(2)


def claim(out: str):
    """``OUT/.lock``, locked for as long as this run (and its forked workers) lives -- the kernel drops the
    lock when they end, however they end -- so that two drivers never train the same point at once."""
    f = open(os.path.join(out, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        print(f"screen: another screen.py (pid {f.read().strip() or '?'}) is writing {out}; wait for it to end, "
              "or give another --out", file=sys.stderr)
        raise SystemExit(2) from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def table(out: str) -> str:
    """``OUT/table.md`` from ``OUT/results.jsonl`` and the points' result.json files: the issue's summary
    (each candidate at np=1 and np=48, mean +- sd over its seeds, the gap, the predicted Pi speedup, time
    and energy to the target), then each finished point (its last row), best first, with its accuracy per
    epoch; and ``OUT/curves.png`` (:func:`figure`)::

        python experiments/paper-batch/screen.py --table experiments/paper-batch/cpu
    """
    rows = [json.loads(line) for line in open(os.path.join(out, "results.jsonl")) if line.strip()]
    last = {(r["candidate"], r["np"], r["seed"]): r for r in rows if r["final_test_acc"] is not None}
    done = sorted(last.values(), key=lambda r: -r["final_test_acc"])
    lines = ["| candidate | np | seed | final test acc | steps | images | test acc per epoch |",
             "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['candidate']} | {r['np']} | {r['seed']} | {r['final_test_acc']:.4f} | {_steps_images(r)} | "
              + " ".join(f"{e['test_acc']:.3f}" for e in r["epochs"]) + " |" for r in done]
    text = summary(out) + "\n" + images_to_reach(out) + "\n" + fit(out) + "\n## Every point\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text)
    figure(out)
    return text


def _steps_images(r: dict) -> str:
    """``steps | images`` a finished point (a results.jsonl row or a result.json) trained for."""
    steps = r["steps_per_epoch"] * len(r["epochs"])
    return f"{steps:,} | {steps * r['global_batch']:,}"


def points(out: str) -> dict[tuple[str, int], list[dict]]:
    """{(candidate, np): [result.json of each finished seed, by seed]} of the point folders under ``out``."""
    names = {slug(n): n for n in CANDIDATES}
    found: dict[tuple[str, int], list[dict]] = {}
    for cand in sorted(os.listdir(out)):
        d = os.path.join(out, cand)
        for point in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            r = finished(os.path.join(d, point, "result.json"))
            if r is not None:
                found.setdefault((names.get(cand, cand), r["np"]), []).append(r)
    for rs in found.values():
        rs.sort(key=lambda r: r["config"]["seed"])
    return found


def _mean_sd(values: list[float]) -> tuple[float, float | None]:
    m = sum(values) / len(values)
    sd = (sum((v - m) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else None
    return m, sd


def _acc(values: list[float]) -> str:
    m, sd = _mean_sd(values)
    return f"{m:.4f}" + (f" +- {sd:.4f}" if sd is not None else "") + f" ({len(values)})"


CLUSTER = "pi4b_cluster"  # the target the speed and energy are predicted for: 24 Pi 4B nodes, 2 ranks each


def summary(out: str, big: int | None = None) -> str:
    """The issue's table: per candidate, np=1 and np=``big`` final test accuracy (mean +- sd (seeds)) and
    their gap; the predicted whole-run speedup on the Pi cluster over one node (np=2, the paper's baseline);
    MLPerf-style time to the target (90% of np=1's mean) on the Pi at np=``big`` and its speedup over one
    node (np=1's curve -- the same recipe, one process -- at one node's predicted epoch time); the predicted
    energy of the whole run and to the target. A target not reached is "not reached", never a number."""
    import torch
    found = points(out)
    big = big or max([p for _, p in found] or [48])  # the large np: the one the points have beside np=1
    # the performance model measures the model with a forward: on one thread, so this process (the driver,
    # which forks its workers) starts no OpenMP pool that a later fork would inherit broken
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _summary(found, big)
    finally:
        torch.set_num_threads(threads)


def _summary(found: dict, big: int) -> str:
    from dataclasses import replace

    from pilab import perfmodel
    from pilab.config import Config
    from pilab.study.analysis import run_energy, sized_for_model, time_to_target
    head = [f"| candidate | np=1 | np={big} | np={big} − np=1 | steps np=1 / np={big} | images np=1 / np={big} | Pi speedup, whole run | time to target, np={big} on "
            f"the Pi (× one node) | energy on the Pi, np={big}: run / to target |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    body = []
    ref = finished(REFERENCE_NP1)
    ref_acc = ref["epochs"][-1]["test_acc"] if ref else None
    for name in sorted({n for n, p in found if p == big}, key=lambda n: (-_mean_sd(
            [r["epochs"][-1]["test_acc"] for r in found[(n, big)]])[0], n)):  # ties by name: sets' order varies
        at_big, at_one = found[(name, big)], found.get((name, 1), [])
        acc_big = [r["epochs"][-1]["test_acc"] for r in at_big]
        acc_one = [r["epochs"][-1]["test_acc"] for r in at_one]
        cfg = replace(sized_for_model(Config.from_dict(at_big[0]["config"]), {big: at_big[0]}), threads=0,
                      out="", resume="")
        pred = {p: perfmodel.predict(cfg, p, CLUSTER) for p in (2, big)}
        speedup = pred[2]["epoch_time"] / pred[big]["epoch_time"]
        ttt = energy = "—"
        if acc_one:
            target = 0.9 * _mean_sd(acc_one)[0]
            n = len(at_big[0]["epochs"])

            def times(p):
                return {"train": [pred[p]["time"]] * n, "eval": [pred[p]["eval_time"]] * n,
                        "comm_exposed_share": pred[p]["comm_exposed"] / pred[p]["time"]}
            big_t = [time_to_target(r, target, times(big)["train"], times(big)["eval"]) for r in at_big]
            one_t = [time_to_target(r, target, times(2)["train"], times(2)["eval"]) for r in at_one]
            reached = [t for t in big_t if t is not None]
            if len(reached) < len(big_t):
                ttt = f"not reached in {len(big_t) - len(reached)} of {len(big_t)} (target {target:.3f})"
            elif None not in one_t:
                ttt = (f"{_mean_sd(reached)[0] / 60:.1f} min "
                       f"(× {_mean_sd(one_t)[0] / _mean_sd(reached)[0]:.1f}; target {target:.3f})")
            e = [run_energy(r, times(big), CLUSTER, target) for r in at_big]
            to = [x["energy_to_target_j"] for x in e]
            energy = (f"{_mean_sd([x['energy_j'] for x in e])[0] / 1e3:.0f} kJ / "
                      + (f"{_mean_sd(to)[0] / 1e3:.0f} kJ" if None not in to else "not reached"))
        gap = f"{(_mean_sd(acc_big)[0] - _mean_sd(acc_one)[0]) * 100:+.1f} points" if acc_one else "—"
        one = _acc(acc_one) if acc_one else "—"
        same_protocol = ref is not None and acc_one and all(
            at_one[0]["config"][k] == ref["config"][k] for k in ("train_subset", "test_subset", "epochs"))
        if same_protocol and _mean_sd(acc_one)[0] < ref_acc - 0.01:
            # the rule: a recipe that wins only by hurting the baseline does not count
            one += f" **lowers np=1 by {(ref_acc - _mean_sd(acc_one)[0]) * 100:.1f} points: does not count**"
        steps, images = (f"{at_one[0]['total_steps']:,} / ", f"{at_one[0]['total_steps'] * at_one[0]['global_batch']:,} / "
                         ) if at_one else ("— / ", "— / ")
        body.append(f"| {name} | {one} | {_acc(acc_big)} | {gap} | {steps}{at_big[0]['total_steps']:,} | "
                    f"{images}{at_big[0]['total_steps'] * at_big[0]['global_batch']:,} | "
                    f"{speedup:.1f}× | {ttt} | {energy} |")
    ref_text = (f" The committed np=1 recipe (experiments/paper-size/naive/np1, seed 0) ends at "
                f"{ref_acc:.4f}: a recipe's np=1 may not fall more than a point under it (one that does is "
                "marked)." if ref else "")
    note = (f"\nnp=1 and np={big}: final test accuracy, mean +- sd (seeds).{ref_text} Speed, time and energy: the "
            f"performance model's prediction for `{CLUSTER}` (24 Pi 4B, 2 ranks a node) against one node "
            "(np=2); one node's time to target is np=1's curve at one node's epoch time. The issue's goal: np=48 "
            "within 1 point of np=1 (3 seeds each), whole-run speedup >= 20×, time to target >= 20× "
            "faster than one node.\n")
    return "## Summary\n\n" + "\n".join(head + body) + "\n" + note


LEVELS = (0.5, 0.6, 0.65, 0.7, 0.75)  # the test accuracies images_to_reach counts the epochs to


def _mean_curve(rs: list[dict]) -> list[float]:
    """Test accuracy after each epoch, mean over these seeds' result.json (as long as the shortest)."""
    return [sum(r["epochs"][e]["test_acc"] for r in rs) / len(rs) for e in range(min(len(r["epochs"]) for r in rs))]


def epochs_to(accs: list[float], level: float) -> float | None:
    """The epochs of training after which a curve of test accuracy per epoch first reaches ``level``,
    linear between epoch ends (1.0 if the first epoch's end is already there); None if it never does::

        epochs_to([0.47, 0.58, 0.63], 0.60)   # 2.4
    """
    for e, a in enumerate(accs):
        if a >= level:
            return 1.0 if e == 0 else e + (level - accs[e - 1]) / (a - accs[e - 1])
    return None


def images_to_reach(out: str, big: int | None = None) -> str:
    """The table's data-efficiency section: for np=1's committed recipe and each candidate at np=1 and
    np=``big`` (its mean curve over seeds), the epochs of images after which the test accuracy first
    reaches each of ``LEVELS``; at np=``big``, also how many times the same recipe's np=1 that is (the same
    warmup and schedule in epochs, so the ratio is what the larger batch costs in images)."""
    found = points(out)
    big = big or max([p for _, p in found] or [48])
    ref = finished(REFERENCE_NP1)
    mean = _mean_curve
    seeds_of = lambda rs: f"{len(rs)} seed{'s' if len(rs) > 1 else ''}"  # noqa: E731

    def cells(acc, base=None):
        out = []
        for lv in LEVELS:
            e, b = epochs_to(acc, lv), epochs_to(base, lv) if base else None
            out.append("—" if e is None else f"{e:.1f}" + (f" ({e / b:.1f}×)" if b else ""))
        return " | ".join(out)
    lines = ["| curve | " + " | ".join(f"to {lv:.2f}" for lv in LEVELS) + " |", "|---|" + "---:|" * len(LEVELS)]
    if ref:
        lines.append(f"| np=1, committed recipe (seed 0) | {cells([e['test_acc'] for e in ref['epochs']])} |")
    for name in sorted({n for n, p in found if p == big}):
        one = mean(found[(name, 1)]) if (name, 1) in found else None
        if one:
            lines.append(f"| {name}, np=1 ({seeds_of(found[(name, 1)])}) | {cells(one)} |")
        lines.append(f"| {name}, np={big} ({seeds_of(found[(name, big)])}) | "
                     f"{cells(mean(found[(name, big)]), one)} |")
    return ("## Images to each accuracy\n\n" + "\n".join(lines) + "\n\nEpochs of training images (linear "
            "between epoch ends, on the mean curve over seeds) after which the test accuracy first reaches each "
            f"level; at np={big}, in brackets, how many times the same recipe's np=1 that is; — : not within the "
            "run. Every run has the same 10 epochs of images and a schedule set in epochs: a curve that needs "
            "more images for an accuracy runs out of them first.\n")


def fit(out: str, big: int | None = None) -> str:
    """The table's section on fitting: per candidate with both np, the training accuracy of the last epoch
    (over its augmented images, averaged over its steps) beside the test accuracy, mean over seeds, and np=``big``
    minus np=1 in each. Where the training gap is as wide as the test gap, np=``big`` loses by fitting the
    training images less in its steps, not by generalising worse from what it fits."""
    found = points(out)
    big = big or max([p for _, p in found] or [48])
    lines = [f"| candidate | train acc np=1 | np={big} | train gap | test acc np=1 | np={big} | test gap |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in sorted({n for n, p in found if p == big and (n, 1) in found}):
        tr = {p: _mean_sd([r["epochs"][-1]["train_acc"] for r in found[(name, p)]])[0] for p in (1, big)}
        te = {p: _mean_sd([r["epochs"][-1]["test_acc"] for r in found[(name, p)]])[0] for p in (1, big)}
        lines.append(f"| {name} | {tr[1]:.3f} | {tr[big]:.3f} | {(tr[big] - tr[1]) * 100:+.1f} | "
                     f"{te[1]:.3f} | {te[big]:.3f} | {(te[big] - te[1]) * 100:+.1f} |")
    return ("## Fitting the training images\n\n" + "\n".join(lines) + "\n\nThe last epoch's training accuracy "
            "(its augmented images, averaged over the epoch's steps, the weights themselves) and the final test accuracy (with "
            "the recipe's EMA and flip averaging where it has them), mean over seeds; gaps in points. A training gap "
            f"as wide as the test gap: np={big} fits the training images less in its steps, rather than "
            "generalising worse from what it fits.\n")


def figure(out: str, big: int | None = None) -> str | None:
    """``OUT/curves.png``: each candidate's test accuracy after each epoch (mean over its seeds) at np=1
    (dashed) and np=``big`` (solid), against the images seen -- the same images at both np, so the gap at
    any point is what the fewer, larger steps cost. None (and no file) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("screen: no figure: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    found = points(out)
    big = big or max([p for _, p in found] or [48])
    names = sorted({n for n, _ in found})
    # the legend goes under the axes (one line a curve): inside, a dozen curves' labels hid the curves
    fig, ax = plt.subplots(figsize=(7, 3.6 + 0.16 * sum((n, p) in found for n in names for p in (1, big))))
    for i, name in enumerate(names):
        for p, style in ((1, "--"), (big, "-")):
            rs = found.get((name, p))
            if not rs:
                continue
            mean = _mean_curve(rs)
            images = [(e + 1) * rs[0]["global_batch"] * rs[0]["steps_per_epoch"] / 1e3 for e in range(len(mean))]
            ax.plot(images, mean, style, color=f"C{i}", marker="o", ms=3,
                    label=f"{name}, np={p} ({len(rs)} seed{'s' if len(rs) > 1 else ''}, "
                          f"{rs[0]['total_steps']} steps)")
    ax.set_xlabel("training images seen (thousands)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.set_title(f"The paper's batch: np=1 (dashed) and np={big} (solid) on the same images", fontsize=9)
    path = os.path.join(out, "curves.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    p.add_argument("--nps", default="48", help="the large np (default 48); np=1 always runs beside it")
    p.add_argument("--candidates", default="all", help="comma-separated names, or all")
    p.add_argument("--reference-seeds", default="0,1,2", help="seeds of np=1's committed recipe ('' = none)")
    p.add_argument("--np1-seeds", default="", help="also run each candidate at np=1 on these seeds in stage 1, "
                   "after its np=48 run ('' = none)")
    p.add_argument("--top", type=int, default=3, help="recipes taken to stage 2 (0: none)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--simulate-mode", default="fast", choices=("fast", "exact", "auto"),
                   help="the simulator's mode (fast: the screen on a GPU; exact: MPI's arithmetic, the table)")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0,
                   help="each point checkpoints every epoch and every M minutes inside one (0: epochs only)")
    p.add_argument("--checkpoint-every-steps", type=int, default=0, help="... and every K steps (0: never)")
    p.add_argument("--budget-s", type=float, default=0, help="start no job after this many seconds (0: none)")
    p.add_argument("--out", required=True, help="one folder per point under it: OUT/<candidate>/np<N>-seed<S>")
    a = p.parse_args(argv)
    a.data = a.data or default_data()
    a.names = list(CANDIDATES) if a.candidates == "all" else [n.strip() for n in a.candidates.split(",")]
    unknown = [n for n in a.names if n not in CANDIDATES]
    if unknown:
        p.error(f"unknown candidate(s) {unknown}; choose from {list(CANDIDATES)}")
    return a


def _report(row: dict, t0: float) -> None:
    acc = row["final_test_acc"]
    how = "skipped, finished before" if row.get("skipped") else f"{row['wall_s']:.0f} s"
    print(f"screen: {time.perf_counter() - t0:6.0f} s  np={row['np']:>2} seed {row['seed']} "
          f"{row['candidate']:<45} {acc if acc is None else round(acc, 4)} "
          f"({how}){' ' + row['error'] if row['error'] else ''}", flush=True)


def main(argv=None) -> list[dict]:
    if argv is None and sys.argv[1:2] == ["--table"] or argv and argv[:1] == ["--table"]:
        print(table((argv or sys.argv[1:])[1]), end="")
        return []
    a = parse(argv)
    big = int(a.nps)
    stage1 = [job(REFERENCE, 1, s, a) for s in seeds(a.reference_seeds)]
    stage1 += [job(n, big, 0, a) for n in a.names]
    stage1 += [job(n, 1, s, a) for n in a.names for s in seeds(a.np1_seeds)]
    global _DS
    from pilab import data as data_mod
    t0 = time.perf_counter()
    # the data first: a kept point is checked against what it is (its digest), not the path it came from
    _DS = data_mod.load(a.data, train_subset=a.train_subset, test_subset=a.test_subset)
    check_points(stage1, _DS.checksum)
    os.makedirs(a.out, exist_ok=True)
    lock = claim(a.out)  # noqa: F841 -- held (by this process and its workers) until they end
    print(f"screen: data {_DS.source}: {len(_DS.y_train)} train / {len(_DS.y_test)} test, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    path = os.path.join(a.out, "results.jsonl")
    key = lambda r: (r["candidate"], r["np"], r["seed"])  # noqa: E731
    have = {key(json.loads(line)) for line in open(path) if line.strip()} if os.path.isfile(path) else set()
    out = open(path, "a")
    rows: list[dict] = []
    late = lambda: a.budget_s and time.perf_counter() - t0 > a.budget_s  # noqa: E731

    # fork: the workers share the parent's decoded arrays; the parent never touches CUDA
    with cf.ProcessPoolExecutor(a.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        given: set[str] = set()  # each point's folder once, whichever stage asks for it first
        submit = lambda jobs: {pool.submit(run_job, j) for j in jobs if not (  # noqa: E731
            j["dir"] in given or given.add(j["dir"]))}
        first = submit([j for j in stage1 if j["np"] == big])
        pending = first | submit([j for j in stage1 if j["np"] != big])
        staged = a.top <= 0
        while pending:
            done, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for f in done:
                row = f.result()
                rows.append(row)
                if not row.get("skipped") or key(row) not in have:  # (a driver killed as a point ended)
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                _report(row, t0)
            if not staged and not (first & pending):
                staged = True
                ok = [r for r in rows if r["np"] == big and r["final_test_acc"] is not None]
                best = [r["candidate"] for r in sorted(ok, key=lambda r: -r["final_test_acc"])[:a.top]]
                print(f"screen: stage 2 for {best}", flush=True)
                for n in best:
                    jobs = [job(n, big, s, a) for s in (1, 2)]
                    jobs += [job(n, 1, s, a) for s in (0, 1, 2)] if n != REFERENCE else []
                    pending |= submit(jobs)
            if late():  # jobs not yet started are dropped; running ones finish
                pending = {f for f in pending if not f.cancel()}
    out.close()
    table(a.out)
    return rows


if __name__ == "__main__":
    main()
