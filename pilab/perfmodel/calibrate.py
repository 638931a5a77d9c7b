"""Calibration: what an np=1 run and the Allreduce micro-benchmark say about this machine, and the
Cluster built from it (``this_box``, or your own nodes with ``cluster_from_calibration``).

    from pilab.perfmodel import calibrate, this_box
    from pilab import resultfile
    from pilab.files import load_json
    cal = calibrate(resultfile.load("runs/np1/result.json"), load_json("runs/perfmodel/comm_bench.json"))
    cal.save("runs/perfmodel/calibration.json")
    this_box(cal).train_gflops                 # achieved GFLOP/s per rank in the np=1 run

The alpha-beta fit: latency and bandwidth from Allreduce micro-benchmark timings.

    from pilab.perfmodel import fit_alpha_beta
    fit = fit_alpha_beta(json.load(open("runs/perfmodel/comm_bench.json")))
    fit["alpha"], fit["beta"], fit["rel_rms"]     # s/message, s/byte, how well the model fits

The Allreduce micro-benchmark: ``comm_bench`` times Allreduce on every rank of an MPI job,
``run_comm_bench`` launches such jobs (``pilab.perfmodel.calibrate`` on every rank) at several np and fits
alpha and beta.

    python -m pilab perfmodel bench --np 2,3          # = run_comm_bench((2, 3)); writes the JSON

    from pilab.perfmodel import run_comm_bench
    res = run_comm_bench((2, 3))                      # {"runs": [...], "fit": fit_alpha_beta(...)}

The micro-benchmark's rank side: every rank of the job runs this module, rank 0 writes the timings::

    mpiexec -n 2 python -m pilab.perfmodel.calibrate OUT.json --sizes 4 1024 65536

``run_comm_bench`` launches it once per np (``pilab.launch.run_job``); :func:`comm_bench` does the
timing. A module of its own so that ``pilab perfmodel bench`` has no hidden rank-side flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..config import ConfigError
from ..files import load_json, save_json
from ..launch import mpi, mpi_library, run_job
from .allreduce import critical_counts
from .layout import activations_per_image, bn_channels, flops_per_image, gradient_layout, remember
from .machine import FLOPS_PER_ACTIVATION_CPU, STEP_WORK_PER_TENSOR_CPU, Cluster, Link


def _bench_runs(bench) -> list[dict]:
    """Accept one comm_bench dict, a list of them, or run_comm_bench's {"runs": [...]}."""
    if isinstance(bench, Mapping) and "runs" in bench:
        return list(bench["runs"])
    if isinstance(bench, Mapping):
        return [dict(bench)]
    return list(bench)


def _oversubscribed(run: Mapping[str, Any]) -> bool:
    cores = run.get("cores")
    return bool(cores) and int(run.get("ranks_per_node", run["np"])) > int(cores)


def _wls(rows, use_alpha: bool = True, use_beta: bool = True):
    """Weighted (1/t: relative error) least squares of t ~ n_a*alpha + n_b*beta, both kept >= 0."""
    def solve(ua, ub):
        a11 = a12 = a22 = b1 = b2 = 0.0
        for t, n_a, n_b in rows:
            x1, x2 = (n_a / t if ua else 0.0), (n_b / t if ub else 0.0)
            a11 += x1 * x1
            a12 += x1 * x2
            a22 += x2 * x2
            b1 += x1
            b2 += x2
        if ua and ub:
            det = a11 * a22 - a12 * a12
            if det <= 1e-12 * (a11 * a22 or 1.0):
                return None
            return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        if ua:
            return (b1 / a11 if a11 else 0.0), 0.0
        return 0.0, (b2 / a22 if a22 else 0.0)

    if use_alpha and use_beta:
        sol = solve(True, True)
        if sol is not None and sol[0] >= 0 and sol[1] >= 0:
            return sol
        a_only, b_only = solve(True, False), solve(False, True)

        def cost(ab):
            return sum(((n_a * ab[0] + n_b * ab[1]) / t - 1) ** 2 for t, n_a, n_b in rows)
        return min((a_only, b_only), key=cost)
    return solve(use_alpha, use_beta)


