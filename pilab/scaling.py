"""The strong-scaling study: the same training at several process counts, and where it turns
fast-but-wrong.

Measured points are real MPI jobs (``mpiexec -n np python -m pilab train ...``, threads per rank held
constant); simulated points run the virtual-rank simulator for accuracy, with times from the
performance model. Speedup S(p) = T(p0)/T(p), efficiency E(p) = S(p)·p0/p, Karp–Flatt serial fraction,
time to a target accuracy and the speedup measured on it::

    from pilab.config import Config
    from pilab import scaling
    study = scaling.study(Config(width=0.25, epochs=4, train_subset=2000), nps=(1, 2),
                          simulate_nps=(8, 48), out="runs/demo")
    study["rows"]          # one dict per np; study["runs"][np] is that run's full result

    python -m pilab scale --out runs/demo                 # the README's demo
    python -m pilab scale --preset pi --hostfile hosts    # 2..48 ranks on a Pi cluster, baseline 2
"""
from __future__ import annotations

import csv
import glob
import io
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from html import escape

from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import Div, Range1d
from bokeh.palettes import Category10
from bokeh.plotting import figure
from bokeh.resources import INLINE

from . import checkpoint, energy, perfmodel, plots, simulate
from . import verdict as judging
from .config import DEMO, Config, ConfigError, small_mode
from .files import atomic_write_text, dumps, save_json, sha256_file
from .launch import LaunchError, run_job
from .perfmodel import efficiency, karp_flatt, speedup
from .plots import html_table



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
    simulated np, where the small run turns fast-but-wrong (np=8: 31 steps of 256 images)::

        study = scaling.study(cfg, **scaling.notebook_sweep(), out="runs/nb")
    """
    return {"nps": (1, 2), "simulate_nps": small_simulate_nps if small_mode() else simulate_nps}


# Each model's learning rate for the three-model protocol (docs/three-models/run.sh; the spiking CNN's
# from the sweep in docs/spiking.md), per 32 images and not scaled with np.
MODEL_LR = {"mobilenetv2_cifar": 0.05, "squeezenet1_1": 0.01, "spiking_cnn": 0.2}


def model_config(model: str, **overrides) -> Config:
    """The settings notebooks 04 and 05 train each model with: the committed three-model protocol
    (docs/three-models/run.sh: 2,000 embedded images, 500 test, 4 epochs, 32 per rank, the model's own
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
    """
    return {"nps": (1,), "simulate_nps": (8,)} if small_mode() else {"nps": (1, 2), "simulate_nps": (8, 48)}


@dataclass(frozen=True)
class Criteria:
    """How runs are judged; shown in the report and saved with the study."""
    baseline_np: int = 0  # p0 of S and E; 0 = the smallest measured np
    target_fraction: float = 0.9  # target accuracy = this × the baseline's final test accuracy
    wrong_gap: float = 0.10  # fast-but-wrong: final test accuracy this far below the baseline's...
    wrong_floor: float = 0.20  # ...or under this (twice chance on CIFAR-10); a reference under it judges nothing
    chance: float = judging.CHANCE  # no target accuracy at or below this (ten balanced classes)

    def __post_init__(self):
        if not 0 < self.target_fraction <= 1:
            raise ConfigError(f"target_fraction={self.target_fraction} must be in (0, 1]")
        if self.wrong_gap < 0 or not 0 <= self.wrong_floor < 1:
            raise ConfigError("wrong_gap must be >= 0 and wrong_floor in [0, 1)")


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------
def _karp_flatt(s: float, p: int, p0: int) -> float | None:
    """Karp–Flatt serial fraction, None (not NaN: JSON has none) at the baseline itself."""
    e = karp_flatt(s, p, p0)
    return None if math.isnan(e) else e


def time_to_target(result: dict, target: float, epoch_times: list[float] | None = None,
                   eval_times: list[float] | None = None) -> float | None:
    """Seconds until the first evaluation with test accuracy >= ``target``; None ("not reached") if
    no evaluation gets there — never a number for a run that failed (MLPerf / DAWNBench rules).

    Training time and the time of every evaluation up to that one count; ``epoch_times`` and
    ``eval_times`` (per epoch) replace the measured ``epochs[].time`` / ``eval_time`` (predicted
    times for another machine). An epoch without an evaluation contributes no evaluation time."""
    if target is None:  # no target: the reference did not learn (pilab.verdict)
        return None
    elapsed = 0.0
    train = epoch_times or [e["time"] for e in result["epochs"]]
    evals = eval_times or [e.get("eval_time") or 0.0 for e in result["epochs"]]
    for e, t, t_eval in zip(result["epochs"], train, evals):
        elapsed += t
        if e.get("test_acc") is None:
            continue
        elapsed += t_eval
        if e["test_acc"] >= target:
            return elapsed
    return None


def final_value(result: dict, key: str):
    for e in reversed(result["epochs"]):
        if e.get(key) is not None:
            return e[key]
    return None


def _times(run: dict, pr: dict | None, machine: str) -> dict | None:
    """Per-epoch training and evaluation seconds of ``run`` on ``machine``: measured when the run is
    a real one on this machine, else from the performance model's prediction ``pr`` (or None)."""
    n = len(run["epochs"])
    if machine == "this machine" and not run.get("simulated"):
        ep = run["epochs"]
        train_time = sum(e["time"] for e in ep)
        return {"train": [e["time"] for e in ep], "eval": [e.get("eval_time") or 0.0 for e in ep],
                "source": "measured", "comm_share": sum(e["comm"] for e in ep) / train_time,
                "comm_exposed_share": sum(e["comm_exposed"] for e in ep) / train_time}
    if not pr:
        return None
    return {"train": [pr["epoch_time"]] * n, "eval": [pr.get("eval_time", 0.0)] * n,
            "source": "predicted", "comm_share": pr.get("comm_share"),
            "comm_exposed_share": pr.get("comm_exposed_share")}


def rows_from_runs(runs: dict[int, dict], criteria: Criteria = Criteria(),
                   predicted: dict[int, dict] | None = None, *, target: str | None = None,
                   target_predicted: dict[int, dict] | None = None,
                   baseline_per_image: float | None = None) -> tuple[list[dict], dict]:
    """One row per np from run results (measured or simulated), judged against the baseline runs.

    ``predicted``: performance-model times for this machine (simulated points); ``target`` and
    ``target_predicted``: another machine's name and its predicted times for every np. Speedup,
    efficiency and time to target use the target's times when there is a target, else this
    machine's; both appear in the row (``here_*`` and ``target_*``). The speed baseline is
    ``criteria.baseline_np`` (default: the smallest measured np); accuracy is judged against the
    smallest np of the study (np=1 where it ran), so the reference run is never itself judged wrong.
    ``baseline_per_image``: the target's predicted seconds per training image at ``baseline_np`` when
    that np did not run (a target's speed needs no accuracy run: one Pi node without an np=2 point).
    """
    predicted, target_predicted = predicted or {}, target_predicted or {}
    nps = sorted(runs)
    measured = [p for p in nps if not runs[p].get("simulated")]
    p0 = criteria.baseline_np or (measured[0] if measured else nps[0])
    if p0 not in runs and not (target and baseline_per_image):
        raise ConfigError(f"baseline np={p0} is not among the runs {nps}; measure it or pick another")
    pa = nps[0]
    base_acc = final_value(runs[pa], "test_acc")
    # None where the reference did not learn: no target at or below chance (pilab.verdict)
    target_acc = judging.target_accuracy(base_acc, asdict(criteria))
    primary = target or "this machine"
    here = {p: _times(runs[p], predicted.get(p), "this machine") for p in nps}
    there = {p: _times(runs[p], target_predicted.get(p), target) for p in nps} if target else here
    times0 = there.get(p0)
    # Strong scaling compares the same work: time per training image, since an epoch at larger np
    # drops more leftover images (each rank's shard rounded down to whole batches).
    t0 = sum(times0["train"]) / len(times0["train"]) / _images_per_epoch(runs[p0]) if times0 else \
        (baseline_per_image if p0 not in runs else None)
    ttt0 = time_to_target(runs[pa], target_acc, there[pa]["train"], there[pa]["eval"]) \
        if there[pa] else None
    rows = [_row(p, runs[p], here[p], there[p], primary, p0, t0, ttt0, target_acc) for p in nps]
    for r in rows:
        r.update(run_energy(runs[r["np"]], there[r["np"]], primary, target_acc))
    # the verdict of every row: pilab.verdict, the one logic the tables, reports and notebooks share
    rows = judging.judge(rows, reference_np=pa, speed_baseline_np=p0, reference_acc=base_acc,
                         criteria=asdict(criteria))
    meta = {"baseline_np": p0, "baseline_predicted_only": p0 not in runs,
            "accuracy_baseline_np": pa, "baseline_test_acc": base_acc,
            "target_accuracy": target_acc, "machine": primary,
            "reference_learned": judging.learned(base_acc, asdict(criteria))}
    return rows, meta


def _images_per_epoch(run: dict) -> int:
    return run["per_rank_batch"] * run["np"] * run["steps_per_epoch"]


def _row(p, r, here, there, machine, p0, t0, ttt0, target_acc) -> dict:
    """The row of one np: speed on ``machine`` (``there``), this machine's time beside it; its verdict
    comes after (pilab.verdict.judge)."""
    def mean(t):
        return sum(t["train"]) / len(t["train"]) if t else None
    tpe = mean(there)
    s = speedup(t0, tpe / _images_per_epoch(r)) if (tpe and t0) else None
    acc = final_value(r, "test_acc")
    ttt = time_to_target(r, target_acc, there["train"], there["eval"]) if there else None
    return {
        "np": p, "simulated": bool(r.get("simulated")),
        "machine": machine, "time_source": there["source"] if there else None,
        "per_rank_batch": r["per_rank_batch"], "global_batch": r["global_batch"],
        "steps_per_epoch": r["steps_per_epoch"], "peak_lr": r["peak_lr"],
        "threads": r["threads"],
        "wall_time": r["wall_time"] if not r.get("simulated") else None,
        "time_per_epoch": tpe,
        "here_time_per_epoch": mean(here), "here_time_source": here["source"] if here else None,
        "speedup": s, "efficiency": efficiency(s, p, p0) if s else None,
        "karp_flatt": _karp_flatt(s, p, p0) if s else None,
        "images_per_s": (r["per_rank_batch"] * p * r["steps_per_epoch"] / tpe) if tpe else None,
        "comm_share": there.get("comm_share") if there else None,
        "comm_exposed_share": there.get("comm_exposed_share") if there else None,
        "peak_mem_mb": max(r["peak_mem_mb"]) if r.get("peak_mem_mb") else None,
        "final_train_acc": final_value(r, "train_acc"), "final_test_acc": acc,
        "final_train_loss": final_value(r, "train_loss"), "final_test_loss": final_value(r, "test_loss"),
        "time_to_target": ttt,
        "speedup_to_target": (ttt0 / ttt) if (ttt and ttt0) else None,
        "target_reached": any((e.get("test_acc") or 0) >= target_acc for e in r["epochs"])
        if target_acc is not None else None,
    }


# The power model of each target machine with one (pilab.energy); this machine has none: only its RAPL
# counters, where readable, give its energy.
POWER_MODELS = {"pi4b_cluster": "pi4b"}
_NO_ENERGY = {"energy_j": None, "energy_per_epoch_j": None, "energy_to_target_j": None, "energy_source": None}


def run_energy(run: dict, times: dict | None, machine: str, target_acc: float) -> dict:
    """A row's energy on ``machine``: total, per epoch, to the target accuracy (None if not reached),
    and where the figure comes from. Evaluation counts, as in time to target."""
    n = len(run["epochs"])
    if machine == "this machine":
        window = run.get("rapl")
        if not window or window.get("energy_j") is None:
            return dict(_NO_ENERGY)
        e = energy.energy_of_run(run, rapl=window, include_eval=True)
    elif machine in POWER_MODELS and times:
        evaluated = [e.get("test_acc") is not None for e in run["epochs"]]
        seconds = [t + (ev if done else 0.0) for t, ev, done in zip(times["train"], times["eval"], evaluated)]
        e = energy.energy_of_run(run, POWER_MODELS[machine], epoch_times=seconds,
                                 comm_exposed_share=times.get("comm_exposed_share"))
    else:
        return dict(_NO_ENERGY)
    return {"energy_j": e["energy_j"], "energy_per_epoch_j": e["energy_j"] / n if n else None,
            "energy_to_target_j": energy.energy_to_target(run, target_acc, e["energy_per_epoch_j"])
            if target_acc is not None else None,
            "energy_source": e["source"]}


def verdict(study_: dict, *, within: float = 0.05) -> str:
    """One plain-language paragraph from the numbers (:func:`pilab.verdict.summary`, the one logic)."""
    return judging.summary(judging.judge_study(study_), within=within)


def interpretation(study_: dict) -> str:
    """What a study showed, for the end of a notebook: the verdict paragraph (:mod:`pilab.verdict`), then
    why -- the optimizer steps each np got -- and the size of the run it came from::

        scaling.interpretation(study)      # the last line of a cell: a paragraph
    """
    st = judging.judge_study(study_)
    parts = [judging.summary(st)]
    runs = st.get("runs") or {}
    steps = [(r["np"], runs[str(r["np"])]["total_steps"], r["global_batch"]) for r in st["rows"]
             if str(r["np"]) in runs and runs[str(r["np"])].get("total_steps")]
    cfg = st.get("config") or {}
    if len(steps) > 1 and cfg.get("batch_mode") == "per_rank":
        parts.append("Why: with " + f"{cfg['batch_size']} images per rank and {cfg['epochs']} epochs, the global "
                     "batch grows with np and the optimizer steps fall: "
                     + ", ".join(f"np={p} {n} steps of {gb}" for p, n, gb in steps)
                     + f" (learning rate rule: {cfg['lr_scaling']}). 03_fast_but_wrong separates this cause from "
                     "the others.")
    if cfg:
        parts.append(f"This run: {cfg['model']} width {cfg['width']:g}, "
                     f"{cfg['train_subset'] or 'all':,} training and {cfg['test_subset'] or 'all':,} test images, "
                     f"{cfg['epochs']} epochs: small, so its accuracies are a few points apart from seed to seed.")
    return plots.Paragraph("\n\n".join(parts))


# ----------------------------------------------------------------------------------------------
# running
# ----------------------------------------------------------------------------------------------
def run_measured(cfg: Config, np_: int, out: str, *, mpiexec: str | None = None,
                 hostfile: str | None = None, timeout: float | None = None) -> dict:
    """One real MPI job (``pilab.harness`` on np ranks, as ``pilab train`` runs them); returns its
    result.json. Raises ``launch.JobError`` (a RuntimeError) with the job's exit code and last lines."""
    return run_job(np_, "pilab.harness", {"config": replace(cfg, out=out).to_dict()}, name=f"np={np_} run",
                   mpiexec=mpiexec, hostfile=hostfile, timeout=timeout, answer_dir=out)


def _predict(cfg: Config, nps, calibration) -> dict[int, dict]:
    """Predicted epoch times (and comm shares) from the performance model, where it is available."""
    if calibration is None:
        return {}
    out = {}
    for p in nps:
        pr = perfmodel.predict(cfg, p, calibration)
        # "time" is training only, like a measured epoch's "time" (evaluation is timed apart)
        out[p] = {"epoch_time": pr["time"], "eval_time": pr["eval_time"],
                  "comm_share": pr["comm"] / pr["time"], "comm_exposed_share": pr["comm_exposed"] / pr["time"]}
    return out


TARGETS = ("this", "pi4b_cluster")  # or the path of a calibration / cluster JSON


def target_name(target) -> str | None:
    """The machine a study's times are for: None for this machine, else a preset name or JSON path."""
    if target in (None, "", "this"):
        return None
    if isinstance(target, str) and target not in perfmodel.PRESETS and not os.path.isfile(target):
        raise ConfigError(f"target={target!r}: use this, {', '.join(perfmodel.PRESETS)} or the path of a "
                          "calibration/cluster JSON (python -m pilab perfmodel calibrate writes one)")
    return target if isinstance(target, str) else getattr(target, "name", "target")


def target_baseline(target) -> int:
    """The speed baseline a target implies: one node of the Pi cluster (2 ranks); 0 = none."""
    return perfmodel.PI_BASELINE_NP if target == "pi4b_cluster" else 0


def _baseline_per_image(cfg: Config, p0: int, target) -> float:
    """The target's predicted training seconds per image at ``p0`` ranks (no run needed)."""
    pr = perfmodel.predict(replace(cfg, threads=0) if target in perfmodel.PRESETS else cfg, p0, target)
    return pr["time"] / pr["images"]


def _predict_target(cfg: Config, nps, target) -> dict[int, dict]:
    """Every np's times on the target machine, threads per rank as that machine gives them."""
    # This machine's thread count says nothing about the target's: let the model place the ranks.
    return _predict(replace(cfg, threads=0) if target in perfmodel.PRESETS else cfg, nps, target)


class Interrupted(KeyboardInterrupt):
    """A study stopped part-way (Ctrl-C, SIGTERM, a failed run). ``study`` is what it kept: the finished
    points, ``missing`` the others; it was written under ``out`` (``complete`` false)."""

    def __init__(self, study_: dict, cause: BaseException):
        super().__init__(f"study interrupted ({type(cause).__name__}); missing np {study_['missing']}")
        self.study, self.cause = study_, cause


def _finished_point(out: str | None, p: int, point_cfg: Config, simulated: bool) -> dict | None:
    """The result of np point ``p`` kept from an earlier run of this study in ``out``: the same
    settings, run to the end (not stopped early); None if there is none to keep."""
    return finished_run(os.path.join(out, f"np{p}", "result.json"), p, point_cfg, simulated) if out else None


def finished_run(path: str, p: int, cfg: Config, simulated: bool) -> dict | None:
    """The result.json at ``path`` if it is ``cfg``'s training at ``p`` ranks (:func:`same_training`),
    simulated or measured as asked, and ran to the end; else None (missing, unreadable, other)."""
    try:
        r = _load_json(path)
        saved = Config.from_dict(r["config"]).to_dict()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done = not r.get("stopped_early") and r.get("steps_done", r.get("total_steps")) == r.get("total_steps")
    ok = done and bool(r.get("simulated")) == simulated and r.get("np") == p
    return r if ok and same_training(saved, cfg, p) else None


_LR_RULE = ("lr", "lr_scaling", "lr_ref_batch")
_NOT_TRAINING = ("out", "resume", "checkpoint_every", "keep")


def same_training(saved: dict, cfg: Config, p: int) -> bool:
    """True if a run saved with settings ``saved`` is the training ``cfg`` asks for at ``p`` ranks:
    every setting equal, or equal but for an LR rule that gives the same peak LR at ``p`` (at np=1
    with a reference batch of one rank's batch every rule is the base LR), so four LR-rule studies
    share their np=1 point::

        same_training(Config(lr_scaling="none").to_dict(), Config(lr_scaling="linear"), 1)   # True
        same_training(Config(checkpoint_every=1).to_dict(), Config(), 1)                     # True
    """
    mine = cfg.to_dict()
    # Where a run writes and how often it checkpoints do not change what it trains (the simulator cannot
    # checkpoint, so a study's real np=1 point with checkpoints is still its simulated points' kin).
    keys = [k for k in mine if k not in _NOT_TRAINING]
    if all(saved.get(k) == mine[k] for k in keys):
        return True
    if any(saved.get(k) != mine[k] for k in keys if k not in _LR_RULE):
        return False
    try:
        return math.isclose(Config.from_dict(saved).peak_lr(p), cfg.peak_lr(p), rel_tol=1e-12)
    except (ConfigError, TypeError, ValueError):
        return False


def reused_run(dirs, p: int, cfg: Config, simulated: bool, dest: str | None) -> dict | None:
    """The finished np ``p`` point of another study (``dirs``) that is ``cfg``'s training, marked
    ``reused_from`` and copied to ``dest`` (a result.json path, None: no copy) so the study or search
    that takes it stays self-contained; None if no study has it."""
    for d in dirs:
        r = _finished_point(d, p, cfg, simulated)
        if r is not None:
            r = {**r, "reused_from": os.path.join(d, f"np{p}")}
            if dest:
                save_json(r, dest)
            return r
    return None


def _load_json(path: str):
    with open(path) as f:
        return json.load(f)


# study.json holds each point's run by reference to the point's own np<p>/result.json (path + SHA-256),
# not a second copy of it; what the study added to a run (a measured point's "rapl") rides beside it.
_REF_KEYS = {"file", "sha256", "also"}


def _is_ref(run) -> bool:
    return isinstance(run, dict) and {"file", "sha256"} <= set(run) <= _REF_KEYS


def stored(study_: dict, out: str) -> dict:
    """``study_`` as its study.json in ``out`` stores it: each run that is its point's result.json
    there becomes ``{"file": "np2/result.json", "sha256": ..., "also": {what the study added}}``;
    a run with no such file (or another one there) stays embedded. :func:`load_study` undoes it."""
    runs = {}
    for p, run in (study_.get("runs") or {}).items():
        rel = f"np{p}/result.json"
        path = os.path.join(out, rel)
        try:
            saved = _load_json(path)
        except (OSError, ValueError):
            saved = None
        plain = json.loads(dumps(run, indent=None))  # as JSON reads it back: lists, plain numbers
        if isinstance(saved, dict) and all(k in plain and plain[k] == v for k, v in saved.items()):
            also = {k: v for k, v in plain.items() if k not in saved}
            runs[p] = {"file": rel, "sha256": sha256_file(path), **({"also": also} if also else {})}
        else:
            runs[p] = run
    return {**study_, "runs": runs}


def resolved(study_: dict, where: str) -> dict:
    """A study.json's content with its referenced runs read back from their files (relative to the
    directory ``where``); ConfigError if a file is missing or is not the one the study recorded."""
    runs = study_.get("runs")
    if not isinstance(runs, dict) or not any(map(_is_ref, runs.values())):
        return study_
    out = {}
    for p, run in runs.items():
        if _is_ref(run):
            path = os.path.join(where, run["file"])
            try:
                same = sha256_file(path) == run["sha256"]
            except OSError:
                raise ConfigError(f"{path} is missing; the study in {where} refers to it") from None
            if not same:
                raise ConfigError(f"{path} changed after the study in {where} was written (its SHA-256 "
                                  "differs); run `pilab scale` with --resume there to make the study again")
            run = {**_load_json(path), **run.get("also", {})}
        out[p] = run
    return {**study_, "runs": out}


def _clear_point(d: str) -> None:
    """Remove an earlier run's files from a point's directory before the point is run again."""
    for path in [os.path.join(d, "result.json"), os.path.join(d, "checkpoint.pt")] + \
            [p for _, p in checkpoint.epoch_files(d)]:
        if os.path.exists(path):
            os.remove(path)


def _partial_study(cfg, criteria, nps, simulate_nps, runs, kept, t_start, command, cause) -> dict:
    """What an interrupted study has: its finished points (rows where the baseline is among them)."""
    rows, meta = [], {}
    if runs:
        try:
            rows, meta = rows_from_runs(runs, criteria)
        except (ConfigError, KeyError, TypeError, ZeroDivisionError):  # e.g. the baseline is missing
            pass
    reason = "interrupted" if isinstance(cause, KeyboardInterrupt) else \
        f"a run failed: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}"
    return {"kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
            "nps": nps, "simulate_nps": simulate_nps, **meta, "rows": rows,
            "runs": {str(p): r for p, r in runs.items()}, "calibration": None,
            "seconds": time.time() - t_start, "command": command, "complete": False,
            "missing": [p for p in nps + simulate_nps if p not in runs], "kept": kept, "stopped": reason}


def _write_partial(study_: dict, out: str) -> None:
    """study.json and study.csv of an interrupted study (the JSON is the record; no report)."""
    save_json(stored(study_, out), os.path.join(out, "study.json"))
    atomic_write_text(os.path.join(out, "study.csv"), to_csv(study_["rows"]))


def study(cfg: Config = DEMO, nps=(1, 2), *, simulate_nps=(), criteria: Criteria = Criteria(),
          out: str | None = None, mpiexec: str | None = None, hostfile: str | None = None,
          calibration=None, callbacks=(), command: str | None = None, target=None,
          resume: bool = False, reuse=()) -> dict:
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
    training (:func:`same_training`: the np=1 point of an LR-rule study is every rule's np=1 point).
    """
    tname = target_name(target)
    nps = sorted(set(int(p) for p in nps))
    simulate_nps = sorted(set(int(p) for p in simulate_nps) - set(nps))
    if not nps and not simulate_nps:
        raise ConfigError("give at least one process count to measure or simulate")
    # The simulator uses the threads asked for (0: all cores); measured runs hold them constant.
    sim_threads = cfg.threads
    if cfg.threads == 0 and nps:
        # Threads per rank constant across the sweep: what the largest run can give every rank.
        cores = os.cpu_count() or 1
        cfg = replace(cfg, threads=max(1, cores // max(nps)) if not hostfile else 2)
    t_start = time.time()
    runs: dict[int, dict] = {}
    kept: list[int] = []  # points taken from an earlier run of this study (resume) or another (reuse)
    sim_cfg = replace(cfg, threads=sim_threads, out="")
    points = [(p, False) for p in nps] + [(p, True) for p in simulate_nps]
    try:
        for p in nps:
            _announce(callbacks, points, p, False)
            run_out = os.path.join(out, f"np{p}") if out else _tmpdir()
            earlier = _finished_point(out, p, replace(cfg, out=run_out), False) if resume else None
            earlier = earlier or reused_run(reuse, p, replace(cfg, out=run_out), False,
                                            os.path.join(run_out, "result.json") if out else None)
            if earlier is None:
                if out:
                    _clear_point(run_out)
                with energy.RaplWindow() as window:  # this machine's CPU energy, where readable
                    earlier = run_measured(cfg, p, run_out, mpiexec=mpiexec, hostfile=hostfile)
                earlier["rapl"] = window.to_dict()
            else:
                kept.append(p)
            runs[p] = earlier
            for cb in callbacks:
                cb({"kind": "run", "np": p, "simulated": False, "result": runs[p], "kept": p in kept})
        for p in simulate_nps:
            _announce(callbacks, points, p, True)
            # each run's result.json is written as it completes: a long study keeps what it did
            point_cfg = replace(sim_cfg, out=os.path.join(out, f"np{p}") if out else "")
            earlier = _finished_point(out, p, point_cfg, True) if resume else None
            earlier = earlier or reused_run(reuse, p, point_cfg, True,
                                            os.path.join(point_cfg.out, "result.json") if out else None)
            if earlier is None:
                if out:
                    _clear_point(point_cfg.out)
                earlier = simulate.run(point_cfg, p, callbacks=[step_events(callbacks)])
            else:
                kept.append(p)
            runs[p] = earlier
            for cb in callbacks:
                cb({"kind": "run", "np": p, "simulated": True, "result": runs[p], "kept": p in kept})
    except (KeyboardInterrupt, RuntimeError) as e:  # RuntimeError: a failed run (launch.JobError)
        for cb in callbacks:
            cb({"kind": "stopped"})
        partial = _partial_study(cfg, criteria, nps, simulate_nps, runs, kept, t_start, command, e)
        if out:
            _write_partial(partial, out)
        raise Interrupted(partial, e) from None
    if calibration is None and simulate_nps and nps and nps[0] == 1:
        calibration = calibrate_from(runs[1], mpiexec)
    model_cfg = sized_for_model(cfg, runs)
    predicted = _predict(model_cfg, simulate_nps, calibration)
    if tname and not criteria.baseline_np and target_baseline(target):
        criteria = replace(criteria, baseline_np=target_baseline(target))
    p0 = criteria.baseline_np
    rows, meta = rows_from_runs(runs, criteria, predicted, target=tname,
                                target_predicted=_predict_target(model_cfg, sorted(runs), target)
                                if tname else None,
                                baseline_per_image=_baseline_per_image(model_cfg, p0, target)
                                if tname and p0 and p0 not in runs else None)
    result = {
        "kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
        "nps": nps, "simulate_nps": simulate_nps, **meta, "rows": rows,
        "runs": {str(p): r for p, r in runs.items()},
        "calibration": _jsonable(calibration), "seconds": time.time() - t_start,
        "command": command, "target": tname, "complete": True, "missing": [], "kept": kept,
    }
    result["verdict"] = verdict(result)
    if out:
        write(result, out)
    return result


def _announce(callbacks, points: list, p: int, simulated: bool) -> None:
    """Tell the callbacks which point runs next (a progress bar names it and counts it)."""
    i = points.index((p, simulated))
    for cb in callbacks:
        cb({"kind": "point", "np": p, "simulated": simulated, "index": i, "of": len(points),
            "label": f"np={p}, " + ("simulated in this process" if simulated else "a real MPI job")})


def step_events(callbacks):
    """A training callback passing each step's progress on to ``callbacks`` (``{"kind": "step",
    "global_step", "total_steps"}``), for a progress bar over a call that runs several trainings."""
    def forward(ev):
        if ev.get("kind") == "step":
            for cb in callbacks:
                cb({"kind": "step", "global_step": ev["global_step"], "total_steps": ev.get("total_steps")})
    return forward


def sized_for_model(cfg: Config, runs: dict) -> Config:
    """``cfg`` with its image counts spelled out for the performance model, taken from the runs' data
    (an archive or folder of the whole set has ``train_subset=0``, and the model cannot know its size)::

        sized_for_model(Config(data="../shared/data/cifar10-jpeg.tar.gz"), {1: result})  # train_subset=50000
    """
    if cfg.train_subset and cfg.test_subset:
        return cfg
    sizes = next((r["data"] for r in runs.values() if r.get("data", {}).get("n_train")), None)
    if sizes is None:
        return cfg
    return replace(cfg, train_subset=cfg.train_subset or sizes["n_train"],
                   test_subset=cfg.test_subset or sizes["n_test"])


def study_from_points(out: str, *, target="pi4b_cluster", criteria: Criteria | None = None,
                      planned=()) -> dict:
    """A study made of the points that have finished under ``out`` (``np*/result.json`` of one
    training, real or simulated, as ``docs/paper-size/run.sh`` writes them one job at a time), before
    ``pilab scale --resume`` puts them into study.json; ``planned`` np counts that have no finished
    point are listed as ``missing`` (``complete`` false). Times are predicted for ``target`` as in
    :func:`study`; the accuracy reference is the smallest finished np::

        st = scaling.study_from_points("docs/paper-size/naive", planned=(1, 2, 4, 8, 16, 24, 32, 48))
        st["rows"], st["missing"]
    """
    found = {}
    for path in glob.glob(os.path.join(glob.escape(out), "np*", "result.json")):
        m = re.search(r"np(\d+)$", os.path.dirname(path))
        try:
            r = _load_json(path)
            cfg = Config.from_dict({**r["config"], "out": out, "resume": ""})
        except (OSError, ValueError, KeyError, TypeError, ConfigError):
            continue
        if m and finished_run(path, int(m.group(1)), cfg, bool(r.get("simulated"))) is not None:
            found[int(m.group(1))] = (r, cfg)
    tname = target_name(target)
    criteria = criteria or Criteria()
    if tname and not criteria.baseline_np and target_baseline(target):
        criteria = replace(criteria, baseline_np=target_baseline(target))
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
    model_cfg = sized_for_model(cfg, runs)
    p0 = criteria.baseline_np
    rows, meta = rows_from_runs(runs, criteria, target=tname,
                                target_predicted=_predict_target(model_cfg, sorted(runs), target)
                                if tname else None,
                                baseline_per_image=_baseline_per_image(model_cfg, p0, target)
                                if tname and p0 and p0 not in runs else None)
    result = {"kind": "pilab.scaling.study", "config": cfg.to_dict(), "criteria": asdict(criteria),
              "nps": sorted(p for p in runs if not runs[p].get("simulated")),
              "simulate_nps": sorted(p for p in runs if runs[p].get("simulated")), **meta, "rows": rows,
              "runs": {str(p): r for p, r in runs.items()}, "target": tname,
              "complete": not missing, "missing": missing,
              "command": f"the finished points in {out} (np*/result.json; no study.json yet)"}
    result["verdict"] = verdict(result)
    return result


def load_study(path: str, *, target="pi4b_cluster", planned=()) -> dict:
    """A study directory's study.json, or, where ``pilab scale`` has not written one yet, the study
    its finished points make (:func:`study_from_points`). ``ConfigError`` if there is neither, unless
    ``planned`` names the points a long study will have: then a directory with none finished yet (or
    not made yet) is a study whose every point is pending."""
    js = os.path.join(path, "study.json") if os.path.isdir(path) else path
    if os.path.exists(js):
        return resolved(_load_json(js), os.path.dirname(js))
    if planned or (os.path.isdir(path) and glob.glob(os.path.join(glob.escape(path), "np*", "result.json"))):
        return study_from_points(path, target=target, planned=planned)
    raise ConfigError(f"{js} does not exist; run `python -m pilab scale --out {path}` first")


def _tmpdir() -> str:
    return tempfile.mkdtemp(prefix="pilab-run-")


def _jsonable(obj):
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    try:
        return asdict(obj)
    except TypeError:
        return obj


def calibrate_from(np1_result: dict, mpiexec: str | None = None):
    """This machine's performance model from an np=1 run (+ a short comm micro-benchmark under
    mpiexec); None, with a one-line note, when the micro-benchmark cannot run here."""
    try:
        bench = perfmodel.run_comm_bench(nps=(2,), mpiexec=mpiexec)
    except (RuntimeError, OSError, LaunchError) as e:  # RuntimeError: the job failed (launch.JobError)
        print(f"pilab: comm micro-benchmark failed ({e}); simulated rows get no predicted times",
              file=sys.stderr)
        return None
    return perfmodel.calibrate(np1_result, bench)


# ----------------------------------------------------------------------------------------------
# output
# ----------------------------------------------------------------------------------------------
ROW_KEYS = ("np", "simulated", "machine", "time_source", "per_rank_batch", "global_batch", "steps_per_epoch",
            "peak_lr", "threads", "time_per_epoch", "here_time_per_epoch", "here_time_source", "speedup",
            "efficiency", "karp_flatt", "images_per_s", "comm_share", "comm_exposed_share", "peak_mem_mb",
            "final_train_acc", "final_test_acc", "final_train_loss", "final_test_loss", "time_to_target",
            "speedup_to_target", "target_reached", "energy_per_epoch_j", "energy_j", "energy_to_target_j",
            "energy_source", "fast_but_wrong", "verdict", "verdict_why", "efficiency_note")


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROW_KEYS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        # no number to a target: "not reached", or "no target" where the reference did not learn
        missing = "no target" if r.get("target_reached") is None else "not reached"
        w.writerow({k: (missing if k in ("time_to_target", "speedup_to_target", "energy_to_target_j")
                        and r.get(k) is None and (k != "energy_to_target_j" or r.get("energy_j") is not None)
                        else r.get(k)) for k in ROW_KEYS})
    return buf.getvalue()


def table(study_: dict) -> str:
    """A plain-text table of the rows (what the CLI prints); with a target machine, its times first
    and this machine's beside them. Verdicts, target and the paragraph under it: :mod:`pilab.verdict`.
    It is a :class:`pilab.plots.Table`: the last expression of a notebook cell shows it as HTML."""
    study_ = judging.judge_study(study_)
    machine = study_.get("machine", "this machine")
    two = machine != "this machine"
    pa = study_["accuracy_baseline_np"]
    base, target = study_["baseline_test_acc"], study_["target_accuracy"]
    lines = [f"baseline np={pa}  final test acc " + (f"{base:.3f}" if base is not None else "–") + "  "
             + (f"target {target:.3f}" if target is not None else "no target (the reference has not learned)")]
    if two:
        lines.append(f"times: {machine} (predicted), speed baseline np={study_['baseline_np']}"
                     + (" (predicted only, no run)" if study_.get("baseline_predicted_only") else "")
                     + "; 'here' = this machine")
    lines.append(f"{'np':>4} {'kind':>9} {'glob.batch':>10} {'s/epoch':>8} "
                 + (f"{'here':>8} " if two else "")
                 + f"{'speedup':>8} {'eff.':>6} {'test acc':>8} {'time→target':>12}  verdict")
    for r in study_["rows"]:
        def n(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) and v is not None else "–"
        ttt = ("–" if r["time_per_epoch"] is None else "not reached" if target is not None else "no target") \
            if r["time_to_target"] is None else f"{r['time_to_target']:.1f}s"
        here = f"{n(r.get('here_time_per_epoch'), '8.1f'):>8} " if two else ""
        eff = n(r["efficiency"], ".0%") + ("*" if r.get("efficiency_note") else "")
        lines.append(f"{r['np']:>4} {'sim' if r['simulated'] else 'measured':>9} {r['global_batch']:>10} "
                     f"{n(r['time_per_epoch'], '8.1f'):>8} {here}{n(r['speedup'], '8.2f'):>8} "
                     f"{eff:>6} {n(r['final_test_acc'], '8.3f'):>8} {ttt:>12}  {judging.cell(r)}")
    lines += judging.footnotes(study_)
    lines += ["", judging.summary(study_)]
    # in a notebook the same rows as an HTML table (the report's cells), the verdict under it
    head, cells, notes = plots.study_cells(study_, steps=True)
    return plots.Table("\n".join(lines), head, cells, notes=notes, caption=judging.summary(study_), kind="study")


def write(study_: dict, out: str) -> dict:
    """study.json, study.csv, report.html (self-contained, BokehJS inline) and report.png if possible."""
    os.makedirs(out, exist_ok=True)
    save_json(stored(study_, out), os.path.join(out, "study.json"))
    atomic_write_text(os.path.join(out, "study.csv"), to_csv(study_["rows"]))
    html_path = os.path.join(out, "report.html")
    atomic_write_text(html_path, report_html(study_))
    paths = {"json": os.path.join(out, "study.json"), "csv": os.path.join(out, "study.csv"),
             "html": html_path}
    png = export_png(html_path, os.path.join(out, "report.png"))
    if png:
        paths["png"] = png
    return paths


def report_html(study_: dict) -> str:
    study_ = judging.judge_study(study_)  # verdicts and target by the one logic (older study.json too)
    crit = study_["criteria"]
    cfg = study_["config"]
    machine = study_.get("machine", "this machine")
    pa = study_.get("accuracy_baseline_np", study_["baseline_np"])
    times = ("Times are measured on this machine for measured points and predicted for it by the "
             "performance model for simulated ones." if machine == "this machine" else
             f"Speedup, efficiency, time and energy to target are <b>predicted for {escape(machine)}</b> for "
             "every point (the performance model and power model of that machine's preset); the table also "
             "shows this machine's times ('here': measured, or predicted for simulated points).")
    times += (" Speedup compares time per training image: at larger np each rank's shard is rounded down "
              "to whole batches, so an epoch drops more leftover images.")
    head = (
        "<h2>pilab strong-scaling study</h2>"
        f"<p><b>Verdict.</b> {escape(judging.summary(study_))}</p>"
        f"<p><b>command:</b> <code>{escape(study_.get('command') or 'python API')}</code></p>"
        f"<p>model {cfg['model']} width {cfg['width']}, {cfg['epochs']} epochs, batch {cfg['batch_size']} "
        f"({cfg['batch_mode']}), lr {cfg['lr']} per {cfg['lr_ref_batch']} scaled {cfg['lr_scaling']}, "
        f"warmup {cfg['warmup_epochs']} epochs, sharding {cfg['sharding']}, BN {cfg['bn']}, "
        f"threads/rank {cfg['threads']}, data {escape(cfg['data'])} "
        f"(train subset {cfg['train_subset'] or 'all'})</p>"
        f"<p>Speed baseline np={study_['baseline_np']}"
        f"{' (its time predicted; no accuracy run at that np)' if study_.get('baseline_predicted_only') else ''}"
        f"; accuracy reference np={pa} (final test accuracy "
        + (f"{study_['baseline_test_acc']:.3f}" if study_['baseline_test_acc'] is not None else "–") + "). "
        + (f"Target accuracy {study_['target_accuracy']:.3f} = "
           if study_["target_accuracy"] is not None else
           "<b>No target accuracy and no verdicts</b>: the reference has not learned (under "
           f"{crit['wrong_floor']:.0%}), and a target at chance would say nothing. Otherwise the target is ")
        + f"{crit['target_fraction']:.0%} of the reference's, fixed before the other runs; time to target "
        "counts training and every evaluation up to the first that reaches it, and a run that never "
        "reaches it is <i>not reached</i> (MLPerf / DAWNBench conventions). A run is "
        f"<b>fast-but-wrong</b> when its final test accuracy is more than {crit['wrong_gap'] * 100:.0f} "
        f"points below the reference's or under {crit['wrong_floor']:.0%}. Measured points are real MPI "
        f"jobs; simulated points are exact virtual-rank emulations. {times}</p>")
    return file_html(column(Div(text=head, width=900), plots.report_layout(study_)), INLINE,
                     "pilab scaling study")


def export_png(html_path: str, png_path: str) -> str | None:
    """Screenshot the report with Debian's Chromium through Playwright, where both are installed.

    The browser is driven from a thread of its own: Playwright's sync API refuses to run in a thread
    with a running asyncio loop, which is every Jupyter kernel's main thread."""
    chromium = "/usr/bin/chromium"
    if not os.path.exists(chromium):
        return None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    outcome: dict = {}

    def shoot():
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=[
                    "--no-sandbox", "--disable-background-networking", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1000, "height": 900})
                page.goto("file://" + os.path.abspath(html_path))
                page.wait_for_timeout(1500)
                page.screenshot(path=png_path, full_page=True)
                browser.close()
            outcome["png"] = png_path
        except Exception as e:  # a report without its PNG is still a report
            outcome["error"] = e

    worker = threading.Thread(target=shoot, name="pilab-png-export", daemon=True)
    worker.start()
    worker.join()
    if "error" in outcome:
        e = outcome["error"]
        print(f"pilab: PNG export skipped ({e.__class__.__name__}: {e})", file=sys.stderr)
    return outcome.get("png")


