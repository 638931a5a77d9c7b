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

from . import perfmodel, simulate
from . import verdict as judging
from .config import Config, ConfigError, small_mode
from .engine import load_data
from .scaling import (POWER_MODELS, calibrate_from, finished_run, reused_run, run_energy,
                      target_baseline, time_to_target)


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
    return [(label, ch) for label, ch in out if ch is not None]


def candidate_labels(cfg: Config, np_: int) -> list[str]:
    """The labels ``only=`` (``--only``) accepts at these settings and ``np_``, in search order."""
    return [label for label, _ in candidates(cfg, np_)]


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


def slug(label: str) -> str:
    """The directory a candidate's run is kept in: ``"sqrt lr + warmup"`` -> ``"sqrt-lr-warmup"``."""
    return re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-")


def search(cfg: Config, np_: int, *, only: list[str] | None = None, calibration=None,
           target_fraction: float = 0.9, reference_acc: float | None = None, data=None,
           callbacks=(), log=None, mpiexec: str | None = None, out: str | None = None,
           resume: bool = False, reuse=()) -> dict:
    """Simulate every candidate at ``np_`` ranks; rank them by accuracy and by predicted time.

    ``reference_acc`` (e.g. the np=1 run's final test accuracy) sets the target accuracy; without it
    the baseline candidate simulated at np=1 is run first to get it. ``calibration`` is what the
    performance model predicts times for: a Calibration, a preset name (``"pi4b_cluster"``), a JSON
    path, ``"this"`` (this machine, calibrated from the np=1 reference run and a short
    micro-benchmark under ``mpiexec``) or None (no times, no Pareto front). With times, each row's
    ``speedup`` is the whole run's (training and evaluations) against the un-remedied ``cfg`` on the
    machine's speed baseline (one Pi node = 2 ranks; else 1 rank): more epochs cost speedup.
    ``out``/``resume``/``reuse``: see the module docstring.
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
    if reference_acc is None or calibration == "this":
        if log:  # minutes on a laptop: say what runs, then one line per epoch
            log(f"  reference: the baseline at np=1, {cfg.epochs} epoch(s), sets the target accuracy")
        ref = simulate.run(sim_cfg, 1, data=ds, callbacks=[_epoch_log(log, cfg.epochs)] if log else ())
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
        res, kept = _candidate_run(c, np_, ds, out, slug(label), resume, reuse)
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
    flags = pareto(done, energy_key="energy_j" if have_energy else None) if have_time else [False] * len(done)
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


def _candidate_run(c: Config, np_: int, ds, out, name: str, resume: bool, reuse) -> tuple[dict, str]:
    """The candidate's simulated run: kept from ``out`` (resume), taken from a study (reuse), or run
    now and kept in ``out/<name>``; and where it came from ("" = run now)."""
    d = os.path.join(out, name) if out else None
    if resume and d:
        r = finished_run(os.path.join(d, "result.json"), np_, c, True)
        if r is not None:
            return r, "kept from the earlier search"
    r = reused_run(reuse, np_, c, True, os.path.join(d, "result.json") if d else None)
    if r is not None:
        return r, f"reused from {r['reused_from']}"
    res = simulate.run(replace(c, out=d or ""), np_, data=ds)
    return res, ""


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
    return "\n".join(lines)


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
            + "Red: on the Pareto front (no other candidate is faster and more accurate"
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
