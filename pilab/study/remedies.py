"""Remedies: which settings keep accuracy at large np, and what they cost in time.

With the simulator (exact np-rank emulation in one process) each candidate's accuracy at np ranks is
measured on real data; the performance model gives its time per epoch and time to target. Candidates
are the baseline, one change at a time (so each cause shows on its own), and the published recipes
combined (Goyal et al.'s linear scaling + warmup; LARS + warmup; a fixed global batch)::

    from pilab.config import Config
    from pilab.study import remedies, tables
    res = remedies.search(Config(width=0.25, epochs=4, train_subset=2000), np_=48)
    res["candidates"]   # label, changes, final_test_acc, epoch_time, time_to_target, pareto
    res["best"]         # the Pareto front (time vs accuracy), most accurate first
    tables.remedies_table(res)   # what the CLI prints; report.write_remedies(res, out) the report

    python -m pilab remedies --np 48 --out runs/remedies

Each candidate's run is kept as ``out/<label>/result.json`` the moment it finishes; ``resume=True`` keeps
those finished runs (same training) and runs only the others, so a long search can be stopped and resumed and its
candidates can run as separate processes (``only=[...]``) and be put together by one last search with
``resume``. ``reuse`` takes a candidate's run from a scaling study where it is the same training (the
baseline at np=48 is the naive rule's np=48 point).
"""
from __future__ import annotations

import os
import re
from dataclasses import replace

from .. import engine, perfmodel, verdict as judging
from ..config import Config, ConfigError, small_mode
from ..engine import checkpoint, load_data
from .analysis import POWER_MODELS, calibrate_from, run_energy, target_baseline, time_to_target
from .points import finished_run, reused_run, same_training, step_events, trained_config
from .toolbox import fast_and_right, fixed_per_rank


def _fixed_global(cfg: Config, np_: int) -> dict:
    """The changes of "fixed global batch": one rank's batch split over the np."""
    return {"batch_mode": "global", "batch_size": fixed_per_rank(cfg, np_) * np_}


def default_candidates(cfg: Config, np_: int) -> list[tuple[str, dict]]:
    """(label, changes) pairs: the baseline, single-factor changes, then the published recipes combined
    (what ``pilab remedies`` offers without ``--candidates``). A study's own list is a function of the
    same shape, e.g. experiments/fast-but-wrong/remedies/candidates.py, given to :func:`search`
    (``candidates=``) or to the CLI (``--candidates FILE``)."""
    warm = max(1.0, round(cfg.epochs / 5, 1))
    per = fixed_per_rank(cfg, np_)
    fixed_global = _fixed_global(cfg, np_)
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


def toolbox_candidates(cfg: Config, np_: int) -> list[tuple[str, dict]]:
    """(label, changes) pairs: :func:`default_candidates`, then the large-batch toolbox's
    (:func:`pilab.study.toolbox.fast_and_right`; ``--candidates toolbox``)."""
    return default_candidates(cfg, np_) + [(label, ch) for label, ch in fast_and_right(cfg, np_) if ch is not None]


def candidate_labels(cfg: Config, np_: int, candidates=None) -> list[str]:
    """The labels ``only=`` (``--only``) accepts at these settings and ``np_``, in search order, of
    ``candidates`` (a function like :func:`default_candidates`; None: that one)."""
    return [label for label, _ in (candidates or default_candidates)(cfg, np_)]


# The candidate lists pilab has, by the name ``--candidates`` takes.
CANDIDATE_SETS = ("default", "toolbox")


def load_candidates(path: str):
    """A ``candidates(cfg, np_)`` function for :func:`search` or ``pilab remedies --candidates``: pilab's
    own by name (``"default"``: :func:`default_candidates`; ``"toolbox"``: :func:`toolbox_candidates`), or the one the Python file ``path`` defines (a
    study's own list, kept beside its results); ConfigError where the file is missing or defines none::

        cands = remedies.load_candidates("toolbox")
        remedies.search(cfg, 48, candidates=cands, only=["local SGD H=8"])
    """
    import importlib.util
    import sys
    if path == "default":
        return default_candidates
    if path == "toolbox":
        return toolbox_candidates
    if not os.path.isfile(path):
        raise ConfigError(f"--candidates {path}: no such file; give {' or '.join(CANDIDATE_SETS)} (pilab's lists) "
                          "or a Python file that defines candidates(cfg, np_)")
    name = "pilab_candidates_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    fn = getattr(module, "candidates", None)
    if not callable(fn):
        raise ConfigError(f"--candidates {path} defines no candidates(cfg, np_) function")
    return fn


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


