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

Each candidate's run is kept as ``out/<label>/result.json`` the moment it finishes; ``resume=True`` keeps
those finished runs (same training) and runs only the others, so a long search spans sittings and its
candidates can run as separate processes (``only=[...]``) and be put together by one last search with
``resume``. ``reuse`` takes a candidate's run from a scaling study where it is the same training (the
baseline at np=48 is the naive rule's np=48 point).
"""
from __future__ import annotations

import os
from dataclasses import replace

import re

from . import perfmodel, plots, simulate
from . import verdict as judging
from .config import Config, ConfigError, small_mode
from .engine import load_data
from .scaling import (POWER_MODELS, calibrate_from, finished_run, reused_run, run_energy, same_training,
                      step_events, target_baseline, time_to_target)


def candidates(cfg: Config, np_: int) -> list[tuple[str, dict]]:
    """(label, changes) pairs: the baseline, single-factor changes, then combined recipes."""
    warm = max(1.0, round(cfg.epochs / 5, 1))
    # A fixed global batch of the size a single rank used, rounded to a multiple of np (>= 2 per rank).
    per = max(2, round(cfg.batch_size / np_))
    fixed_global = {"batch_mode": "global", "batch_size": per * np_}
    # And one of 8 images per rank (Goyal et al.'s per-worker batch is 32; 8 keeps BatchNorm's groups
    # usable and the step count 4x the per-rank batch's), where that lies between the two.
    eight = {"batch_mode": "global", "batch_size": 8 * np_} if per < 8 < cfg.per_rank_batch(np_) else None
    big, sw = 2 * cfg.epochs, {"lr_scaling": "sqrt", "warmup_epochs": warm}
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
        (f"sqrt lr + warmup + {big} epochs", {**sw, "epochs": big}),
        (f"fixed global batch {8 * np_} + sqrt lr + warmup", {**eight, **sw} if eight else None),
        (f"fixed global batch {8 * np_} + sqrt lr + warmup + {big} epochs",
         {**eight, **sw, "epochs": big} if eight else None),
    ]
    return [(label, ch) for label, ch in out + _fast_and_right(cfg, np_, warm) if ch is not None]


def _fast_and_right(cfg: Config, np_: int, warm: float) -> list[tuple[str, dict | None]]:
    """Issue 20's candidates for the same epochs as np=1: local SGD (Stich 2019; Lin et al. 2020: fewer
    averages, so small per-rank batches -- many steps -- stay cheap on the wire), the few-step recipe's
    pieces (as airbench trains CIFAR-10 at large batch), alone and together, and batch-size ramps."""
    eight = {"batch_mode": "global", "batch_size": 8 * np_} if 8 < cfg.per_rank_batch(np_) else None
    tri = {"schedule": "linear", "warmup_epochs": max(0.5, round(cfg.epochs / 20, 1))}
    recipe = {"label_smoothing": 0.2, "ema_epochs": 0.5, "nesterov": True, **tri, "tta": True}
    local8 = {**eight, "local_steps": 8} if eight else None
    # a batch ramp (Smith et al. 2018; AdaBatch): a quarter of the per-rank batch for the first 30% of the
    # epochs (4x the steps), half until 60%, then the whole; the lr rule follows each epoch's batch
    b, e1, e2 = cfg.batch_size, round(cfg.epochs * 0.3), round(cfg.epochs * 0.6)
    ramp = {"batch_size": b // 4, "batch_ramp": f"{e1}:{b // 2},{e2}:{b}"} \
        if cfg.batch_mode == "per_rank" and b >= 8 and 0 < e1 < e2 < cfg.epochs else None
    ramp_label = f"batch ramp {b // 4}-{b // 2}-{b}"
    return [
        *[(f"local SGD H={h}", {"local_steps": h}) for h in (2, 4, 8, 16)],
        (f"post-local SGD H=8 after {warm:g} ep", {"local_steps": 8, "local_after": warm}),
        ("local SGD H=8 at 8 per rank", local8),
        ("local SGD H=8 at 8 per rank + sqrt lr", {**local8, "lr_scaling": "sqrt"} if local8 else None),
        ("label smoothing 0.2", {"label_smoothing": 0.2}),
        ("weight EMA 0.5 ep", {"ema_epochs": 0.5}),
        ("nesterov", {"nesterov": True}),
        ("triangular lr", tri),
        ("flip TTA", {"tta": True}),
        ("few-step recipe", recipe),
        ("few-step recipe + sqrt lr", {**recipe, "lr_scaling": "sqrt"}),
        ("few-step recipe + local SGD H=8 at 8 per rank", {**recipe, **local8} if local8 else None),
        (ramp_label, ramp),
        (f"{ramp_label} + sqrt lr", {**ramp, "lr_scaling": "sqrt"} if ramp else None),
        (f"{ramp_label}, constant lr", {**ramp, "schedule": "constant"} if ramp else None),
        (f"{ramp_label} + local SGD H=8", {**ramp, "local_steps": 8} if ramp else None),
    ]


def candidate_labels(cfg: Config, np_: int) -> list[str]:
    """The labels ``only=`` (``--only``) accepts at these settings and ``np_``, in search order."""
    return [label for label, _ in candidates(cfg, np_)]


def notebook_np() -> int:
    """The np notebook 03 studies: 16 on a laptop; 4 in small mode (PILAB_NB_SMALL: CI, Binder), where
    its small run (2,000 images, 4 epochs) is hurt but not yet at chance, so the causes can be told apart
    (at np=8 every row is at chance: 31 steps)."""
    return 4 if small_mode() else 16


def notebook_causes() -> tuple[str, ...] | None:
    """The ablation rows notebook 03 runs: all on a laptop; in small mode the step count, the batch
    statistics and the shards (the real np-rank run): with the reference four runs of ~28 s each on one
    idle core, the most its 3-minute budget holds beside one remedy."""
    return ("global batch & steps", "per-rank BN batch", "shard composition") if small_mode() else None


def notebook_candidates() -> list[str] | None:
    """All candidates on a laptop; in small mode (PILAB_NB_SMALL) the baseline, which the ablations ran
    already (``search(..., known=...)`` takes it), and the linear LR rule, the published remedy."""
    return ["baseline", "linear lr"] if small_mode() else None


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


def front(rows: list[dict], energy_key: str | None = None) -> list[bool]:
    """The fast-and-right front: :func:`pareto` among the candidates that reached the target
    (``reached_target``); a run that misses it is not on the front however fast it is, and without a
    target (None: the reference has not learned) no run is::

        front([{"epochs_time": 1, "final_test_acc": 0.1, "reached_target": False},
               {"epochs_time": 5, "final_test_acc": 0.6, "reached_target": True}])    # [False, True]
    """
    right = [r for r in rows if r.get("reached_target")]
    flags = dict(zip(map(id, right), pareto(right, energy_key=energy_key)))
    return [flags.get(id(r), False) for r in rows]


def slug(label: str) -> str:
    """The directory a candidate's run is kept in: ``"sqrt lr + warmup"`` -> ``"sqrt-lr-warmup"``."""
    return re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-")


