"""The strong-scaling study: the same training at several process counts, and where it turns
fast-but-wrong.

Measured points are real MPI jobs (``mpiexec -n np python -m pilab train ...``, threads per rank held
constant); simulated points run the virtual-rank simulator for accuracy, with times from the
performance model. The rows and their verdict are :mod:`pilab.study.analysis`'s, the files
:mod:`pilab.study.report`'s, what a notebook shows :mod:`pilab.study.tables`'s::

    from pilab.config import Config
    from pilab.study import scaling, tables
    study = scaling.study(Config(width=0.25, epochs=4, train_subset=2000), nps=(1, 2),
                      simulate_nps=(8, 48), out="runs/demo")
    study["rows"]          # one dict per np; study["runs"][np] is that run's full result
    tables.table(study)    # what the CLI prints; in a notebook an HTML table

    python -m pilab scale --out runs/demo                 # the README's demo
    python -m pilab scale --preset pi --hostfile hosts    # 2..48 ranks on a Pi cluster, baseline 2
"""
from __future__ import annotations

import copy
import glob
import os
import re
import tempfile
import time
from dataclasses import asdict, replace

from .. import engine, resultfile, verdict as judging
from ..config import DEMO, Config, ConfigError, small_mode
from ..launch import run_job
from . import energy, report
from .analysis import (Criteria, baseline_time_per_image, calibrate_from, jsonable, predict_points, predict_target,
                       rows_from_runs, sized_for_model, target_baseline, target_name)
from .points import (clear_point, finished_point, finished_run, read_json, resolved, reused_run, same_training,
                     step_events, temp_dir)


def notebook_config(**overrides) -> Config:
    """The notebooks' study settings: the demo's, or under CI / Binder (PILAB_NB_SMALL) a
    run whose np=1 baseline still learns (34% test accuracy, ~25 s on one idle core), so the small study
    shows speedup and the collapse, not a baseline at chance::

        study = scaling.study(scaling.notebook_config(), **scaling.notebook_sweep(), out="runs/nb02")
    """
    # The small run is the demo's training on 500 test images, not a smaller one: MobileNetV2 (width 0.25)
    # needs about 250 steps of 32 images to leave chance clearly behind (0.338 after 4 epochs of 2,000
    # images; 3 epochs: 0.280; 1,000 images at batch 16, 248 steps: 0.204 -- measured here).
    # One thread in small mode: it is made for one core (Binder), and its CPU time is its budget.
    base = replace(DEMO, test_subset=500, threads=1) if small_mode() else DEMO
    return replace(base, **overrides)


def notebook_sweep(simulate_nps=(8, 48), small_simulate_nps=(8,)) -> dict:
    """Process counts for the notebooks: the demo's, or in small mode (PILAB_NB_SMALL: CI, Binder) one
    simulated np, where the small run turns fast-but-wrong (np=8: 31 steps of 256 images); on a cluster's
    head node (``PILAB_HOSTFILE``, the Pi profile's hostfile) every np the hostfile's slots hold is a real
    job on its hosts (:func:`on_cluster`)::

        study = scaling.study(cfg, **scaling.notebook_sweep(), out="runs/nb")
    """
    return on_cluster({"nps": (1, 2), "simulate_nps": small_simulate_nps if small_mode() else simulate_nps})


def on_cluster(sweep: dict, env=None) -> dict:
    """``sweep`` as it runs where ``PILAB_HOSTFILE`` names a hostfile (a notebook on a cluster's head node,
    the Pi profile's ``profiles/profile_pi/hosts``): the simulated counts the hostfile's slots hold become
    real jobs there (``hostfile=``), the others stay simulated; unchanged without it::

        on_cluster({"nps": (1, 2), "simulate_nps": (8, 48)}, {"PILAB_HOSTFILE": "hosts"})   # 48 slots:
        # {"nps": (1, 2, 8, 48), "simulate_nps": (), "hostfile": "hosts"}
    """
    from ..launch import read_hostfile, total_slots
    path = (os.environ if env is None else env).get("PILAB_HOSTFILE")
    if not path:
        return sweep
    if not os.path.isfile(path):
        raise ConfigError(f"PILAB_HOSTFILE={path}: no such file; give the cluster's hostfile "
                          "(profiles/profile_pi/hosts, host:slots lines) or unset it to run here")
    slots = total_slots(read_hostfile(path))
    every = sorted(set(sweep["nps"]) | set(sweep["simulate_nps"]))
    return {"nps": tuple(p for p in every if p <= slots), "simulate_nps": tuple(p for p in every if p > slots),
            "hostfile": path}


