"""A study's points on disk: which finished run can be kept (``--resume``) or taken from another
study (``--reuse``), study.json's references to each point's ``np<p>/result.json``, and the progress
events of a point's training (:func:`step_events`)::

    from pilab.study import points
    points.finished_run("runs/demo/np2/result.json", 2, cfg, simulated=False)   # the run, or None
    points.resolved(load_json("runs/demo/study.json"), "runs/demo")           # runs read back
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import replace

from .. import resultfile
from ..config import Config, ConfigError
from ..engine import checkpoint
from ..files import dumps, sha256_file
from ..perfmodel import remember


def finished_point(out: str | None, p: int, point_cfg: Config, simulated: bool) -> dict | None:
    """The result of np point ``p`` kept from an earlier run of this study in ``out``: the same
    settings, run to the end (not stopped early); None if there is none to keep."""
    return finished_run(os.path.join(out, f"np{p}", "result.json"), p, point_cfg, simulated) if out else None


def finished_run(path: str, p: int, cfg: Config, simulated: bool) -> dict | None:
    """The result.json at ``path`` if it is ``cfg``'s training at ``p`` ranks (:func:`same_training`),
    simulated or measured as asked, and ran to the end; else None (missing, unreadable, other).
    ConfigError where it is that training but on data whose contents, or with a model builder whose
    source, changed since (:func:`check_sources`): keeping it would mix two runs in one study. A result
    in the form before result.steps.npz raises ``resultfile.OldFormError`` (convert it; it is not run
    again over it)."""
    try:
        r = resultfile.load(path)
        saved = Config.from_dict(r["config"]).to_dict()
    except resultfile.OldFormError:
        raise
    except (OSError, ValueError, KeyError, TypeError):
        return None
    done = not r.get("stopped_early") and r.get("steps_done", r.get("total_steps")) == r.get("total_steps")
    ok = done and bool(r.get("simulated")) == simulated and r.get("np") == p
    if not (ok and same_training(saved, cfg, p)):
        return None
    check_sources(r, path, cfg)
    return r


def current_sources(cfg: Config) -> dict:
    """The data checksum and model source digest ``cfg``'s run would record now (``engine.checkpoint.sources``),
    the data loaded once per process for each data setting (the cache makes it a read)."""
    key = (cfg.data, cfg.train_subset, cfg.test_subset, cfg.seed, cfg.image_size, cfg.model)
    if key not in _SOURCES:
        from ..engine import load_data
        _SOURCES[key] = checkpoint.sources(cfg, load_data(cfg))
    return _SOURCES[key]


_SOURCES: dict = {}


def check_sources(r: dict, path: str, cfg: Config) -> None:
    """ConfigError naming what changed (the data's contents, the model builder's file) and the fix, when
    the finished run ``r`` (read from ``path``) did not read what ``cfg`` reads now; a result that predates
    these records is taken as it is."""
    why = checkpoint.changed_sources({"data_checksum": (r.get("data") or {}).get("checksum"),
                                      "model_source": r.get("model_source")}, current_sources(cfg), cfg.data)
    if why:
        raise ConfigError(f"{path} was trained {why}; run the study again with --overwrite (or into another "
                          "--out), or put back what changed: --resume and --reuse keep only runs of the same "
                          "data and code")


_LR_RULE = ("lr", "lr_scaling", "lr_ref_batch")


# how a run is kept and watched, not what it computes (compile_bn: the same mathematics, compiled)
NOT_TRAINING = ("out", "resume", "checkpoint_every", "keep", "checkpoint_minutes", "checkpoint_every_steps",
                 "straggler_threshold", "straggler_steps", "trace", "trace_window", "compile_bn")


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
    keys = [k for k in mine if k not in NOT_TRAINING]
    try:
        theirs = Config.from_dict(saved)  # the one reader of a saved config
    except (ConfigError, TypeError, ValueError):
        return False
    saved = theirs.to_dict()
    # the simulator's modes differ only in float rounding: a bitwise (exact) run is what auto or fast asks
    # for, and an auto run is what auto asks for again (points run before auto existed were exact)
    if saved.get("simulate_mode") == "exact" or mine["simulate_mode"] == "auto":
        saved["simulate_mode"] = mine["simulate_mode"]
    if all(saved[k] == mine[k] for k in keys):
        return True
    if any(saved[k] != mine[k] for k in keys if k not in _LR_RULE):
        return False
    try:
        return math.isclose(theirs.peak_lr(p), cfg.peak_lr(p), rel_tol=1e-12)
    except (ConfigError, TypeError, ValueError):
        return False


def trained_config(result: dict) -> Config:
    """The config a finished run trained with, as the performance model should price it: a noise-driven
    batch ramp (``batch_ramp="gns:MAX"``) replaced by the batches it chose (``batch_ramp_chosen``)."""
    cfg = Config.from_dict(result["config"])
    chosen = result.get("batch_ramp_chosen")
    return replace(cfg, batch_ramp=chosen) if cfg.gns_max and chosen is not None else cfg


def reused_run(dirs, p: int, cfg: Config, simulated: bool, dest: str | None) -> dict | None:
    """The finished np ``p`` point of another study (``dirs``) that is ``cfg``'s training, marked
    ``reused_from`` and copied to ``dest`` (a result.json path, None: no copy) so the study or search
    that takes it stays self-contained; None if no study has it."""
    for d in dirs:
        r = finished_point(d, p, cfg, simulated)
        if r is not None:
            r = {**r, "reused_from": os.path.join(d, f"np{p}")}
            if dest:
                resultfile.save(r, dest)
            return r
    return None


def read_json(path: str):
    with open(path) as f:
        return json.load(f)


# study.json holds each point's run by reference to the point's own np<p>/result.json (path + SHA-256),
# not a second copy of it; what the study added to a run (a measured point's "rapl") rides beside it.
_REF_KEYS = {"file", "sha256", "also"}


def _is_ref(run) -> bool:
    return isinstance(run, dict) and {"file", "sha256"} <= set(run) <= _REF_KEYS


def stored(study_: dict, out: str) -> dict:
    """``study_`` as its study.json in ``out`` stores it: each run becomes a reference to its point's
    result.json there, ``{"file": "np2/result.json", "sha256": ..., "also": {what the study added}}``
    (the file is written where it is missing: a study made in memory); ConfigError where that file holds
    another run. :func:`resolved` reads the runs back."""
    runs = {}
    for p, run in (study_.get("runs") or {}).items():
        rel = f"np{p}/result.json"
        path = os.path.join(out, rel)
        plain = json.loads(dumps(run, indent=None))  # as JSON reads it back: lists, plain numbers
        if not os.path.exists(path):
            resultfile.save(plain, path)
        try:
            saved = resultfile.load(path)
        except resultfile.OldFormError:
            raise
        except (OSError, ValueError):
            saved = None
        # the per-step timings come back to the microsecond (pilab.resultfile): the rest says which run it is
        if not (isinstance(saved, dict) and all(k in plain and plain[k] == v for k, v in saved.items()
                                                if k != "steps")):
            raise ConfigError(f"{path} holds another run than the study's np={p}; write the study to "
                              "another --out, or run it again there")
        also = {k: v for k, v in plain.items() if k not in saved}
        runs[p] = {"file": rel, "sha256": sha256_file(path), **({"also": also} if also else {})}
    return {**study_, "runs": runs}


def mode_ran(run: Mapping | None) -> str | None:
    """The simulator's mode a simulated run ran in (``exact`` or ``fast``): its ``simulate_mode_used``, or
    for runs made before results said it, the mode its config named (they could not choose); None for a
    measured run or where nothing says."""
    if not run or not run.get("simulated"):
        return None
    named = (run.get("config") or {}).get("simulate_mode")
    return run.get("simulate_mode_used") or (named if named in ("exact", "fast") else None)



def resolved(study_: dict, where: str) -> dict:
    """A study.json's content with its runs read back from the files it refers to (relative to the
    directory ``where``); ConfigError if a file is missing or is not the one the study recorded."""
    out = {}
    for p, run in (study_.get("runs") or {}).items():
        if not _is_ref(run):
            raise ConfigError(f"{where}/study.json np={p}: its run is not a reference to np{p}/result.json; "
                              f"remake the study there with `pilab scale --resume --out {where}`")
        path = os.path.join(where, run["file"])
        try:
            same = sha256_file(path) == run["sha256"]
        except OSError:
            raise ConfigError(f"{path} is missing; the study in {where} refers to it") from None
        if not same:
            raise ConfigError(f"{path} changed after the study in {where} was written (its SHA-256 "
                              "differs); run `pilab scale` with --resume there to make the study again")
        out[p] = {**resultfile.load(path), **run.get("also", {})}
        remember(out[p].get("model_profile"))  # analysis of the study reads the model as its runs measured it
    # rows of studies made before rows said which simulator mode ran: from their runs
    rows = [r if "simulate_mode" in r else {**r, "simulate_mode": mode_ran(out.get(str(r["np"])))}
            for r in study_.get("rows") or []]
    return {**study_, "runs": out, **({"rows": rows} if "rows" in study_ else {})}


def clear_point(d: str) -> None:
    """Remove an earlier run's files (``engine.RUN_FILES``) from a point's directory before the point is
    run again."""
    from ..engine import run_files
    for path in run_files(d):
        if os.path.exists(path):
            os.remove(path)


def temp_dir() -> str:
    return tempfile.mkdtemp(prefix="pilab-run-")


def step_events(callbacks):
    """A training callback passing each step's progress on to ``callbacks`` (``{"kind": "step",
    "global_step", "total_steps"}``), for a progress bar over a call that runs several trainings."""
    def forward(ev):
        if ev.get("kind") == "step":
            for cb in callbacks:
                cb({"kind": "step", "global_step": ev["global_step"], "total_steps": ev.get("total_steps")})
    return forward