def search(cfg: Config, np_: int, *, only: list[str] | None = None, calibration=None,
           target_fraction: float = 0.9, reference_acc: float | None = None, data=None,
           callbacks=(), log=None, mpiexec: str | None = None, out: str | None = None,
           resume: bool = False, reuse=(), known=()) -> dict:
    """Simulate every candidate at ``np_`` ranks; rank them by accuracy and by predicted time.

    ``reference_acc`` (e.g. the np=1 run's final test accuracy) sets the target accuracy; without it
    the baseline candidate simulated at np=1 is run first to get it. ``calibration`` is what the
    performance model predicts times for: a Calibration, a preset name (``"pi4b_cluster"``), a JSON
    path, ``"this"`` (this machine, calibrated from the np=1 reference run and a short
    micro-benchmark under ``mpiexec``) or None (no times, no Pareto front). With times, each row's
    ``speedup`` is the whole run's (training and evaluations) against the un-remedied ``cfg`` on the
    machine's speed baseline (one Pi node = 2 ranks; else 1 rank): more epochs cost speedup.
    ``out``/``resume``/``reuse``: see the module docstring. ``known``: results already at hand (e.g.
    :func:`ablations`' ``runs``); a candidate that is one of them, and the np=1 reference, are taken from
    them instead of being simulated again::

        abl = remedies.ablations(cfg, 4)
        res = remedies.search(cfg, 4, only=["baseline", "linear lr"], known=abl["runs"])   # nothing re-run

    ``callbacks`` also receive {"kind": "point", "label", "index", "of"} before each run and its
    {"kind": "step"} events (``widgets.Progress`` shows them).
    """
    cands = candidates(cfg, np_)
    if only:
        unknown = [o for o in only if o not in {c[0] for c in cands}]
        if unknown:
            raise ConfigError(f"{', '.join(map(repr, unknown))} {'is not a candidate' if len(unknown) == 1 else 'are not candidates'}"
                              f" at np={np_}; the candidates are: {'; '.join(c[0] for c in cands)}")
        cands = [c for c in cands if c[0] in only]
    ds = data if data is not None else load_data(cfg)  # after the checks: a bad label costs no loading
    sim_cfg = replace(cfg, out="", threads=cfg.threads)
    known = list(known)
    ref = known_run(known, sim_cfg, 1)
    if reference_acc is None and ref is not None:
        reference_acc = ref["epochs"][-1]["test_acc"]
    plan = (["reference np=1"] if reference_acc is None or (calibration == "this" and ref is None) else []) \
        + [label for label, _ in cands]
    if reference_acc is None or (calibration == "this" and ref is None):
        if log:  # minutes on a laptop: say what runs, then one line per epoch
            log(f"  reference: the baseline at np=1, {cfg.epochs} epoch(s), sets the target accuracy")
        _point(callbacks, plan, "reference np=1")
        ref = simulate.run(sim_cfg, 1, data=ds, callbacks=([_epoch_log(log, cfg.epochs)] if log else [])
                           + [step_events(callbacks)])
    if reference_acc is None or calibration == "this":
        if reference_acc is None:
            reference_acc = ref["epochs"][-1]["test_acc"]
        if calibration == "this":
            calibration = calibrate_from(ref, mpiexec)
    # None where the reference has not learned: no target at chance (pilab.verdict, as in the study)
    target = judging.target_accuracy(reference_acc, {"target_fraction": target_fraction})
    base = _whole_run_time(cfg, target_baseline(calibration) or 1, calibration) if calibration else None
    rows = []
    for label, changes in cands:
        try:
            c = replace(sim_cfg, **changes)
            c.check_world(np_, len(ds.y_train))
        except ConfigError as e:
            rows.append({"label": label, "changes": changes, "skipped": str(e)})
            continue
        _point(callbacks, plan, label)
        res, kept = _candidate_run(c, np_, ds, out, slug(label), resume, reuse, known, callbacks)
        row = _candidate_row(label, changes, c, np_, res, calibration, target, base)
        row["kept"] = kept
        rows.append(row)
        for cb in callbacks:
            cb({"kind": "candidate", **row})
        if log:
            log(f"  {label:<34} test acc {row['final_test_acc']:.3f}" + (f"  ({kept})" if kept else ""))
    done = [r for r in rows if "skipped" not in r]
    have_time = any(r["epochs_time"] for r in done)
    have_energy = any(r.get("energy_j") is not None for r in done)
    flags = front(done, energy_key="energy_j" if have_energy else None) if have_time else [False] * len(done)
    for r, f in zip(done, flags):
        r["pareto"] = f
    best = sorted((r for r in done if r["pareto"]) if have_time else done,
                  key=lambda r: -(r["final_test_acc"] or 0))
    return {"kind": "pilab.remedies", "np": np_, "config": cfg.to_dict(),
            "calibration": calibration.to_dict() if hasattr(calibration, "to_dict") else calibration,
            "machine": (calibration if isinstance(calibration, str) else "this machine") if calibration else None,
            "reference_acc": reference_acc, "target_accuracy": target,
            "speed_baseline_np": target_baseline(calibration) or 1 if calibration else None,
            "speed_baseline_time": base, "candidates": rows, "best": best[:5]}