# Each model's learning rate for the three-model protocol (experiments/three-models/run.sh; the spiking CNN's
# from the sweep in docs/spiking.md), per 32 images and not scaled with np.
MODEL_LR = {"mobilenetv2_cifar": 0.05, "squeezenet1_1": 0.01, "spiking_cnn": 0.2}


def model_config(model: str, **overrides) -> Config:
    """The settings notebooks 04 and 05 train each model with: the committed three-model protocol
    (experiments/three-models/run.sh: 2,000 embedded images, 500 test, 4 epochs, 32 per rank, the model's own
    learning rate), in small mode too -- what it shortens is the sweep (:func:`models_sweep`), and the
    spiking CNN, at width 0.5 there: half the channels cost what MobileNetV2-0.25 does per image and
    still reach 0.416 at np=1 (width 1: 0.440 at twice the CPU time; measured here)::

        study = scaling.study(scaling.model_config("spiking_cnn"), **scaling.models_sweep())
    """
    width = 0.25 if model.startswith("mobilenetv2") else 0.5 if model == "spiking_cnn" and small_mode() else 1.0
    return replace(DEMO, model=model, width=width, test_subset=500, lr=MODEL_LR.get(model, DEMO.lr),
                   lr_ref_batch=32, lr_scaling="none", threads=1 if small_mode() else 0, **overrides)


def models_sweep() -> dict:
    """The model notebooks' process counts: the committed study's (np 1, 2 real, 8 and 48 simulated), or
    in small mode np=1 real and np=8 simulated -- the np where the committed MobileNetV2 turns wrong::

        study = scaling.study(scaling.model_config("squeezenet1_1"), **scaling.models_sweep())

    On a cluster's head node (``PILAB_HOSTFILE``) the counts its slots hold run there (:func:`on_cluster`).
    """
    return on_cluster({"nps": (1,), "simulate_nps": (8,)} if small_mode() else {"nps": (1, 2), "simulate_nps": (8, 48)})


def run_measured(cfg: Config, np_: int, out: str, *, mpiexec: str | None = None,
                 hostfile: str | None = None, timeout: float | None = None, components=()) -> dict:
    """One real MPI job (``pilab.engine.harness`` on np ranks, as ``pilab train`` runs them); returns its
    result.json. Raises ``launch.JobError`` (a RuntimeError) with the job's exit code and last lines.
    ``components``: yours, pickled for the ranks (their classes importable there)."""
    payload = {"config": replace(cfg, out=out).to_dict()}
    with tempfile.TemporaryDirectory() as d:
        if components:
            payload["components"] = engine.save_components(components, os.path.join(d, "components.pkl"))
        return run_job(np_, "pilab.engine.harness", payload, name=f"np={np_} run", mpiexec=mpiexec,
                       hostfile=hostfile, timeout=timeout, answer_dir=out)


class Interrupted(KeyboardInterrupt):
    """A study stopped part-way (Ctrl-C, SIGTERM, a failed run). ``study`` is what it kept: the finished
    points, ``missing`` the others; it was written under ``out`` (``complete`` false)."""

    def __init__(self, study_: dict, cause: BaseException):
        super().__init__(f"study interrupted ({type(cause).__name__}); missing np {study_['missing']}")
        self.study, self.cause = study_, cause


def partial_study(cfg, criteria, nps, simulate_nps, runs, kept, t_start, command, cause) -> dict:
    """What an interrupted study has: its finished points (rows where the baseline is among them)."""
    rows, meta = [], {}
    if runs:
        try:
            rows, meta = rows_from_runs(runs, criteria)
        except (ConfigError, KeyError, TypeError, ZeroDivisionError):  # e.g. the baseline is missing
            pass
    # the failing job's own last line (its exception) beside its name: "np=1 run failed (exit 1):" alone
    # left the user nothing to go on
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    reason = "interrupted" if isinstance(cause, KeyboardInterrupt) else \
        f"a run failed: {' '.join(lines[:1] + lines[1:][-1:]) if lines else type(cause).__name__}"
    return {"kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
            "nps": nps, "simulate_nps": simulate_nps, **meta, "rows": rows,
            "runs": {str(p): r for p, r in runs.items()}, "calibration": None,
            "seconds": time.time() - t_start, "command": command, "complete": False,
            "missing": [p for p in nps + simulate_nps if p not in runs], "kept": kept, "stopped": reason}


