"""The numbers of a strong-scaling study: one row per np from the runs' results, judged by
:mod:`pilab.verdict`, with time (measured here or predicted by the performance model for a target
machine) and energy columns::

    from pilab.study import analysis
    rows, meta = analysis.rows_from_runs({1: np1_result, 2: np2_result}, analysis.Criteria())

Speedup S(p) = T(p0)/T(p), efficiency E(p) = S(p)·p0/p, Karp–Flatt serial fraction, time to a target
accuracy and the speedup measured on it. Pure functions of plain dicts; running the points is
:mod:`pilab.study.scaling`, writing them :mod:`pilab.study.report`.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, replace

from .. import perfmodel, verdict as judging
from ..config import Config, ConfigError
from ..launch import LaunchError
from ..perfmodel import efficiency, karp_flatt, speedup
from . import energy
from .points import mode_ran


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


def serial_fraction(s: float, p: int, p0: int) -> float | None:
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
        "simulate_mode": mode_ran(r),  # the simulator's mode that ran it: exact or fast (None: measured)
        "machine": machine, "time_source": there["source"] if there else None,
        "per_rank_batch": r["per_rank_batch"], "global_batch": r["global_batch"],
        "steps_per_epoch": r["steps_per_epoch"], "peak_lr": r["peak_lr"],
        "threads": r["threads"],
        "wall_time": r["wall_time"] if not r.get("simulated") else None,
        "time_per_epoch": tpe,
        "here_time_per_epoch": mean(here), "here_time_source": here["source"] if here else None,
        "speedup": s, "efficiency": efficiency(s, p, p0) if s else None,
        "karp_flatt": serial_fraction(s, p, p0) if s else None,
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


# The power model of each target machine with one (pilab.study.energy); this machine has none: only its RAPL
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


def predict_points(cfg: Config, nps, calibration) -> dict[int, dict]:
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


def target_name(target) -> str | None:
    """The machine a study's times are for: None for this machine, else a preset name or JSON path."""
    if target in (None, "", "this"):
        return None
    if perfmodel.is_board_spec(target):
        perfmodel.resolve_cluster(target)  # a mixed cluster's boards: ConfigError naming what is wrong
    elif isinstance(target, str) and not perfmodel.is_pi_cluster(target) and not os.path.isfile(target):
        raise ConfigError(f"target={target!r}: use this, {', '.join(perfmodel.PRESETS)}, a mixed Pi cluster "
                          f"(BOARD:NODES,... of {', '.join(perfmodel.BOARDS)}, e.g. pi4b:12,pi5:12) or the path of a "
                          "calibration/cluster JSON (python -m pilab perfmodel calibrate writes one)")
    return target if isinstance(target, str) else getattr(target, "name", "target")


def target_baseline(target) -> int:
    """The speed baseline a target implies: one node of a Pi cluster (2 ranks; of a mixed one, its first
    node's board); 0 = none."""
    return perfmodel.PI_BASELINE_NP if perfmodel.is_pi_cluster(target) else 0


def baseline_time_per_image(cfg: Config, p0: int, target) -> float:
    """The target's predicted training seconds per image at ``p0`` ranks (no run needed)."""
    pr = perfmodel.predict(replace(cfg, threads=0) if perfmodel.is_pi_cluster(target) else cfg, p0, target)
    return pr["time"] / pr["images"]


def predict_target(cfg: Config, nps, target) -> dict[int, dict]:
    """Every np's times on the target machine, threads per rank as that machine gives them."""
    # This machine's thread count says nothing about the target's: let the model place the ranks.
    return predict_points(replace(cfg, threads=0) if perfmodel.is_pi_cluster(target) else cfg, nps, target)


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


def jsonable(obj):
    if obj is None:
        return None
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    try:
        return asdict(obj)
    except TypeError:
        return obj