def _epoch_log(log, epochs: int):
    """A train callback that logs each finished epoch of the reference run."""
    def cb(ev):
        if ev.get("kind") == "epoch":
            acc = ev.get("test_acc")
            log(f"  reference np=1: epoch {ev.get('epoch')}/{epochs}"
                + (f"  test acc {acc:.3f}" if acc is not None else ""))
    return cb


def _on(cfg: Config, calibration) -> Config:
    # A preset machine places its own threads per rank; this machine's count says nothing there.
    return replace(cfg, threads=0) if isinstance(calibration, str) and calibration in perfmodel.PRESETS else cfg


def _whole_run_time(cfg: Config, np_: int, calibration) -> float:
    """Predicted seconds of the whole run (every epoch's training and evaluation) on ``calibration``."""
    pr = perfmodel.predict(_on(cfg, calibration), np_, calibration)
    return pr["epoch_time"] * cfg.epochs


def _candidate_run(c: Config, np_: int, ds, out, name: str, resume: bool, reuse, known=(),
                   callbacks=()) -> tuple[dict, str]:
    """The candidate's simulated run: kept from ``out`` (resume), taken from a study (reuse) or from
    ``known`` results, or run now and kept in ``out/<name>``; and where it came from ("" = run now)."""
    d = os.path.join(out, name) if out else None
    if resume and d:
        r = finished_run(os.path.join(d, "result.json"), np_, c, True)
        if r is not None:
            return r, "kept from the earlier search"
    r = reused_run(reuse, np_, c, True, os.path.join(d, "result.json") if d else None)
    if r is not None:
        return r, f"reused from {r['reused_from']}"
    r = known_run(known, c, np_)
    if r is not None:
        return r, f"the run of '{r['known_as']}'" if r.get("known_as") else "a run already made"
    res = simulate.run(replace(c, out=d or ""), np_, data=ds, callbacks=[step_events(callbacks)])
    return res, ""