def fit_alpha_beta(bench, algorithm: str = "mpich", short_msg_bytes: int = 2048, *,
                   min_bytes: int = 0, stat: str = "seconds") -> dict:
    """Least-squares alpha (s/message) and beta (s/byte) from micro-benchmark timings.

    Each timing is modelled as ``rounds * alpha + critical_bytes * beta`` for the schedule of
    ``algorithm`` (one node: one link type), minimising relative residuals (sizes span 4 B..16 MiB),
    both kept >= 0.

    ``min_bytes`` leaves out the smaller messages. Where their cost is not ``alpha + n * beta`` -- on a
    loaded machine a few-byte Allreduce over TCP costs what the scheduler takes to wake the peer, and
    1 KiB may cost twice 4 B -- relative least squares trades beta against them and can put the
    bandwidth above the link's line rate (a 100 Mbit/s testbed link fitted at 15 MB/s over 4 B..4 MiB,
    12.4 MB/s over 16 KiB..4 MiB). Fit the link that carries gradient buckets over the sizes they
    have: ``fit_alpha_beta(inter_bench, min_bytes=16 * 1024)``. ``stat``: ``"seconds"`` (the median
    over trials) or ``"seconds_min"`` (the fastest trial: other work only ever adds time). Runs with more ranks than cores (oversubscribed: a busy-polling peer may be
    descheduled) are left out of that fit and give ``oversub_alpha`` instead: the extra seconds per
    round they need. Returns {"alpha", "beta", "oversub_alpha", "rel_rms", "points": [...]}.
    """
    if stat not in ("seconds", "seconds_min"):
        raise ConfigError(f"stat={stat!r}: 'seconds' (median over trials) or 'seconds_min'")
    rows = []
    for run in _bench_runs(bench):
        p = int(run["np"])
        over = _oversubscribed(run)
        for nbytes, t in zip(run["sizes_bytes"], run.get(stat) or run["seconds"]):
            n_a, n_b = critical_counts(p, nbytes, algorithm, short_msg_bytes)
            if n_a and t > 0 and nbytes >= min_bytes:
                rows.append((p, nbytes, t, n_a, n_b, over))
    if not rows:
        raise ConfigError("no usable timings: the benchmark needs np >= 2")
    fit_rows = [r for r in rows if not r[5]] or rows
    alpha, beta = _wls([(t, n_a, n_b) for _, _, t, n_a, n_b, _ in fit_rows])
    over_rows = [r for r in rows if r[5]] if len(fit_rows) < len(rows) else []
    oversub_alpha = 0.0
    if over_rows:
        # median extra per round: robust to the scheduler's erratic wake-ups
        oversub_alpha = max(0.0, statistics.median(
            (t - (n_a * alpha + n_b * beta)) / n_a for _, _, t, n_a, n_b, _ in over_rows))
    points = []
    for p, nbytes, t, n_a, n_b, over in rows:
        model = n_a * (alpha + (oversub_alpha if over else 0.0)) + n_b * beta
        points.append({"np": p, "bytes": nbytes, "measured_s": t, "model_s": model,
                       "rel_err": (model - t) / t, "oversubscribed": over})

    def rms(pts):
        return math.sqrt(sum(pt["rel_err"] ** 2 for pt in pts) / len(pts)) if pts else None
    return {"alpha": alpha, "beta": beta, "oversub_alpha": oversub_alpha,
            "bandwidth_MBps": (1 / beta / 1e6) if beta > 0 else None, "algorithm": algorithm,
            "rel_rms": rms([pt for pt in points if not pt["oversubscribed"]] or points),
            "rel_rms_oversubscribed": rms([pt for pt in points if pt["oversubscribed"]]),
            "points": points}


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


DEFAULT_SIZES = (4, 64, 1024, 16 * 1024, 128 * 1024, 2 ** 20, 4 * 2 ** 20, 16 * 2 ** 20)