def study(cfg: Config = DEMO, nps=(1, 2), *, simulate_nps=(), criteria: Criteria = Criteria(),
          out: str | None = None, mpiexec: str | None = None, hostfile: str | None = None,
          calibration=None, callbacks=(), command: str | None = None, target=None,
          resume: bool = False, reuse=(), components=()) -> dict:
    """Run the study; returns {"rows", "runs", "criteria", "config", ...} and writes it under ``out``.

    ``target``: the machine speedup and time to target are reported for — None / "this" (measured
    here, simulated points predicted for this machine), "pi4b_cluster" (every point predicted for
    the 24-node Pi cluster; speed baseline one node = np 2, predicted whether or not it ran), or a
    calibration/cluster
    JSON path. This machine's times stay in every row beside the target's.
    ``callbacks`` receive {"kind": "run", "np", "simulated", "result"} after each run, so a notebook
    can draw the dashboard as it fills; before each point {"kind": "point", "np", "simulated", "index",
    "of", "label"}, during a simulated one its {"kind": "step", "global_step", "total_steps"} events, and
    {"kind": "stopped"} when the study ends early (what ``widgets.Progress`` shows). Each point's result is kept under ``out/np<p>`` as it finishes;
    interrupted (KeyboardInterrupt, a failed run), the study writes what it has (``complete`` false,
    ``missing``: the points not run) and raises :class:`Interrupted`. ``resume=True`` keeps the
    finished points of an earlier run with the same settings in ``out`` and runs only the others.
    ``reuse``: other studies' directories whose finished points are taken where they are the same
    training (:func:`~pilab.study.points.same_training`: the np=1 point of an LR-rule study is every
    rule's np=1 point). ``components``: yours (``pilab.Component``), a fresh copy in every point (a
    measured point's ranks unpickle them: their classes must be importable there).
    """
    tname = target_name(target)
    nps = sorted(set(int(p) for p in nps))
    simulate_nps = sorted(set(int(p) for p in simulate_nps) - set(nps))
    if not nps and not simulate_nps:
        raise ConfigError("give at least one process count to measure or simulate")
    # The simulator uses the threads asked for (0: all cores); measured runs hold them constant.
    cfg, sim_cfg = _sweep_threads(cfg, nps, hostfile), replace(cfg, out="")
    t_start = time.time()
    runs: dict[int, dict] = {}
    kept: list[int] = []  # points taken from an earlier run of this study (resume) or another (reuse)
    try:
        _run_points(cfg, sim_cfg, nps, simulate_nps, runs, kept, out=out, resume=resume, reuse=reuse,
                    mpiexec=mpiexec, hostfile=hostfile, callbacks=callbacks, components=components)
    except (KeyboardInterrupt, RuntimeError) as e:  # RuntimeError: a failed run (launch.JobError)
        for cb in callbacks:
            cb({"kind": "stopped"})
        partial = partial_study(cfg, criteria, nps, simulate_nps, runs, kept, t_start, command, e)
        if out:
            report.write_partial(partial, out)
        raise Interrupted(partial, e) from None
    if calibration is None and simulate_nps and nps and nps[0] == 1:
        calibration = calibrate_from(runs[1], mpiexec)
    model_cfg = sized_for_model(cfg, runs)
    predicted = predict_points(model_cfg, simulate_nps, calibration)
    criteria = _target_criteria(criteria, tname, target)
    rows, meta = _rows_for(runs, criteria, model_cfg, tname, target, predicted)
    result = {
        "kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
        "nps": nps, "simulate_nps": simulate_nps, **meta, "rows": rows,
        "runs": {str(p): r for p, r in runs.items()},
        "calibration": jsonable(calibration), "seconds": time.time() - t_start,
        "command": command, "target": tname, "complete": True, "missing": [], "kept": kept,
    }
    result["verdict"] = judging.summary(result)  # judged once, here: readers read it
    if out:
        report.write(result, out)
    return result