def known_run(runs, c: Config, np_: int) -> dict | None:
    """The simulated, finished result among ``runs`` that is ``c``'s training at ``np_`` ranks
    (:func:`pilab.scaling.same_training`), or None: a search after the ablations re-runs none of them."""
    for r in runs:
        done = not r.get("stopped_early") and r.get("steps_done", r.get("total_steps")) == r.get("total_steps")
        if r.get("simulated") and r.get("np") == np_ and done and same_training(r["config"], c, np_):
            return r
    return None


def _point(callbacks, plan: list[str], label: str) -> None:
    """Tell the callbacks which run comes next (a progress bar names it and counts it)."""
    for cb in callbacks:
        cb({"kind": "point", "label": label, "index": plan.index(label), "of": len(plan)})


def _candidate_row(label, changes, c: Config, np_: int, res: dict, calibration, target: float,
                   base: float | None) -> dict:
    """One candidate's line: accuracy, and with a calibration its predicted time, speedup, energy."""
    epoch_time = pred = None
    if calibration is not None:
        pred = perfmodel.predict(_on(c, calibration), np_, calibration)
        epoch_time = pred["time"]
    times = [epoch_time] * len(res["epochs"]) if epoch_time else None
    last = res["epochs"][-1]
    whole = pred["epoch_time"] * len(res["epochs"]) if pred else None
    row = {"label": label, "changes": changes, "global_batch": res["global_batch"],
           "per_rank_batch": res["per_rank_batch"], "peak_lr": res["peak_lr"],
           "steps": res["total_steps"], "steps_per_epoch": res["steps_per_epoch"],
           "final_test_acc": last["test_acc"], "final_train_loss": last["train_loss"],
           "test_acc_curve": [e["test_acc"] for e in res["epochs"]],
           "epoch_time": epoch_time,
           "epochs_time": epoch_time * len(res["epochs"]) if epoch_time else None,
           "speedup": base / whole if (base and whole) else None,
           "comm_exposed_share": pred["comm_exposed"] / pred["time"] if pred else None,
           "time_to_target": time_to_target(res, target, times, [pred["eval_time"]] * len(times))
           if times else None,
           "reached_target": any((e["test_acc"] or 0) >= target for e in res["epochs"])
           if target is not None else None,
           "wall_time_here": res.get("wall_time")}
    if epoch_time and calibration in POWER_MODELS:  # energy: the third axis of the front
        row.update(run_energy(res, {"train": times, "eval": [pred["eval_time"]] * len(times),
                                    "comm_exposed_share": pred["comm_exposed"] / pred["time"]},
                              calibration, target))
    return row


