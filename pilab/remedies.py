"""Remedies: which settings keep accuracy at large np, and what they cost in time.

With the simulator (exact np-rank emulation in one process) each candidate's accuracy at np ranks is
measured on real data; the performance model gives its time per epoch and time to target. Candidates
are the baseline, one change at a time (so each cause shows on its own), and the published recipes
combined (Goyal et al.'s linear scaling + warmup; LARS + warmup; a fixed global batch)::

    from pilab.config import Config
    from pilab import remedies
    res = remedies.search(Config(width=0.25, epochs=4, train_subset=2000), np_=48)
    res["candidates"]   # label, changes, final_test_acc, epoch_time, time_to_target, pareto
    res["best"]         # the Pareto front (time vs accuracy), most accurate first

    python -m pilab remedies --np 48 --out runs/remedies
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from . import perfmodel, simulate
from .config import Config, ConfigError, small_mode
from .engine import load_data
from .scaling import POWER_MODELS, calibrate_from, run_energy, time_to_target


def candidates(cfg: Config, np_: int) -> list[tuple[str, dict]]:
    """(label, changes) pairs: the baseline, single-factor changes, then combined recipes."""
    warm = max(1.0, round(cfg.epochs / 5, 1))
    # A fixed global batch of the size a single rank used, rounded to a multiple of np (>= 2 per rank).
    per = max(2, round(cfg.batch_size / np_))
    fixed_global = {"batch_mode": "global", "batch_size": per * np_}
    out = [
        ("baseline", {}),
        ("linear lr", {"lr_scaling": "linear"}),
        ("sqrt lr", {"lr_scaling": "sqrt"}),
        (f"warmup {warm:g} ep", {"warmup_epochs": warm}),
        ("lars", {"optimizer": "lars", "lr_scaling": "linear", "lr": cfg.lr * 20}),
        ("ghost BN 8", {"ghost_batch": 8} if cfg.per_rank_batch(np_) % 8 == 0 else None),
        ("BN buffers averaged", {"bn_buffers": "average"}),
        (f"fixed global batch {per * np_}", fixed_global),
        (f"{2 * cfg.epochs} epochs", {"epochs": 2 * cfg.epochs}),
        ("linear lr + warmup", {"lr_scaling": "linear", "warmup_epochs": warm}),
        ("sqrt lr + warmup", {"lr_scaling": "sqrt", "warmup_epochs": warm}),
        ("lars + warmup", {"optimizer": "lars", "lr_scaling": "linear", "lr": cfg.lr * 20,
                           "warmup_epochs": warm}),
        ("fixed global batch + sqrt lr", {**fixed_global, "lr_scaling": "sqrt"}),
        (f"sqrt lr + warmup, {2 * cfg.epochs} epochs",
         {"lr_scaling": "sqrt", "warmup_epochs": warm, "epochs": 2 * cfg.epochs}),
    ]
    return [(label, ch) for label, ch in out if ch is not None]


def notebook_candidates() -> list[str] | None:
    """All candidates on a laptop; three under CI / nbval (PILAB_NB_SMALL), to keep it quick."""
    return ["baseline", "linear lr", "linear lr + warmup"] if small_mode() else None


def pareto(points: list[dict], time_key: str = "epochs_time", acc_key: str = "final_test_acc",
           energy_key: str | None = None) -> list[bool]:
    """True for points no other point beats: lower time, higher accuracy (and lower energy, with
    ``energy_key``) — at least as good on every axis and better on one."""
    keys = [(time_key, -1), (acc_key, 1)] + ([(energy_key, -1)] if energy_key else [])

    def ok(q):
        return all(q.get(k) is not None for k, _ in keys)

    def beats(q, p):
        ge = all(sign * (q[k] - p[k]) >= 0 for k, sign in keys)
        return ge and any(sign * (q[k] - p[k]) > 0 for k, sign in keys)
    return [ok(p) and not any(q is not p and ok(q) and beats(q, p) for q in points) for p in points]


def search(cfg: Config, np_: int, *, only: list[str] | None = None, calibration=None,
           target_fraction: float = 0.9, reference_acc: float | None = None, data=None,
           callbacks=(), log=None, mpiexec: str | None = None) -> dict:
    """Simulate every candidate at ``np_`` ranks; rank them by accuracy and by predicted time.

    ``reference_acc`` (e.g. the np=1 run's final test accuracy) sets the target accuracy; without it
    the baseline candidate simulated at np=1 is run first to get it. ``calibration`` is what the
    performance model predicts times for: a Calibration, a preset name (``"pi4b_cluster"``), a JSON
    path, ``"this"`` (this machine, calibrated from the np=1 reference run and a short
    micro-benchmark under ``mpiexec``) or None (no times, no Pareto front).
    """
    ds = data if data is not None else load_data(cfg)
    cands = candidates(cfg, np_)
    if only:
        cands = [c for c in cands if c[0] in only]
        if not cands:
            raise ConfigError(f"none of {only} is a candidate; see remedies.candidates()")
    sim_cfg = replace(cfg, out="", threads=cfg.threads)
    if reference_acc is None or calibration == "this":
        ref = simulate.run(sim_cfg, 1, data=ds)
        if reference_acc is None:
            reference_acc = ref["epochs"][-1]["test_acc"]
        if calibration == "this":
            calibration = calibrate_from(ref, mpiexec)
    target = target_fraction * reference_acc
    rows = []
    for label, changes in cands:
        try:
            c = replace(sim_cfg, **changes)
            c.check_world(np_, len(ds.y_train))
        except ConfigError as e:
            rows.append({"label": label, "changes": changes, "skipped": str(e)})
            continue
        res = simulate.run(c, np_, data=ds)
        epoch_time = None
        if calibration is not None:
            # A preset machine places its own threads per rank; this machine's count says nothing there.
            on = replace(c, threads=0) if isinstance(calibration, str) and calibration in perfmodel.PRESETS else c
            pred = perfmodel.predict(on, np_, calibration)
            epoch_time = pred["time"]
        times = [epoch_time] * len(res["epochs"]) if epoch_time else None
        last = res["epochs"][-1]
        row = {"label": label, "changes": changes, "global_batch": res["global_batch"],
               "per_rank_batch": res["per_rank_batch"], "peak_lr": res["peak_lr"],
               "steps": res["total_steps"], "final_test_acc": last["test_acc"],
               "final_train_loss": last["train_loss"],
               "test_acc_curve": [e["test_acc"] for e in res["epochs"]],
               "epoch_time": epoch_time,
               "epochs_time": epoch_time * len(res["epochs"]) if epoch_time else None,
               "time_to_target": time_to_target(res, target, times, [pred["eval_time"]] * len(times))
               if times else None,
               "reached_target": any((e["test_acc"] or 0) >= target for e in res["epochs"])}
        if epoch_time and calibration in POWER_MODELS:  # energy: the third axis of the front
            row.update(run_energy(res, {"train": times, "eval": [pred["eval_time"]] * len(times),
                                        "comm_exposed_share": pred["comm_exposed"] / pred["time"]},
                                  calibration, target))
        rows.append(row)
        for cb in callbacks:
            cb({"kind": "candidate", **row})
        if log:
            log(f"  {label:<34} test acc {row['final_test_acc']:.3f}")
    done = [r for r in rows if "skipped" not in r]
    have_time = any(r["epochs_time"] for r in done)
    have_energy = any(r.get("energy_j") is not None for r in done)
    flags = pareto(done, energy_key="energy_j" if have_energy else None) if have_time else [False] * len(done)
    for r, f in zip(done, flags):
        r["pareto"] = f
    best = sorted((r for r in done if r["pareto"]) if have_time else done,
                  key=lambda r: -(r["final_test_acc"] or 0))
    return {"kind": "pilab.remedies", "np": np_, "config": cfg.to_dict(),
            "calibration": calibration.to_dict() if hasattr(calibration, "to_dict") else calibration,
            "machine": (calibration if isinstance(calibration, str) else "this machine") if calibration else None,
            "reference_acc": reference_acc, "target_accuracy": target,
            "candidates": rows, "best": best[:5]}


def ablations(cfg: Config, np_: int, *, data=None, log=None) -> dict:
    """Separate the causes of the accuracy drop at ``np_`` ranks, one simulated run each.

    Starting from one process, each row adds one ingredient of a large-np run:
    the bigger global batch and fewer steps (np=1 with np× the batch), per-rank BatchNorm statistics
    (the same with ghost batches of the per-rank size), then the real np-rank run with static shards
    (shard composition), with reshuffled shards, and the LR rule with and without warmup::

        res = remedies.ablations(Config(width=0.25, epochs=3, train_subset=2000), np_=16)
        [(r["label"], r["final_test_acc"]) for r in res["rows"]]
    """
    ds = data if data is not None else load_data(cfg)
    b = cfg.per_rank_batch(np_)
    big = replace(cfg, batch_mode="per_rank", batch_size=b * np_, out="")
    warm = max(1.0, round(cfg.epochs / 5, 1))
    plan = [
        ("1 rank, batch b", "reference", replace(cfg, out=""), 1),
        (f"1 rank, batch {b * np_} (global batch, step count)", "global batch & steps", big, 1),
        (f"1 rank, batch {b * np_}, BN over groups of {b}", "per-rank BN batch",
         replace(big, ghost_batch=b), 1),
        (f"{np_} ranks, static shards", "shard composition", replace(cfg, out=""), np_),
        (f"{np_} ranks, reshuffled shards", "shard composition",
         replace(cfg, sharding="reshuffle", out=""), np_),
        (f"{np_} ranks, linear lr", "LR rule", replace(cfg, lr_scaling="linear", out=""), np_),
        (f"{np_} ranks, linear lr + {warm:g} ep warmup", "LR rule & warmup",
         replace(cfg, lr_scaling="linear", warmup_epochs=warm, out=""), np_),
    ]
    rows = []
    for label, cause, c, p in plan:
        res = simulate.run(c, p, data=ds)
        last = res["epochs"][-1]
        rows.append({"label": label, "cause": cause, "np": p, "global_batch": res["global_batch"],
                     "per_rank_batch": res["per_rank_batch"], "steps": res["total_steps"],
                     "peak_lr": res["peak_lr"], "final_test_acc": last["test_acc"],
                     "final_train_loss": last["train_loss"],
                     "test_acc_curve": [e["test_acc"] for e in res["epochs"]]})
        if log:
            log(f"  {label:<52} test acc {last['test_acc']:.3f}")
    return {"kind": "pilab.ablations", "np": np_, "config": cfg.to_dict(), "rows": rows}


def ablation_table(res: dict) -> str:
    lines = [f"{'run':<54}{'cause':<22}{'glob.batch':>10}{'steps':>7}{'peak lr':>9}{'test acc':>9}"]
    for r in res["rows"]:
        lines.append(f"{r['label']:<54}{r['cause']:<22}{r['global_batch']:>10}{r['steps']:>7}"
                     f"{r['peak_lr']:>9.3g}{r['final_test_acc']:>9.3f}")
    return "\n".join(lines)


def table(res: dict) -> str:
    lines = [f"np={res['np']}  reference accuracy {res['reference_acc']:.3f}  "
             f"target {res['target_accuracy']:.3f}"
             + (f"  times predicted for {res['machine']}" if res.get("machine") else "  (no times: no target)"),
             f"{'candidate':<36}{'glob.batch':>10}{'peak lr':>9}{'steps':>7}{'test acc':>9}"
             f"{'time s':>9}{'→target':>10}{'energy kJ':>10}  pareto"]
    for r in res["candidates"]:
        if "skipped" in r:
            lines.append(f"{r['label']:<36}skipped: {r['skipped']}")
            continue
        t = f"{r['epochs_time']:.0f}" if r["epochs_time"] else "–"
        ttt = f"{r['time_to_target']:.0f}s" if r["time_to_target"] else (
            "not reached" if not r["reached_target"] else "–")
        kj = f"{r['energy_j'] / 1e3:.2f}" if r.get("energy_j") is not None else "–"
        lines.append(f"{r['label']:<36}{r['global_batch']:>10}{r['peak_lr']:>9.3g}{r['steps']:>7}"
                     f"{r['final_test_acc']:>9.3f}{t:>9}{ttt:>10}{kj:>10}  {'*' if r.get('pareto') else ''}")
    return "\n".join(lines)