def _run_points(cfg: Config, sim_cfg: Config, nps: list, simulate_nps: list, runs: dict, kept: list, *,
                out, resume: bool, reuse, mpiexec, hostfile, callbacks, components=()) -> None:
    """Every point in order, measured then simulated, each put into ``runs`` as it finishes (so an
    interrupted study still has the finished ones); the callbacks hear of each before and after."""
    points = [(p, False) for p in nps] + [(p, True) for p in simulate_nps]
    for p in nps:
        _announce(callbacks, points, p, False)
        runs[p] = _measured_point(cfg, p, out, resume, reuse, kept, mpiexec, hostfile, components)
        for cb in callbacks:
            cb({"kind": "run", "np": p, "simulated": False, "result": runs[p], "kept": p in kept})
    for p in simulate_nps:
        _announce(callbacks, points, p, True)
        runs[p] = _simulated_point(sim_cfg, p, out, resume, reuse, kept, callbacks, components)
        for cb in callbacks:
            cb({"kind": "run", "np": p, "simulated": True, "result": runs[p], "kept": p in kept})


def _sweep_threads(cfg: Config, nps: list, hostfile: str | None) -> Config:
    """``cfg`` with threads per rank constant across the measured sweep: what the largest run can give
    every rank (2 on a cluster of a hostfile), where ``cfg.threads`` is 0 (all cores)."""
    if cfg.threads == 0 and nps:
        cores = os.cpu_count() or 1
        cfg = replace(cfg, threads=max(1, cores // max(nps)) if not hostfile else 2)
    return cfg


def _measured_point(cfg: Config, p: int, out, resume: bool, reuse, kept: list, mpiexec, hostfile,
                    components=()) -> dict:
    """np point ``p`` as a real MPI job: kept from ``out`` (resume), taken from a study in ``reuse``, or
    run now under ``out/np<p>`` with this machine's CPU energy (RAPL, where readable); ``kept`` gets
    ``p`` where it was not run now."""
    run_out = os.path.join(out, f"np{p}") if out else temp_dir()
    earlier = finished_point(out, p, replace(cfg, out=run_out), False) if resume else None
    earlier = earlier or reused_run(reuse, p, replace(cfg, out=run_out), False,
                                    os.path.join(run_out, "result.json") if out else None)
    if earlier is None:
        if out:
            clear_point(run_out)
        with energy.RaplWindow() as window:  # this machine's CPU energy, where readable
            earlier = run_measured(cfg, p, run_out, mpiexec=mpiexec, hostfile=hostfile, components=components)
        earlier["rapl"] = window.to_dict()
    else:
        kept.append(p)
    return earlier


def _simulated_point(sim_cfg: Config, p: int, out, resume: bool, reuse, kept: list, callbacks,
                     components=()) -> dict:
    """np point ``p`` from the simulator, kept, reused or run now as :func:`_measured_point`'s."""
    # each run's result.json is written as it completes: a long study keeps what it did
    point_cfg = replace(sim_cfg, out=os.path.join(out, f"np{p}") if out else "")
    earlier = finished_point(out, p, point_cfg, True) if resume else None
    earlier = earlier or reused_run(reuse, p, point_cfg, True,
                                    os.path.join(point_cfg.out, "result.json") if out else None)
    if earlier is None:
        if out:
            clear_point(point_cfg.out)
        earlier = engine.simulate(point_cfg, p, callbacks=[step_events(callbacks)],
                                  components=[copy.deepcopy(c) for c in components])
    else:
        kept.append(p)
    return earlier


def _target_criteria(criteria: Criteria, tname, target) -> Criteria:
    """``criteria`` with the target machine's speed baseline (one Pi node) where none was asked for."""
    if tname and not criteria.baseline_np and target_baseline(target):
        criteria = replace(criteria, baseline_np=target_baseline(target))
    return criteria


def _rows_for(runs: dict, criteria: Criteria, model_cfg: Config, tname, target, predicted=None):
    """The rows and meta of ``runs`` with times predicted for ``target`` (every np) where there is one."""
    p0 = criteria.baseline_np
    return rows_from_runs(runs, criteria, predicted, target=tname,
                          target_predicted=predict_target(model_cfg, sorted(runs), target)
                          if tname else None,
                          baseline_per_image=baseline_time_per_image(model_cfg, p0, target)
                          if tname and p0 and p0 not in runs else None)


def _announce(callbacks, points: list, p: int, simulated: bool) -> None:
    """Tell the callbacks which point runs next (a progress bar names it and counts it)."""
    i = points.index((p, simulated))
    for cb in callbacks:
        cb({"kind": "point", "np": p, "simulated": simulated, "index": i, "of": len(points),
            "label": f"np={p}, " + ("simulated in this process" if simulated else "a real MPI job")})


def study_from_points(out: str, *, target="pi4b_cluster", criteria: Criteria | None = None,
                      planned=()) -> dict:
    """A study made of the points that have finished under ``out`` (``np*/result.json`` of one
    training, real or simulated, as ``experiments/paper-size/run.sh`` writes them one job at a time), before
    ``pilab scale --resume`` puts them into study.json; ``planned`` np counts that have no finished
    point are listed as ``missing`` (``complete`` false). Times are predicted for ``target`` as in
    :func:`study`; the accuracy reference is the smallest finished np::

        st = scaling.study_from_points("experiments/paper-size/naive", planned=(1, 2, 4, 8, 16, 24, 32, 48))
        st["rows"], st["missing"]
    """
    found = _finished_points(out)
    tname = target_name(target)
    criteria = _target_criteria(criteria or Criteria(), tname, target)
    missing = sorted(set(int(p) for p in planned) - set(found))
    if not found:
        return {"kind": "pilab.scaling.study", "config": None, "criteria": asdict(criteria), "rows": [],
                "runs": {}, "target": tname, "complete": False, "missing": missing,
                "command": f"no finished point in {out} yet"}
    runs = {p: r for p, (r, _) in sorted(found.items())}
    cfg = replace(found[min(found)][1], checkpoint_every=0, keep=1)
    others = [p for p, (r, c) in found.items() if not same_training(c.to_dict(), cfg, p)]
    if others:
        raise ConfigError(f"{out}: np {others} are another training than np={min(found)}'s; "
                          "keep one study's points per directory")
    rows, meta = _rows_for(runs, criteria, sized_for_model(cfg, runs), tname, target)
    result = {"kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
              "nps": sorted(p for p in runs if not runs[p].get("simulated")),
              "simulate_nps": sorted(p for p in runs if runs[p].get("simulated")), **meta, "rows": rows,
              "runs": {str(p): r for p, r in runs.items()}, "target": tname,
              "complete": not missing, "missing": missing,
              "command": f"the finished points in {out} (np*/result.json; no study.json yet)"}
    result["verdict"] = judging.summary(result)
    return result


def _finished_points(out: str) -> dict[int, tuple[dict, Config]]:
    """np -> (result, its Config) of every point under ``out`` that ran to the end: ``npN/`` folders (a
    study's), or ``npN-seedS/`` folders (a screen's, as experiments/paper-batch/screen.py keeps them: one
    seed is one study, the smallest seed that has finished points)."""
    found: dict[int, dict[int, tuple[dict, Config]]] = {}  # seed (-1: none) -> np -> point
    for path in glob.glob(os.path.join(glob.escape(out), "np*", "result.json")):
        m = re.search(r"np(\d+)(?:-seed(\d+))?$", os.path.dirname(path))
        if not m:
            continue
        try:
            r = resultfile.load(path)
            cfg = Config.from_dict({**r["config"], "out": out, "resume": ""})
        except resultfile.OldFormError:
            raise
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            continue
        if finished_run(path, int(m.group(1)), cfg, bool(r.get("simulated"))) is not None:
            found.setdefault(int(m.group(2)) if m.group(2) else -1, {})[int(m.group(1))] = (r, cfg)
    return found[min(found)] if found else {}


def seeded_points(out: str) -> bool:
    """Whether ``out`` keeps a screen's ``npN-seedS`` point folders (and plans no other np)."""
    return bool(glob.glob(os.path.join(glob.escape(out), "np*-seed*", "result.json")))


def load_study(path: str, *, target="pi4b_cluster", planned=()) -> dict:
    """A study directory's study.json, or, where ``pilab scale`` has not written one yet, the study
    its finished points make (:func:`study_from_points`). ``ConfigError`` if there is neither, unless
    ``planned`` names the points a long study will have: then a directory with none finished yet (or
    not made yet) is a study whose every point is pending."""
    js = os.path.join(path, "study.json") if os.path.isdir(path) else path
    if os.path.exists(js):
        return resolved(read_json(js), os.path.dirname(js))
    if planned or (os.path.isdir(path) and glob.glob(os.path.join(glob.escape(path), "np*", "result.json"))):
        # a screen's folder (npN-seedS points) is the np it ran: nothing else is pending there
        return study_from_points(path, target=target, planned=() if seeded_points(path) else planned)
    raise ConfigError(f"{js} does not exist; run `python -m pilab scale --out {path}` first")