# ----------------------------------------------------------------------------------------------
# comparing studies (e.g. learning-rate rules) side by side
# ----------------------------------------------------------------------------------------------
# Settings that belong together when studies differ (one "what varies" in a comparison's title).
SETTING_GROUPS = {
    "learning-rate rule": ("lr", "lr_scaling", "lr_ref_batch", "warmup_epochs", "optimizer", "schedule",
                           "momentum", "nesterov", "lars_eta"),
    "model": ("model", "width", "timesteps"),
    "batch": ("batch_mode", "batch_size"),
    "BatchNorm": ("bn", "bn_buffers", "ghost_batch"),
    "data": ("data", "train_subset", "test_subset", "augment", "sharding"),
}
_NOT_SETTINGS = ("out", "resume", "threads", "checkpoint_every", "keep", "device")  # not the training's


def differing_settings(configs: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """{group: {setting: {label: value}}} for every setting that is not the same in all ``configs``
    (label -> config dict), grouped as SETTING_GROUPS; a setting outside them is a group of its own::

        differing_settings({"a": {"lr": 0.1, "epochs": 4}, "b": {"lr": 0.2, "epochs": 4}})
        # {"learning-rate rule": {"lr": {"a": 0.1, "b": 0.2}}}
    """
    keys = sorted({k for c in configs.values() for k in c} - set(_NOT_SETTINGS))
    out: dict[str, dict[str, dict]] = {}
    for k in keys:
        values = {label: c.get(k) for label, c in configs.items()}
        if len({repr(v) for v in values.values()}) > 1:
            group = next((g for g, ks in SETTING_GROUPS.items() if k in ks), k.replace("_", " "))
            out.setdefault(group, {})[k] = values
    return out


def compare(studies: dict[str, dict]) -> dict:
    """Put several studies (label -> study dict) side by side: per (label, np) final accuracy, the
    test-accuracy curve, and how many evaluated epochs sat at chance level (< 15%); ``varies``: the
    settings that differ (see :func:`differing_settings`), ``warning``: a line when more than one kind
    of setting differs (the comparison then does not isolate one cause)."""
    table_rows = []
    for label, st in studies.items():
        st = judging.judge_study(st)  # one verdict logic, older study.json files too
        for r in st["rows"]:
            res = st["runs"][str(r["np"])]
            curve = [e["test_acc"] for e in res["epochs"]]
            table_rows.append({
                "label": label, "np": r["np"], "simulated": r["simulated"],
                "global_batch": r["global_batch"], "peak_lr": r["peak_lr"],
                "steps": res["total_steps"], "final_test_acc": r["final_test_acc"],
                "test_acc_curve": curve,
                "epochs_near_chance": sum(1 for a in curve if a is not None and a < 0.15),
                "fast_but_wrong": r["fast_but_wrong"], "verdict": r["verdict"],
                "verdict_why": r["verdict_why"]})
    # a study with no finished point yet (one being run, see load_study) has no settings to compare
    configs = {k: v["config"] for k, v in studies.items() if v.get("config") is not None}
    varies = differing_settings(configs)
    warning = None
    if len(varies) > 1:
        warning = ("these studies differ in more than one kind of setting, so a difference between them "
                   "has more than one cause: " + "; ".join(
                       f"{k} ({', '.join(f'{lab} {v}' for lab, v in vals.items())})"
                       for settings in varies.values() for k, vals in settings.items()))
    return {"kind": "pilab.scaling.compare", "labels": list(studies), "rows": table_rows,
            "configs": configs, "commands": {k: v.get("command") for k, v in studies.items()},
            "varies": varies, "warning": warning}


def compare_title(cmp: dict) -> str:
    """What the comparison is by: the kinds of setting that differ ("learning-rate rule", "model")."""
    varies = cmp.get("varies")
    if varies is None:  # a compare.json written before `varies`
        varies = differing_settings(cmp.get("configs") or {})
    if not varies:
        return "studies of the same settings"
    kinds = list(varies)
    return "by " + (", ".join(kinds[:-1]) + " and " if len(kinds) > 1 else "") + kinds[-1]


def models_summary(studies: dict[str, dict], *, at_np: int | None = None) -> list[dict]:
    """One row per study (e.g. per model): accuracy at the reference np, speedup and energy to target at
    the largest np (``at_np``: at that np, where a study has it, so studies of different sweeps compare
    at one np), and the smallest np up to it that turned fast-but-wrong — the three-model comparison::

        rows = scaling.models_summary({"MobileNetV2": a, "SqueezeNet": b, "spiking CNN": c})
        print(scaling.models_summary_markdown(rows))
    """
    out = []
    for label, st in studies.items():
        st = judging.judge_study(st)
        rows = st["rows"]
        ref = next(r for r in rows if r["np"] == st.get("accuracy_baseline_np", rows[0]["np"]))
        top = next((r for r in rows if r["np"] == at_np), rows[-1])
        wrong = [r["np"] for r in rows if r["fast_but_wrong"] and r["np"] <= top["np"]]
        out.append({"label": label, "model": st["config"]["model"], "machine": st.get("machine"),
                    "reference_np": ref["np"], "reference_acc": ref["final_test_acc"],
                    "largest_np": top["np"], "largest_np_acc": top["final_test_acc"],
                    "speedup_at_largest": top.get("speedup"), "baseline_np": st["baseline_np"],
                    "energy_to_target_reference_j": ref.get("energy_to_target_j"),
                    "energy_to_target_largest_j": top.get("energy_to_target_j"),
                    "energy_source": top.get("energy_source"),
                    "first_fast_but_wrong_np": wrong[0] if wrong else None,
                    "judged": st["reference_learned"]})
    return out


def models_summary_markdown(rows: list[dict]) -> str:
    def kj(v, r):
        return f"{v / 1e3:.2f} kJ" if v is not None else ("not reached" if r.get("judged", True) else "no target")
    head = ("model", "test acc (np ref)", "test acc (largest np)", "speedup at largest np",
            "energy to target (np ref)", "energy to target (largest np)", "first fast-but-wrong np")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fbw = (r["first_fast_but_wrong_np"] or "none") if r.get("judged", True) else \
            f"not judged (np={r['reference_np']} has not learned)"
        sp = f"{r['speedup_at_largest']:.1f} (vs np={r['baseline_np']}, {r['machine']})" \
            if r["speedup_at_largest"] else "–"
        lines.append(f"| {r['label']} | {r['reference_acc']:.3f} (np={r['reference_np']}) | "
                     f"{r['largest_np_acc']:.3f} (np={r['largest_np']}) | {sp} | "
                     f"{kj(r['energy_to_target_reference_j'], r)} | {kj(r['energy_to_target_largest_j'], r)} | "
                     f"{fbw} |")
    return "\n".join(lines)


def models_table(studies: dict[str, dict], *, at_np: int | None = None, committed: str | None = None) -> str:
    """The three-model comparison (:func:`models_summary`) as Markdown text, and in a notebook as an HTML
    table with what it says under it (:func:`models_interpretation`); ``committed`` (e.g.
    ``"three-models"``) adds the committed studies of docs/<committed>/ that are not among ``studies``
    (by model), labelled as such::

        scaling.models_table({"MobileNetV2": a, "SqueezeNet 1.1": b})     # the last line of a cell
        scaling.models_table({"spiking CNN (this run)": c}, at_np=8, committed="three-models")
    """
    studies = _with_committed(studies, committed) if committed else studies
    rows = models_summary(studies, at_np=at_np)
    md = models_summary_markdown(rows).splitlines()
    head = [c.strip() for c in md[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in md[2:]]
    return plots.Table("\n".join(md), head, cells, caption=models_interpretation(studies, at_np=at_np),
                       kind="models")


def _with_committed(studies: dict[str, dict], committed: str) -> dict[str, dict]:
    """``studies`` and, after them, the committed studies of docs/<committed>/ of the other models."""
    have = {(st.get("config") or {}).get("model") for st in studies.values()}
    return {**studies, **{f"{label} (committed)": st for label, st in committed_studies(committed).items()
                          if st["config"]["model"] not in have}}


def committed_studies(name: str) -> dict[str, dict]:
    """The committed studies of docs/<name>/ (one directory per model, e.g. ``"three-models"``), by a
    model label; empty outside pilab's source repository::

        scaling.committed_studies("three-models")      # {"MobileNetV2-CIFAR 0.25": {...}, ...}
    """
    found = {}
    for d in sorted(glob.glob(os.path.join(glob.escape(os.path.join(plots.DOCS, name)), "*", "study.json"))):
        st = _load_json(d)
        found[_model_label(st["config"])] = st
    return found


# A speedup within this fraction of another model's is "about the same" (the performance model's
# predictions are not finer than that).
SAME_SPEED = 0.1


def models_interpretation(studies: dict[str, dict], *, committed: str | None = None,
                          at_np: int | None = None) -> str:
    """Which model scales better, from the studies' numbers: speed (predicted speedup at the largest np)
    and accuracy (what each keeps at scale, where its reference learned enough to judge); "too small to
    tell" where a reference has not. ``committed``: a directory under docs/ with one study per model
    (``"three-models"``), whose answer is added after this run's::

        scaling.models_interpretation({"MobileNetV2": a, "SqueezeNet 1.1": b}, committed="three-models")
    """
    studies = _with_committed(studies, committed) if committed else studies
    rows = models_summary(studies, at_np=at_np)
    parts = []
    timed = [r for r in rows if r.get("speedup_at_largest")]
    if len(timed) > 1:
        fast = max(timed, key=lambda r: r["speedup_at_largest"])
        slow = min(timed, key=lambda r: r["speedup_at_largest"])
        sp = ", ".join(f"{r['label']} {r['speedup_at_largest']:.1f}" for r in timed)
        machine = timed[0].get("machine") or "this machine"
        if fast["speedup_at_largest"] <= slow["speedup_at_largest"] * (1 + SAME_SPEED):
            parts.append(f"Speed: about the same speedup at np={fast['largest_np']} ({sp}; {machine}, against "
                         f"np={fast['baseline_np']}).")
        else:
            parts.append(f"Speed: {fast['label']} scales better ({sp} at np={fast['largest_np']}; {machine}, "
                         f"against np={fast['baseline_np']}).")
    judged = [r for r in rows if r["judged"]]
    for r in rows:
        if not r["judged"]:
            parts.append(f"Accuracy: {r['label']} has not learned at this size (its reference, np={r['reference_np']}, "
                         f"ends at {r['reference_acc']:.1%}, under the {2 * judging.CHANCE:.0%} floor), so how its "
                         "accuracy scales is too small to tell here.")

    def kept(r):  # the share of what it learned (above chance) that it keeps at the larger np
        return max(r["largest_np_acc"] - judging.CHANCE, 0.0) / (r["reference_acc"] - judging.CHANCE)
    for r in judged:
        drop = r["reference_acc"] - r["largest_np_acc"]
        fbw = (f"fast-but-wrong from np={r['first_fast_but_wrong_np']}" if r["first_fast_but_wrong_np"]
               else "never fast-but-wrong here")
        parts.append(f"Accuracy: {r['label']} goes from {r['reference_acc']:.1%} (np={r['reference_np']}) to "
                     f"{r['largest_np_acc']:.1%} at np={r['largest_np']} ("
                     + (f"{100 * drop:.0f} points lower" if drop >= 0.005 else f"{-100 * drop:.0f} points higher"
                        if drop <= -0.005 else "the same") + f"; {kept(r):.0%} of what it learned kept), {fbw}.")
    if len(judged) > 1:
        best = max(judged, key=kept)
        if all(abs(kept(best) - kept(o)) < 0.15 for o in judged):
            parts.append("Neither keeps clearly more of what it learned at scale"
                         + (": all are at chance there." if all(kept(o) == 0 for o in judged) else "."))
        else:
            parts.append(f"{best['label']} keeps the most of what it learned at scale.")
    elif len(rows) > 1:
        parts.append("So this run cannot say which scales better in accuracy"
                     + ("" if judged else ": no reference learned") + ".")
    text = " ".join(parts)
    if committed:
        text += "\n\n" + _committed_models(committed)
    return plots.Paragraph(text)


def _committed_models(name: str) -> str:
    """The committed comparison's answer (docs/<name>/<model>/study.json), in the same words."""
    found = committed_studies(name)
    if not found:
        return f"(The committed comparison docs/{name}/ is in pilab's source repository, not in this install.)"
    some = next(iter(found.values()))["config"]
    head = (f"The committed comparison (docs/{name}/: {some['train_subset'] or 'all':,} images, {some['epochs']} "
            f"epochs, np up to {max(int(p) for st in found.values() for p in st['runs'])}): ")
    return head + models_interpretation(found)


def _model_label(cfg: dict) -> str:
    """"MobileNetV2-CIFAR 0.25", "SqueezeNet 1.1", "spiking CNN": a model as a table names it."""
    names = {"mobilenetv2_cifar": "MobileNetV2-CIFAR", "mobilenetv2": "MobileNetV2",
             "squeezenet1_1": "SqueezeNet 1.1", "spiking_cnn": "spiking CNN"}
    name = names.get(cfg["model"], cfg["model"])
    return f"{name} {cfg['width']:g}" if cfg["model"].startswith("mobilenetv2") else name


_COMPARE_HEAD = ("study", "np", "kind", "global batch", "peak lr", "steps", "final test acc",
                 "epochs near chance", "verdict")


def _compare_head(cmp: dict) -> tuple:
    """The table's header; its first column named by what varies when one kind of setting does."""
    varies = cmp.get("varies") if cmp.get("varies") is not None else differing_settings(cmp.get("configs") or {})
    return ((next(iter(varies)) if len(varies) == 1 else "study"),) + _COMPARE_HEAD[1:]


def _compare_cells(r: dict) -> list[str]:
    """One row of the comparison table, as text (shared by the markdown and HTML forms)."""
    return [r["label"], str(r["np"]), "simulated" if r["simulated"] else "measured",
            str(r["global_batch"]), f"{r['peak_lr']:.3g}", str(r["steps"]), f"{r['final_test_acc']:.3f}",
            f"{r['epochs_near_chance']}/{len(r['test_acc_curve'])}", judging.cell(r)]


def compare_markdown(cmp: dict) -> str:
    head = _compare_head(cmp)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_compare_cells(r)) + " |" for r in cmp["rows"]]
    return "\n".join(lines)


