"""The ``perfmodel`` section: ``pilab.perfmodel`` calibrated here from a real np=1 run and the Allreduce
micro-benchmark, then its predictions against held-out real runs::

    python -m pilab bench --sections perfmodel          # ~4 min on 2 busy cores (not in the default set)

1. ``split``: one-thread training steps of MobileNetV2-CIFAR at widths 0.25-1.0 and batches 4-64 in this
   process, fitted as step time = (per-step work + batch x (FLOPs + k x activation elements)) / rate:
   k and the per-step work are the model constants ``perfmodel.FLOPS_PER_ACTIVATION_CPU`` and
   ``STEP_WORK_PER_TENSOR_CPU`` (how compute time moves with width and with the per-rank batch);
2. the micro-benchmark at np=2 and 3 (``perfmodel.run_comm_bench``) -> alpha, beta;
3. a real np=1 run (width 0.25, 32 images per rank, one thread) -> the calibration;
4. held-out real runs (np=2, np=3, np=2 at width 0.5, np=2 at 16 images per rank), each a
   ``pilab.engine.harness`` job like the study's points, predicted vs measured: the training time of the
   epoch (``epochs[0].time``, first-step warm-up included) and the evaluation time.

The machine may be shared (Linux's autogroup scheduling gives each busy session an equal share of the
cores, however many threads it runs), so each job's CPU seconds over its wall seconds -- the cores it
actually got -- are measured too. "as calibrated" is the model with the np=1 run taken as it was and all
cores free; "share-aware" scales the np=1 run to the cores it got and tells the model the cores the
held-out job got (``Cluster.available_cores``). MPICH ranks spin while they wait, so the cores a job
"got" include some waiting. Nothing here asserts on timings.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import tempfile
import time

from .. import perfmodel as pm
from ..config import Config
from ..launch import run_job

BASE = dict(width=0.25, batch_size=32, train_subset=960, test_subset=200, epochs=1, threads=1)
HELD_OUT = [("np2", 2, {}), ("np3", 3, {}), ("np2 width 0.5", 2, {"width": 0.5}),
            ("np2 batch 16", 2, {"batch_size": 16})]
SPLIT_POINTS = ((0.25, 4), (0.25, 8), (0.25, 16), (0.25, 32), (0.25, 64), (0.5, 4), (0.5, 8), (0.5, 16),
                (0.5, 32), (0.5, 64), (1.0, 16), (1.0, 32))


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the ranks mpiexec waited for
    return ru.ru_utime + ru.ru_stime


def train(np_: int, cfg: Config, mpiexec: str | None = None, *, hang_s: float | None = None,
          **job) -> tuple[dict, float]:
    """One real run (``pilab.engine.harness`` on np ranks, as ``pilab train`` runs them; np=1 under
    ``mpiexec -n 1`` like the study's np=1 point); (result, cores the job got on average). ``job``:
    more keywords for ``launch.run_job`` (``extra``, ``env``, ``timeout``)."""
    job.setdefault("env", dict(os.environ, OMP_NUM_THREADS=str(cfg.threads)))
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    result = run_job(np_, "pilab.engine.harness", {"config": cfg.to_dict(), "hang_s": hang_s},
                     name=f"train np={np_}", mpiexec=mpiexec, **job)
    return result, (cpu_seconds() - cpu0) / (time.perf_counter() - t0)


def compute_split(points=SPLIT_POINTS, steps: int = 6) -> dict:
    """Fit one-thread step time = (per-step work + batch x (FLOPs + k x activations)) / rate over
    (width, batch) points: k is FLOPS_PER_ACTIVATION_CPU, the per-step work over the model's parameter
    tensors is STEP_WORK_PER_TENSOR_CPU."""
    import numpy as np
    import torch

    from ..models.zoo import activation_elements, build_model, train_flops_per_image

    torch.set_num_threads(1)
    torch.manual_seed(0)
    n_tensors = len(pm.gradient_layout("mobilenetv2_cifar", 1.0))
    rows = []
    for w, batch in points:
        model = build_model("mobilenetv2_cifar", num_classes=10, width=w)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        rows.append({"width": w, "batch": batch, "activations": activation_elements("mobilenetv2_cifar", w),
                     "flops": train_flops_per_image("mobilenetv2_cifar", w),
                     "step_s": statistics.median(times[1:])})  # median: robust on a shared box
    A = np.array([[1.0, r["batch"] * r["flops"], r["batch"] * r["activations"]] for r in rows])
    t = np.array([r["step_s"] for r in rows])
    # least squares on relative errors: small steps count as much as large ones
    (fixed, per_flop, per_act), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
    for r, fit in zip(rows, A @ np.array([fixed, per_flop, per_act])):
        r["fit_err_pct"] = pct(fit, r["step_s"])
    return {"rows": rows, "step_fixed_s": fixed, "s_per_flop": per_flop, "s_per_activation": per_act,
            "flops_per_activation": per_act / per_flop, "step_work_per_tensor": fixed / per_flop / n_tensors,
            "model_constants": {"flops_per_activation": pm.FLOPS_PER_ACTIVATION_CPU,
                                "step_work_per_tensor": pm.STEP_WORK_PER_TENSOR_CPU}}


def pct(pred: float, meas: float) -> float:
    return 100 * (pred - meas) / meas


def section(quick: bool = False, mpiexec: str | None = None, *, repeat: int = 1, log=print) -> dict:
    """The whole section (quick: three split points, a tiny data set, np=2 only); its dict."""
    base = dict(BASE, train_subset=256, test_subset=100) if quick else BASE
    held_out = HELD_OUT[:1] if quick else HELD_OUT
    log("bench: perfmodel: compute split")
    split = compute_split(((0.25, 4), (0.25, 16), (0.5, 8)) if quick else SPLIT_POINTS, steps=3 if quick else 6)
    bench_nps = (2,) if quick else (2, 3)
    bench = pm.run_comm_bench(bench_nps, mpiexec=mpiexec)
    rows, cals = [], []
    with tempfile.TemporaryDirectory(prefix="pilab-bench-pm-") as tmp:
        for rep in range(repeat):
            r1, got1 = train(1, Config(out=os.path.join(tmp, f"np1_{rep}"), **base), mpiexec)
            cal_idle = pm.calibrate(r1, bench, source="np=1 run")
            cal_load = pm.calibrate(r1, bench, source="np=1 run", available_cores=got1)
            cals.append({"as_calibrated": cal_idle.to_dict(), "share_aware": cal_load.to_dict(),
                         "np1_time": r1["epochs"][0]["time"], "np1_cores_got": got1})
            log(f"bench: perfmodel: np=1 epoch {r1['epochs'][0]['time']:.2f} s, {got1:.2f} cores")
            for name, np_, change in held_out:
                cfg = Config(**{**base, **change})
                out = os.path.join(tmp, f"{name.replace(' ', '_')}_{rep}")
                res, got = train(np_, dataclasses.replace(cfg, out=out), mpiexec)
                idle = pm.predict(cfg, np_, cal_idle)
                box = pm.this_box(cal_load)
                if got < 0.95 * min(np_ * cfg.threads, box.cores_per_node):  # it got less than it wanted
                    box = dataclasses.replace(box, available_cores=got)
                aware = pm.predict(cfg, np_, box)
                ep = res["epochs"][0]
                rows.append({
                    "repeat": rep + 1, "run": name, "np": np_, "width": cfg.width, "batch": cfg.batch_size,
                    "cores_got": got, "measured_time": ep["time"],
                    "predicted_time_idle": idle["first_epoch_time"],
                    "err_idle_pct": pct(idle["first_epoch_time"], ep["time"]),
                    "predicted_time_share_aware": aware["first_epoch_time"],
                    "err_share_aware_pct": pct(aware["first_epoch_time"], ep["time"]),
                    "measured_eval": ep["eval_time"], "predicted_eval_share_aware": aware["eval_time"],
                    "err_eval_pct": pct(aware["eval_time"], ep["eval_time"]),
                    "measured_compute": ep["compute"], "predicted_compute": aware["compute"],
                    "measured_comm_exposed": ep["comm_exposed"], "predicted_comm_exposed": aware["comm_exposed"]})
    summary = {}
    for key in ("err_idle_pct", "err_share_aware_pct"):
        errs = [abs(r[key]) for r in rows]
        summary[key] = {"median_abs": statistics.median(errs), "n": len(errs)}
    return {"base": base, "bench_nps": list(bench_nps), "split": split, "bench": bench, "calibrations": cals,
            "rows": rows, "summary": summary}
