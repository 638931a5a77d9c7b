"""Calibration: what an np=1 run and the Allreduce micro-benchmark say about this machine, and the
Cluster built from it (``this_box``, or your own nodes with ``cluster_from_calibration``).

    from pilab.perfmodel import calibrate, this_box
    from pilab import resultfile
    from pilab.files import load_json
    cal = calibrate(resultfile.load("runs/np1/result.json"), load_json("runs/perfmodel/comm_bench.json"))
    cal.save("runs/perfmodel/calibration.json")
    this_box(cal).train_gflops                 # achieved GFLOP/s per rank in the np=1 run
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import ConfigError
from ..files import load_json, save_json
from .assumptions import FLOPS_PER_ACTIVATION_CPU, STEP_WORK_PER_TENSOR_CPU
from .fit import _bench_runs, fit_alpha_beta
from .layout import activations_per_image, bn_channels, flops_per_image, gradient_layout, remember
from .machine import Cluster, Link


@dataclass(frozen=True)
class Calibration:
    """What an np=1 run and the Allreduce micro-benchmark say about this machine (JSON-able)."""
    model: str
    width: float
    per_rank_batch: int
    threads: int
    cores_per_node: int
    flops_per_image: float  # training FLOPs per image of (model, width)
    compute_s_per_image: float  # forward + backward + optimizer, per image, steady state
    data_s_per_image: float
    eval_s_per_image: float  # per test image (np=1 evaluates all of them)
    step_overhead_s: float  # per step, outside compute and data
    warmup_s: float  # first step's extra time over the steady mean (may be < 0 in a warm process)
    compute_cv: float  # std / mean of per-step compute, first step excluded
    alpha: float  # s per message, intra-node (fitted)
    beta: float  # s per byte, intra-node (fitted)
    fit_rel_rms: float
    oversub_alpha: float = 0.0  # extra s per round with more ranks than cores (fitted)
    available_cores: float = 0.0  # cores the np=1 run actually got on a shared machine (0: all it wanted)
    bench_nps: tuple = ()
    mpi_library: str = ""
    host: str = ""
    source: str = ""
    activations_per_image: float = 0.0  # activation elements per image of (model, width)
    flops_per_activation: float = 0.0  # the model constant used (FLOPS_PER_ACTIVATION_CPU)
    step_work_per_tensor: float = 0.0  # the model constant used (STEP_WORK_PER_TENSOR_CPU)
    # the model's gradient tensors ((numel, ready) each) and BatchNorm channels, as the np=1 run recorded
    # them (layout.model_profile): predictions from this calibration never build the model again
    gradient_layout: tuple = ()
    bn_channels: tuple = ()

    def __post_init__(self):
        if self.gradient_layout:  # what predict and this_box read for (model, width)
            remember({"model": self.model, "width": self.width, "gradient_layout": self.gradient_layout,
                      "bn_channels": self.bn_channels or None})

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bench_nps"] = list(self.bench_nps)
        d["gradient_layout"] = [list(t) for t in self.gradient_layout]
        d["bn_channels"] = list(self.bn_channels)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Calibration":
        d = dict(d)
        d["bench_nps"] = tuple(d.get("bench_nps", ()))
        d["gradient_layout"] = tuple(tuple(t) for t in d.get("gradient_layout", ()))
        d["bn_channels"] = tuple(d.get("bn_channels", ()))
        return cls(**d)

    def save(self, path: str) -> None:
        """Write as JSON (atomically: a reader never sees half a calibration)."""
        save_json(self.to_dict(), path)

    @classmethod
    def load(cls, path: str) -> "Calibration":
        return cls.from_dict(load_json(path))


def calibrate(np1_result: Mapping[str, Any], comm_bench: Any, *, source: str = "",
              available_cores: float | None = None,
              flops_per_activation: float = FLOPS_PER_ACTIVATION_CPU,
              step_work_per_tensor: float = STEP_WORK_PER_TENSOR_CPU) -> Calibration:
    """Calibration from an np=1 ``result.json`` (dict) and a micro-benchmark (``run_comm_bench``'s
    dict, one ``comm_bench`` dict or a list of them).

        cal = calibrate(resultfile.load("runs/np1/result.json"), json.load(open("runs/bench.json")))

    ``available_cores``: on a shared machine, the CPU cores the np=1 run actually got (its CPU time
    over its wall time, when that is below its threads); its times are scaled back to a run that got
    every core it asked for. None (the default) takes the run as it was. ``flops_per_activation``:
    see ``FLOPS_PER_ACTIVATION_CPU`` (0 makes compute time scale with FLOPs alone);
    ``step_work_per_tensor``: see ``STEP_WORK_PER_TENSOR_CPU`` (0: compute proportional to the batch).
    """
    if int(np1_result.get("np", 0)) != 1:
        raise ConfigError(f"calibrate needs the result of an np=1 run; this one has "
                         f"np={np1_result.get('np')}")
    cfg = np1_result["config"]
    # what the run recorded about its model: its builder's code is not run again to measure it
    remember(np1_result.get("model_profile"))
    model, width, ts = cfg["model"], float(cfg["width"]), cfg.get("timesteps")
    b = int(np1_result["per_rank_batch"])
    t = _run_times(np1_result)
    fit = fit_alpha_beta(comm_bench)
    runs = _bench_runs(comm_bench)
    env = np1_result.get("env", {})
    threads = int(np1_result["threads"])
    cores = int(env.get("cpu_count") or os.cpu_count())
    # the share of the run's time it would have taken with all the cores it asked for
    idle = min(1.0, available_cores / threads) if available_cores else 1.0
    return Calibration(
        model=cfg["model"], width=float(cfg["width"]), per_rank_batch=b,
        threads=threads, cores_per_node=cores,
        flops_per_image=flops_per_image(model, width, ts),
        compute_s_per_image=idle * t["step"] / b, data_s_per_image=idle * t["data"] / (t["steps"] * b),
        eval_s_per_image=idle * t["eval"],
        step_overhead_s=idle * max(0.0, (t["time"] - t["compute"] - t["data"]) / t["steps"]),
        # signed: in a process that has already run torch the first step is not slower, and the
        # np=1 prediction must still give back the run it came from
        warmup_s=idle * (t["first"] - t["step"]),
        compute_cv=t["cv"],
        alpha=fit["alpha"], beta=fit["beta"], fit_rel_rms=fit["rel_rms"],
        oversub_alpha=fit["oversub_alpha"], available_cores=float(available_cores or 0.0),
        bench_nps=tuple(int(r["np"]) for r in runs), mpi_library=str(runs[0].get("mpi_library", "")),
        host=",".join(env.get("hostnames", [])[:1]), source=source,
        activations_per_image=float(activations_per_image(model, width, ts)),
        gradient_layout=tuple(gradient_layout(model, width)), bn_channels=tuple(bn_channels(model, width)),
        flops_per_activation=float(flops_per_activation),
        step_work_per_tensor=float(step_work_per_tensor))


def _run_times(np1_result: Mapping[str, Any]) -> dict:
    """The np=1 run's times: its steady compute step (the steps after the first), the first step, its
    epochs' totals, an evaluation's seconds per test image; ConfigError for fewer than 3 steps."""
    comp = list(np1_result["steps"]["compute"])
    if len(comp) < 3:
        raise ConfigError("the np=1 run is too short to calibrate from: give it at least 3 steps")
    steady = comp[1:]
    c_step = statistics.fmean(steady)
    epochs = np1_result["epochs"]
    evals = [e for e in epochs if e.get("test_acc") is not None]
    n_test = int(np1_result["data"]["n_test"])
    return {"step": c_step, "first": comp[0], "steps": sum(e["steps"] for e in epochs),
            "time": sum(e["time"] for e in epochs), "compute": sum(e["compute"] for e in epochs),
            "data": sum(e["data"] for e in epochs),
            "eval": (statistics.fmean(e["eval_time"] for e in evals) / n_test) if evals else 0.0,
            "cv": statistics.pstdev(steady) / c_step if len(steady) > 1 else 0.0}


def this_box(cal: Calibration) -> Cluster:
    """The calibrated machine: one node, all ranks on it, intra-node link from the fit."""
    link = Link(cal.alpha, cal.beta)
    work = cal.flops_per_image + cal.flops_per_activation * cal.activations_per_image
    # the calibration step did b images of work plus the per-step part, in b x compute_s_per_image
    step_fixed = cal.step_work_per_tensor * len(cal.gradient_layout or gradient_layout(cal.model, cal.width))
    return Cluster(
        name="this_box", nodes=1, ranks_per_node=0, cores_per_node=cal.cores_per_node,
        ref_threads=cal.threads,
        train_gflops=(work + step_fixed / cal.per_rank_batch) / cal.compute_s_per_image / 1e9,
        eval_gflops=(work / 3) / cal.eval_s_per_image / 1e9 if cal.eval_s_per_image else 1e9,
        flops_per_activation=cal.flops_per_activation, step_work_per_tensor=cal.step_work_per_tensor,
        data_s_per_image=cal.data_s_per_image, step_overhead_s=cal.step_overhead_s,
        warmup_s=cal.warmup_s, compute_cv=cal.compute_cv, intra=link, inter=link, gamma=0.0,
        algorithm="mpich", oversub_alpha=cal.oversub_alpha,
        notes=f"calibrated: {cal.source or 'np=1 run'} + comm bench at np "
              f"{','.join(map(str, cal.bench_nps))} ({cal.mpi_library})")


def cluster_from_calibration(cal: Calibration, *, nodes: int, ranks_per_node: int,
                             inter_bench=None, inter: Link | None = None, **overrides) -> Cluster:
    """Your own cluster: compute and the intra-node link from ``cal`` (one node), the inter-node link
    from a micro-benchmark with one rank per node (``inter_bench``) or given as ``inter``.

        python -m pilab perfmodel bench --np 2 --launcher-args "-ppn 1 -hosts n01,n02" --out inter.json
        cluster_from_calibration(cal, nodes=24, ranks_per_node=2, inter_bench=json.load(open("inter.json")))
    """
    if inter is None:
        if inter_bench is None:
            raise ConfigError("give inter_bench (a one-rank-per-node micro-benchmark) or inter=Link(...)")
        fit = fit_alpha_beta(inter_bench)
        inter = Link(fit["alpha"], fit["beta"])
    base = dataclasses.replace(this_box(cal), name="calibrated_cluster", nodes=nodes,
                               ranks_per_node=ranks_per_node, inter=inter)
    return dataclasses.replace(base, **overrides)