def ablations(cfg: Config, np_: int, *, data=None, log=None, callbacks=(), causes=None) -> dict:
    """Separate the causes of the accuracy drop at ``np_`` ranks, one simulated run each.

    Starting from one process, each row adds one ingredient of a large-np run:
    the bigger global batch and fewer steps (np=1 with np× the batch), per-rank BatchNorm statistics
    (the same with ghost batches of the per-rank size), then the real np-rank run with static shards
    (shard composition), with reshuffled shards, and the LR rule with and without warmup::

        res = remedies.ablations(Config(width=0.25, epochs=3, train_subset=2000), np_=16)
        [(r["label"], r["final_test_acc"]) for r in res["rows"]]
        remedies.ablation_summary(res)      # what the rows say, in words

    ``causes``: run only the rows of these causes (the reference always runs), e.g. the step count
    and BatchNorm rows alone: ``causes=("global batch & steps", "per-rank BN batch")``; each row is
    compared with the one it differs from by its cause alone (``compared_with``, ``change``).
    ``res["runs"]`` holds each row's full result (``search(..., known=res["runs"])`` re-runs none of
    them); ``callbacks`` receive {"kind": "point", "label", "index", "of"} before each run, its
    {"kind": "step"} events and {"kind": "run", "label", "result"} after it (``widgets.Progress``).
    """
    ds = data if data is not None else load_data(cfg)
    b = cfg.per_rank_batch(np_)
    big = replace(cfg, batch_mode="per_rank", batch_size=b * np_, out="")
    warm = max(1.0, round(cfg.epochs / 5, 1))
    # (label, cause, settings, np, the row it differs from by exactly that cause)
    ref, one_big, ghost = "1 rank, batch b", f"1 rank, batch {b * np_} (global batch, step count)", \
        f"1 rank, batch {b * np_}, BN over groups of {b}"
    static, linear = f"{np_} ranks, static shards", f"{np_} ranks, linear lr"
    plan = [
        (ref, "reference", replace(cfg, out=""), 1, None),
        (one_big, "global batch & steps", big, 1, ref),
        (ghost, "per-rank BN batch", replace(big, ghost_batch=b), 1, one_big),
        (static, "shard composition", replace(cfg, out=""), np_, ghost),
        (f"{np_} ranks, reshuffled shards", "reshuffled shards",
         replace(cfg, sharding="reshuffle", out=""), np_, static),
        (linear, "LR rule", replace(cfg, lr_scaling="linear", out=""), np_, static),
        (f"{np_} ranks, linear lr + {warm:g} ep warmup", "LR rule & warmup",
         replace(cfg, lr_scaling="linear", warmup_epochs=warm, out=""), np_, linear),
    ]
    first_base = {x[0]: x[4] for x in plan}
    if causes is not None:
        unknown = set(causes) - {x[1] for x in plan}
        if unknown:
            raise ConfigError(f"unknown cause(s) {', '.join(sorted(unknown))}; the causes are: "
                              + "; ".join(dict.fromkeys(x[1] for x in plan[1:])))
        plan = [x for x in plan if x[1] == "reference" or x[1] in causes]
    rows, runs = [], []
    labels = [x[0] for x in plan]
    for label, cause, c, p, base in plan:
        while base is not None and base not in labels:  # its own base row was left out: the one before it
            base = first_base.get(base) or ref
        _point(callbacks, labels, label)
        res = simulate.run(c, p, data=ds, callbacks=[step_events(callbacks)])
        res = {**res, "known_as": label}
        runs.append(res)
        for cb in callbacks:
            cb({"kind": "run", "label": label, "result": res})
        last = res["epochs"][-1]
        before = next((r for r in rows if r["label"] == base), None)
        rows.append({"label": label, "cause": cause, "np": p, "global_batch": res["global_batch"],
                     "per_rank_batch": res["per_rank_batch"], "steps": res["total_steps"],
                     "peak_lr": res["peak_lr"], "final_test_acc": last["test_acc"],
                     "final_train_loss": last["train_loss"],
                     "test_acc_curve": [e["test_acc"] for e in res["epochs"]],
                     # what this one cause does: the accuracy against the row it differs from by it alone
                     "compared_with": base, "ghost_batch": c.ghost_batch,
                     "change": last["test_acc"] - before["final_test_acc"] if before else None})
        if log:
            log(f"  {label:<52} test acc {last['test_acc']:.3f}")
    return {"kind": "pilab.ablations", "np": np_, "config": cfg.to_dict(), "rows": rows, "runs": runs}