def comm_bench(comm, sizes: Sequence[int] = DEFAULT_SIZES, *, trials: int = 5,
               min_time: float = 0.03, max_reps: int = 2000) -> dict:
    """Time ``Allreduce`` (in place, float32, SUM) of each size in bytes; call on every rank.

        mpiexec -n 2 python -c "from mpi4py import MPI; from pilab.perfmodel import comm_bench; \\
            print(comm_bench(MPI.COMM_WORLD))"

    Each trial repeats the call enough times to last ``min_time`` (the same count on every rank) and
    keeps the slowest rank's time per call; the median over ``trials`` is reported. Returns the same
    dict on every rank.
    """
    # on the ranks of a launched job only: importing mpi4py initialises MPI, which a process that only
    # predicts or launches must not do
    from ..launch import mpi
    MPI = mpi()

    size = comm.Get_size()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_size()
    node.Free()
    hosts = comm.allgather(MPI.Get_processor_name())
    med, best = [], []
    import numpy as np  # here, not at import: `python -m pilab --help` loads this module

    for nbytes in sizes:
        buf = np.zeros(max(1, int(nbytes) // 4), dtype=np.float32)
        for _ in range(2):  # warm up: connections, registration
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        one = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
        reps = int(min(max_reps, max(1, min_time / max(one, 1e-7))))
        per = []
        for _ in range(trials):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            per.append(comm.allreduce((time.perf_counter() - t) / reps, op=MPI.MAX))
        med.append(statistics.median(per))
        best.append(min(per))
    return {
        "np": size, "ranks_per_node": local, "cores": os.cpu_count(), "hosts": sorted(set(hosts)),
        "sizes_bytes": [int(s) for s in sizes], "seconds": med, "seconds_min": best,
        "trials": trials, "mpi_library": mpi_library(MPI),
        "thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                         MPI.THREAD_SERIALIZED: "serialized",
                         MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?"),
    }


def run_comm_bench(nps: Iterable[int] = (2, 3), *, sizes: Sequence[int] = DEFAULT_SIZES,
                   mpiexec: str | None = None, env: Mapping[str, str] | None = None,
                   timeout: float = 300, extra_args: Sequence[str] = ()) -> dict:
    """Launch ``mpiexec -n p`` for each p, run ``comm_bench`` there, merge, and fit alpha and beta.

        run_comm_bench((2,), extra_args=["-ppn", "1", "-hosts", "n01,n02"])   # the inter-node link

    Returns {"runs": [bench at each np], "fit": fit_alpha_beta(...)}; the JSON the CLI writes.
    ``env``: the jobs' whole environment (default: this process's). Raises ``ConfigError`` for an np
    below 2 or a size below 1 byte, ``LaunchError`` without a launcher, ``launch.JobError`` (a
    RuntimeError, with the job's exit code and stderr) when a launched job fails or times out.
    """
    nps = [int(p) for p in nps]
    if not nps or min(nps) < 2:
        raise ConfigError(f"nps={nps}: every np must be >= 2 (an Allreduce needs two ranks)")
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"sizes={list(sizes)}: message sizes are bytes >= 1")
    # each np is one job whose ranks run pilab.perfmodel.calibrate (comm_bench); rank 0 answers
    runs = [run_job(p, "pilab.perfmodel.calibrate", {"sizes": list(sizes)}, name=f"comm bench at np={p}",
                    mpiexec=mpiexec, extra=extra_args, env=env, timeout=timeout) for p in nps]
    return {"runs": runs, "fit": fit_alpha_beta(runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="time Allreduce on every rank of this job (run under mpiexec)")
    p.add_argument("out", help="where rank 0 writes the timings (JSON)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="message sizes in bytes")
    a = p.parse_args(argv)
    comm = mpi().COMM_WORLD  # on the ranks of a launched job only: importing mpi4py initialises MPI
    res = comm_bench(comm, a.sizes)
    if comm.Get_rank() == 0:
        save_json(res, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