def notebook_candidates(cfg: Config | None = None, np_: int | None = None) -> list[str] | None:
    """All candidates on a laptop; in small mode (PILAB_NB_SMALL) the baseline, which the ablations ran
    already (``search(..., known=...)`` takes it), and the linear LR rule, the published remedy; given the
    settings and np, also the fixed global batch (one rank's batch split over the np: as many steps as
    np=1), the remedy that keeps a small run right when the lr rules cannot (notebook 06: 28 steps of 256
    images are too few for any lr)::

        remedies.search(cfg, 8, only=remedies.notebook_candidates(cfg, 8))
    """
    if not small_mode():
        return None
    # the label as default_candidates writes it (one place), found by the change it makes
    fixed = [label for label, ch in default_candidates(cfg, np_) if ch == _fixed_global(cfg, np_)] \
        if cfg is not None and np_ else []
    return ["baseline", "linear lr", *fixed]


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


def search(cfg: Config, np_: int, *, candidates=None, only: list[str] | None = None, recipes_of: int | None = None,
           calibration=None,
           target_fraction: float = 0.9, reference_acc: float | None = None, data=None,
           callbacks=(), log=None, mpiexec: str | None = None, out: str | None = None,
           resume: bool = False, reuse=(), known=()) -> dict:
    """Simulate every candidate at ``np_`` ranks; rank them by accuracy and by predicted time.

    ``candidates``: a function ``(cfg, np_) -> [(label, changes)]`` (default :func:`default_candidates`;
    a study's own list: :func:`load_candidates`).

    ``reference_acc`` (e.g. the np=1 run's final test accuracy) sets the target accuracy; without it
    the baseline candidate simulated at np=1 is run first to get it. ``calibration`` is what the
    performance model predicts times for: a Calibration, a preset name (``"pi4b_cluster"``), a JSON
    path, ``"this"`` (this machine, calibrated from the np=1 reference run and a short
    micro-benchmark under ``mpiexec``) or None (no times, no Pareto front). With times, each row's
    ``speedup`` is the whole run's (training and evaluations) against the un-remedied ``cfg`` on the
    machine's speed baseline (one Pi node = 2 ranks; else 1 rank): more epochs cost speedup.
    ``out``/``resume``/``reuse``: see the module docstring. ``known``: results already at hand (e.g.
    :func:`pilab.study.ablation.ablations`' ``runs``); a candidate that is one of them, and the np=1
    reference, are taken from them instead of being simulated again::

        abl = ablation.ablations(cfg, 4)
        res = remedies.search(cfg, 4, only=["baseline", "linear lr"], known=abl["runs"])   # nothing re-run

    ``recipes_of``: run the candidates as they are defined at that np (their global batch, their labels)
    at ``np_`` instead -- np=48's recipes on one process, the "same recipe at np=1" a recipe's np=48
    accuracy is compared with::

        remedies.search(cfg, 1, recipes_of=48, only=["fixed global batch 192 + sqrt lr + warmup"])

    ``callbacks`` also receive {"kind": "point", "label", "index", "of"} before each run and its
    {"kind": "step"} events (``widgets.Progress`` shows them).
    """
    defined_at = recipes_of or np_  # the np whose recipes (global batch, labels) are run at np_
    cands = chosen((candidates or default_candidates)(cfg, defined_at), only, defined_at)
    ds = data if data is not None else load_data(cfg)  # after the checks: a bad label costs no loading
    sim_cfg = replace(cfg, out="", threads=cfg.threads)
    known = list(known)
    ref, reference_acc, calibration, plan = _reference(cfg, sim_cfg, ds, known, cands, reference_acc,
                                                       calibration, callbacks, log, mpiexec)
    # None where the reference has not learned: no target at chance (pilab.verdict, as in the study)
    target = judging.target_accuracy(reference_acc, {"target_fraction": target_fraction})
    base = _whole_run_time(cfg, target_baseline(calibration) or 1, calibration) if calibration else None
    rows = [_candidate(label, changes, sim_cfg, np_, ds, plan, calibration, target, base, out=out, resume=resume,
                       reuse=reuse, known=known, callbacks=callbacks, log=log) for label, changes in cands]
    return {"kind": "pilab.remedies", "np": np_, "recipes_of": recipes_of, "config": cfg.to_dict(),
            "calibration": calibration.to_dict() if hasattr(calibration, "to_dict") else calibration,
            "machine": (calibration if isinstance(calibration, str) else "this machine") if calibration else None,
            "reference_acc": reference_acc, "target_accuracy": target,
            "speed_baseline_np": target_baseline(calibration) or 1 if calibration else None,
            "speed_baseline_time": base, "candidates": rows, "best": _ranked(rows)[:5]}