NOISE = 0.04  # accuracy differences smaller than this (4 points) are not read as an effect: one seed of a
# short run on a few hundred test images moves by about that much (binomial s.d. ~2 points at 500 images)


def ablation_table(res: dict) -> str:
    """The ablation rows as fixed-width text (the CLI), and in a notebook as an HTML table with each
    row's change against the row it differs from by its one cause, and what the rows say under it
    (:func:`ablation_summary`)."""
    lines = [f"{'run':<54}{'cause':<22}{'glob.batch':>10}{'steps':>7}{'peak lr':>9}{'test acc':>9}"]
    for r in res["rows"]:
        lines.append(f"{r['label']:<54}{r['cause']:<22}{r['global_batch']:>10}{r['steps']:>7}"
                     f"{r['peak_lr']:>9.3g}{r['final_test_acc']:>9.3f}")
    head = ("run", "cause", "global batch", "steps", "peak lr", "test acc", "change", "against")
    cells = [(r["label"], r["cause"], r["global_batch"], r["steps"], f"{r['peak_lr']:.3g}",
              f"{r['final_test_acc']:.3f}",
              f"{100 * r['change']:+.1f} points" if r.get("change") is not None else "–",
              r.get("compared_with") or "–") for r in res["rows"]]
    return plots.Table("\n".join(lines), head, cells, caption=ablation_summary(res), kind="ablations")


def _points(d: float) -> str:
    return f"{abs(100 * d):.0f} point{'s' if round(abs(100 * d)) != 1 else ''}"


def ablation_summary(res: dict) -> str:
    """What the ablation rows say, from their numbers: how much each cause costs at this np, which one
    matters most, and whether the LR rule wins it back (``NOISE``: smaller changes are not effects)."""
    rows = res["rows"]
    by_cause = {}
    for r in rows:
        by_cause.setdefault(r["cause"], r)  # the first row of a cause (static shards before reshuffled)
    ref = rows[0]
    if not judging.learned(ref["final_test_acc"]):
        return (f"The reference ({ref['label']}, {ref['steps']} steps) ends at {ref['final_test_acc']:.1%}: "
                "it has not learned, so the rows cannot tell one cause from another; train it longer first.")
    parts = [f"The reference, one process with batch {ref['global_batch']}, takes {ref['steps']} steps to "
             f"{ref['final_test_acc']:.1%}."]
    effects = {}

    def effect(r, what):
        d = r.get("change")
        if d is None:
            return ""
        effects[what] = d
        if abs(d) < NOISE:
            return f"within {_points(NOISE)} of {r['compared_with']}: no clear effect at this size"
        return (f"{_points(d)} {'lost' if d < 0 else 'gained'} against {r['compared_with']}")

    big = by_cause.get("global batch & steps")
    if big:
        parts.append(f"Step count: the same single process with the {res['np']}-rank global batch "
                     f"{big['global_batch']} takes {big['steps']} steps (same lr) and ends at "
                     f"{big['final_test_acc']:.1%}, {effect(big, 'the step count')}.")
    bn = by_cause.get("per-rank BN batch")
    if bn:
        parts.append(f"Batch statistics: BatchNorm over groups of {bn['ghost_batch']} images, as each rank "
                     f"sees them, ends at {bn['final_test_acc']:.1%}, {effect(bn, 'the batch statistics')}.")
    st = by_cause.get("shard composition")
    if st:
        parts.append(f"Shards: {st['label']} end at {st['final_test_acc']:.1%}, {effect(st, 'the shards')}.")
    lr = by_cause.get("LR rule")
    if lr:
        lost = ref["final_test_acc"] - (st or lr)["final_test_acc"]
        d = lr.get("change") or 0.0
        back = (f"winning back {_points(d)} of the {_points(lost)} lost" if d >= NOISE and lost > NOISE else
                "which does not win the accuracy back here" if d < NOISE else "")
        parts.append(f"LR rule: scaling the lr with the global batch (peak lr {lr['peak_lr']:.3g}) gives "
                     f"{lr['final_test_acc']:.1%}" + (f", {back}" if back else "") + ".")
    lost = {k: -v for k, v in effects.items() if v <= -NOISE}
    if lost:
        main = max(lost, key=lost.get)
        also = [k for k in lost if k != main]
        minor = [k for k in effects if k not in lost]
        parts.append(f"At np={res['np']} the accuracy is lost mainly to {main} ({_points(lost[main])})"
                     + (f"; {' and '.join(also)} also cost{'s' if len(also) == 1 else ''} some" if also else "")
                     + (f"; {' and '.join(minor)} {'does' if len(minor) == 1 else 'do'} not matter at this size"
                        if minor else "") + ".")
    else:
        parts.append(f"No cause costs more than {_points(NOISE)} at np={res['np']} at this size.")
    return " ".join(parts)