def compare_html(cmp: dict) -> str:
    return file_html(compare_layout(cmp), INLINE, "pilab fast-but-wrong")


def compare_layout(cmp: dict):
    """The comparison as one Bokeh layout: accuracy per epoch for each np and rule, then the table."""
    nps = sorted({r["np"] for r in cmp["rows"]})
    n_epochs = max((len(r["test_acc_curve"]) for r in cmp["rows"]), default=1)
    figs = []
    for p in nps:
        f = figure(title=f"test accuracy per epoch, np={p}", width=330, height=330,
                   x_axis_label="epoch", y_axis_label="test accuracy", tools="pan,box_zoom,reset,save")
        f.toolbar.autohide = True  # shown on hover in the HTML, never baked into its PNG
        f.y_range = Range1d(0, 1)
        f.x_range = Range1d(0.5, n_epochs + 0.5)
        for r in (x for x in cmp["rows"] if x["np"] == p):
            xs = list(range(1, len(r["test_acc_curve"]) + 1))
            color = Category10[10][cmp["labels"].index(r["label"]) % 10]
            f.line(xs, r["test_acc_curve"], color=color, line_width=2, legend_label=r["label"])
            # markers: a study with one evaluation per curve is a point, not an empty plot
            f.scatter(xs, r["test_acc_curve"], color=color, size=6, legend_label=r["label"])
        f.line([0.5, n_epochs + 0.5], [0.1, 0.1], color="gray", line_dash="dotted", legend_label="chance")
        legend = f.legend[0]  # below the plot, off the curves
        f.add_layout(legend, "below")
        legend.orientation, legend.ncols, legend.location = "horizontal", 2, "center"
        legend.label_text_font_size = "10pt"
        legend.border_line_alpha = 0
        f.title.text_font_size = "11pt"
        figs.append(f)
    head = f"<h2>pilab: fast-but-wrong, {escape(compare_title(cmp))}</h2>"
    if cmp.get("warning"):
        head += f"<p style='color:#b00'><b>Warning:</b> {escape(cmp['warning'])}</p>"
    for label, cmd in cmp["commands"].items():
        head += f"<p style='font-size:11pt'><b>{escape(label)}:</b> <code>{escape(str(cmd))}</code></p>"
    table = html_table(_compare_head(cmp), [_compare_cells(r) for r in cmp["rows"]])
    # three plots a row: the page (and its PNG) stays 1,000 px wide, readable where it is shown
    grid = [row(*figs[i:i + 3]) for i in range(0, len(figs), 3)]
    return column(Div(text=head, width=1000), *grid, Div(text=table, width=1000))