def _candidate(label: str, changes: dict, sim_cfg: Config, np_: int, ds, plan: list, calibration, target,
               base, *, out, resume: bool, reuse, known: list, callbacks, log) -> dict:
    """One candidate's row: run (or kept, reused, known), priced and told to the callbacks; a candidate
    these settings cannot run at ``np_`` is a row with ``skipped``, its reason."""
    try:
        c = replace(sim_cfg, **changes)
        c.check_world(np_, len(ds.y_train))
    except ConfigError as e:
        return {"label": label, "changes": changes, "skipped": str(e)}
    announce_point(callbacks, plan, label)
    res, kept = _candidate_run(c, np_, ds, out, slug(label), resume, reuse, known, callbacks)
    row = _candidate_row(label, changes, c, np_, res, calibration, target, base)
    row["kept"] = kept
    for cb in callbacks:
        cb({"kind": "candidate", **row})
    if log:
        log(f"  {label:<34} test acc {row['final_test_acc']:.3f}" + (f"  ({kept})" if kept else ""))
    return row


def chosen(cands: list, only, np_: int) -> list:
    """The candidates named in ``only`` by label (``"sqrt lr + warmup"``) or by the folder their run is
    kept in (:func:`slug`: ``sqrt-lr-warmup``), all without it; ConfigError naming the ones that are not."""
    if only:
        names = {name: c[0] for c in cands for name in (c[0], slug(c[0]))}
        unknown = [o for o in only if o not in names]
        if unknown:
            raise ConfigError(f"{', '.join(map(repr, unknown))} {'is not a candidate' if len(unknown) == 1 else 'are not candidates'}"
                              f" at np={np_}; the candidates (label, or its folder name) are: "
                              f"{'; '.join(f'{c[0]} ({slug(c[0])})' for c in cands)}")
        wanted = {names[o] for o in only}
        cands = [c for c in cands if c[0] in wanted]
    return cands


def _reference(cfg: Config, sim_cfg: Config, ds, known: list, cands: list, reference_acc, calibration,
               callbacks, log, mpiexec):
    """(the np=1 reference run or None, its accuracy, the calibration, the plan of runs): the reference is
    taken from ``known`` or simulated where the target accuracy or this machine's calibration needs it."""
    ref = known_run(known, sim_cfg, 1)
    if reference_acc is None and ref is not None:
        reference_acc = ref["epochs"][-1]["test_acc"]
    plan = (["reference np=1"] if reference_acc is None or (calibration == "this" and ref is None) else []) \
        + [label for label, _ in cands]
    if reference_acc is None or (calibration == "this" and ref is None):
        if log:  # minutes on a laptop: say what runs, then one line per epoch
            log(f"  reference: the baseline at np=1, {cfg.epochs} epoch(s), sets the target accuracy")
        announce_point(callbacks, plan, "reference np=1")
        ref = engine.simulate(sim_cfg, 1, data=ds, callbacks=([_epoch_log(log, cfg.epochs)] if log else [])
                           + [step_events(callbacks)])
    if reference_acc is None or calibration == "this":
        if reference_acc is None:
            reference_acc = ref["epochs"][-1]["test_acc"]
        if calibration == "this":
            calibration = calibrate_from(ref, mpiexec)
    return ref, reference_acc, calibration, plan