def table(res: dict) -> str:
    w = max([36] + [len(r["label"]) + 2 for r in res["candidates"]])  # the label column
    base = f", speedup vs np={res['speed_baseline_np']} of the baseline" if res.get("speed_baseline_np") else ""
    lines = [f"np={res['np']}  reference accuracy {res['reference_acc']:.3f}  " + _target_text(res)
             + (f"  times predicted for {res['machine']}{base}" if res.get("machine")
                else "  (no times: no target)"),
             f"{'candidate':<{w}}{'glob.batch':>10}{'peak lr':>9}{'steps':>7}{'test acc':>9}"
             f"{'time s':>9}{'speedup':>8}{'→target':>13}{'energy kJ':>10}  pareto"]
    for r in res["candidates"]:
        if "skipped" in r:
            lines.append(f"{r['label']:<{w}}skipped: {r['skipped']}")
            continue
        t = f"{r['epochs_time']:.0f}" if r["epochs_time"] else "–"
        sp = f"{r['speedup']:.1f}" if r.get("speedup") else "–"
        ttt = f"{r['time_to_target']:.0f}s" if r["time_to_target"] else (
            "no target" if r["reached_target"] is None else "not reached" if not r["reached_target"] else "–")
        kj = f"{r['energy_j'] / 1e3:.2f}" if r.get("energy_j") is not None else "–"
        lines.append(f"{r['label']:<{w}}{r['global_batch']:>10}{r['peak_lr']:>9.3g}{r['steps']:>7}"
                     f"{r['final_test_acc']:>9.3f}{t:>9}{sp:>8}{ttt:>13}{kj:>10}  {'*' if r.get('pareto') else ''}")
    # in a notebook: the same rows as an HTML table, where each run came from, what they say under it
    where = res.get("machine") or "–"
    head = ("candidate", "global batch", "peak lr", "steps", "test acc", f"time s ({where})", "speedup",
            "time to target", "energy kJ", "fast and right", "run")
    cells = []
    for r in res["candidates"]:
        if "skipped" in r:
            cells.append((r["label"], *(["–"] * 9), "skipped: " + r["skipped"]))
            continue
        ttt = f"{r['time_to_target']:.0f} s" if r["time_to_target"] else (
            "no target" if r["reached_target"] is None else "not reached" if not r["reached_target"] else "–")
        cells.append((r["label"], r["global_batch"], f"{r['peak_lr']:.3g}", r["steps"], f"{r['final_test_acc']:.3f}",
                      f"{r['epochs_time']:.0f}" if r["epochs_time"] else "–",
                      f"{r['speedup']:.1f}" if r.get("speedup") else "–", ttt,
                      f"{r['energy_j'] / 1e3:.2f}" if r.get("energy_j") is not None else "–",
                      "on the front" if r.get("pareto") else "", r.get("kept") or "run now"))
    return plots.Table("\n".join(lines), head, cells, caption=search_summary(res), kind="remedies")