def _ranked(rows: list[dict]) -> list[dict]:
    """Marks each candidate that ran ``pareto`` (on the fast-and-right front, where there are times) and
    returns the front (every run without times), most accurate first."""
    done = [r for r in rows if "skipped" not in r]
    have_time = any(r["epochs_time"] for r in done)
    have_energy = any(r.get("energy_j") is not None for r in done)
    flags = front(done, energy_key="energy_j" if have_energy else None) if have_time else [False] * len(done)
    for r, f in zip(done, flags):
        r["pareto"] = f
    return sorted((r for r in done if r["pareto"]) if have_time else done,
                  key=lambda r: -(r["final_test_acc"] or 0))


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
    return replace(cfg, threads=0) if perfmodel.is_pi_cluster(calibration) else cfg


def _whole_run_time(cfg: Config, np_: int, calibration) -> float:
    """Predicted seconds of the whole run (every epoch's training and evaluation) on ``calibration``."""
    pr = perfmodel.predict(_on(cfg, calibration), np_, calibration)
    return pr["epoch_time"] * cfg.epochs


def _candidate_run(c: Config, np_: int, ds, out, name: str, resume: bool, reuse, known=(),
                   callbacks=()) -> tuple[dict, str]:
    """The candidate's simulated run: kept from ``out`` (resume), taken from a study (reuse) or from
    ``known`` results, or run now and kept in ``out/<name>``; and where it came from ("" = run now)."""
    d = os.path.join(out, name) if out else None
    part = ""  # a checkpoint of this candidate's run that an earlier search left part-way
    if resume and d:
        r = finished_run(os.path.join(d, "result.json"), np_, c, True)
        if r is not None:
            return r, "kept from the earlier search"
        part = resumable_checkpoint(d, c, np_)
    r = reused_run(reuse, np_, c, True, os.path.join(d, "result.json") if d else None)
    if r is not None:
        return r, f"reused from {r['reused_from']}"
    r = known_run(known, c, np_)
    if r is not None:
        return r, f"the run of '{r['known_as']}'" if r.get("known_as") else "a run already made"
    res = engine.simulate(replace(c, out=d or "", resume=part), np_, data=ds, callbacks=[step_events(callbacks)])
    return res, f"continued from {os.path.basename(part)}" if part else ""


def resumable_checkpoint(d: str, c: Config, np_: int) -> str:
    """The newest checkpoint in ``d`` that ``c``'s run at ``np_`` can go on from, or "" (none, or another
    run's): a search interrupted part-way through a candidate (a session that ended, Ctrl-C) continues it
    with ``resume`` when its runs checkpoint (``--checkpoint-every``, ``--checkpoint-minutes``)."""
    path = checkpoint.latest(d)
    if not path:
        return ""
    try:
        checkpoint.verify(checkpoint.read(path), c, np_, path)
    except checkpoint.ReadError:
        raise  # unreadable now, not damaged: starting over there would replace it
    except ConfigError:
        return ""
    return path


def known_run(runs, c: Config, np_: int) -> dict | None:
    """The simulated, finished result among ``runs`` that is ``c``'s training at ``np_`` ranks
    (:func:`pilab.study.points.same_training`), or None: a search after the ablations re-runs none of them."""
    for r in runs:
        done = not r.get("stopped_early") and r.get("steps_done", r.get("total_steps")) == r.get("total_steps")
        if r.get("simulated") and r.get("np") == np_ and done and same_training(r["config"], c, np_):
            return r
    return None


def announce_point(callbacks, plan: list[str], label: str) -> None:
    """Tell the callbacks which run comes next (a progress bar names it and counts it)."""
    for cb in callbacks:
        cb({"kind": "point", "label": label, "index": plan.index(label), "of": len(plan)})


def _candidate_row(label, changes, c: Config, np_: int, res: dict, calibration, target: float,
                   base: float | None) -> dict:
    """One candidate's line: accuracy, and with a calibration its predicted time, speedup, energy."""
    epoch_time = pred = None
    if calibration is not None:  # a noise-driven ramp priced at the batches it chose
        pred = perfmodel.predict(_on(trained_config(res) if c.gns_max else c, calibration), np_, calibration)
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


def target_text(res: dict) -> str:
    t = res.get("target_accuracy")
    return f"target {t:.3f}" if t is not None else "no target (the reference has not learned)"