def search_summary(res: dict) -> str:
    """What the search says, from its numbers: the target, who reaches it, how fast on the machine, and
    which fast runs miss it."""
    done = [r for r in res["candidates"] if "skipped" not in r]
    if not done:
        return "No candidate ran."
    t = res.get("target_accuracy")
    if t is None:
        return (f"The reference ends at {res['reference_acc']:.1%}: it has not learned, so there is no target "
                "accuracy and no candidate is called fast and right or wrong; train the reference longer first.")
    where = f" predicted for {res['machine']}" if res.get("machine") else ""
    parts = [f"Target {t:.1%} ({t / res['reference_acc']:.0%} of the reference's {res['reference_acc']:.1%})."]
    hit = [r for r in done if r.get("reached_target")]
    miss = [r for r in done if not r.get("reached_target")]
    if hit:
        best = sorted(hit, key=lambda r: -(r.get("speedup") or 0))
        names = "; ".join(f"{r['label']} ({r['final_test_acc']:.1%}"
                          + (f", speedup {r['speedup']:.1f}" if r.get("speedup") else "") + ")" for r in best)
        parts.append(f"At np={res['np']} it is reached by {names}{where}.")
    else:
        parts.append(f"No candidate reaches it at np={res['np']}: at this size none of these settings is both "
                     "fast and right.")
    if miss:
        fast = max(miss, key=lambda r: r.get("speedup") or 0)
        parts.append(f"{', '.join(r['label'] for r in miss)} miss{'es' if len(miss) == 1 else ''} it"
                     + (f": {fast['label']} would be {fast['speedup']:.1f}x faster{where} and wrong"
                        if fast.get("speedup") else "") + ".")
    front = [r["label"] for r in done if r.get("pareto")]
    if front:
        parts.append(f"On the fast-and-right front (no other run that reaches the target is faster and more "
                     f"accurate): {', '.join(front)}.")
    return " ".join(parts)


def interpretation(ablations_: dict, search_: dict | None = None) -> str:
    """What the ablations and the search showed together, for the end of a notebook::

        remedies.interpretation(ablations, search)     # the last line of a cell: a paragraph
    """
    parts = [ablation_summary(ablations_)]
    if search_:
        parts.append(search_summary(search_))
        taken = [r["label"] for r in search_["candidates"] if str(r.get("kept", "")).startswith("the run of")]
        if taken:
            parts.append(f"{len(taken)} of the search's {len(search_['candidates'])} candidates are runs the "
                         "ablations had made (" + ", ".join(taken) + "): taken from them, not run again.")
    cfg = ablations_.get("config") or {}
    if cfg:
        parts.append(f"All of it at {cfg['train_subset'] or 'all'} training images and {cfg['epochs']} "
                     f"epoch{'s' if cfg['epochs'] != 1 else ''} "
                     f"(np={ablations_['np']}): the committed search below is the full-size answer.")
    return plots.Paragraph("\n\n".join(parts))


def _target_text(res: dict) -> str:
    t = res.get("target_accuracy")
    return f"target {t:.3f}" if t is not None else "no target (the reference has not learned)"


def write_report(res: dict, out: str) -> dict:
    """report.html (self-contained: the table, the front, the command) and report.png where a browser
    is available, beside remedies.json; returns their paths."""
    from html import escape

    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.models import Div
    from bokeh.resources import INLINE

    from . import plots
    from .files import atomic_write_text
    from .scaling import export_png
    head = (f"<h2>pilab remedies at np={res['np']}</h2>"
            f"<p><b>command:</b> <code>{escape(res.get('command') or 'python API')}</code></p>"
            f"<p>Reference accuracy {res['reference_acc']:.3f}; {_target_text(res)}. "
            + (f"Times, speedup and energy predicted for <b>{escape(str(res['machine']))}</b>; speedup is "
               f"the whole run's against the un-remedied settings at np={res['speed_baseline_np']}. "
               if res.get("machine") else "No times (no target machine). ")
            + "Red: on the fast-and-right front (it reaches the target accuracy, and no other candidate that "
            "does is faster and more accurate"
            + (" and cheaper in energy" if any(r.get("energy_j") for r in res["candidates"]) else "")
            + f").</p><pre>{escape(table(res))}</pre>")
    html_path = os.path.join(out, "report.html")
    atomic_write_text(html_path, file_html(column(Div(text=head, width=1000), plots.remedies_figure(res)),
                                           INLINE, "pilab remedies"))
    paths = {"html": html_path}
    png = export_png(html_path, os.path.join(out, "report.png"))
    if png:
        paths["png"] = png
    return paths
