"""Validate pilab.perfmodel here: calibrate from a real np=1 run + micro-benchmark, predict held-out runs.

    python benchmarks/bench_perfmodel.py                       # ~3 min on 2 busy cores
    python benchmarks/bench_perfmodel.py --repeat 2 --out runs/bench_perfmodel.json

1. the Allreduce micro-benchmark at np=2 and 3 (``pilab perfmodel bench``) -> alpha, beta;
2. a real np=1 run (MobileNetV2-CIFAR width 0.25, 32 images/rank, one thread) -> the calibration;
3. held-out real runs -- np=2, np=3, np=2 at width 0.5, np=2 at 16 images/rank -- each ~10-40 s;
4. predicted vs measured training time of the epoch (``epochs[0].time``, first-step warm-up included)
   and evaluation time, with the error in percent.

``--split`` first measures, in this process, one-thread training steps of MobileNetV2-CIFAR at widths
0.25, 0.5 and 1.0 and batches 4 to 64, and fits step time = (per-step work + batch x (FLOPs + k x
activation elements)) / rate: k and the per-step work are the model constants
``perfmodel.FLOPS_PER_ACTIVATION_CPU`` and ``STEP_WORK_PER_TENSOR_CPU`` (how compute time moves with
width and with the per-rank batch; the np=1 run calibrates its level).

The machine may be shared (Linux's autogroup scheduling gives each busy session an equal share of the
cores, however many threads it runs). So each run's CPU seconds over its wall seconds -- the cores the job
actually got -- are measured too. Column "as calibrated" is the model with the np=1 run taken as it was and
all cores free; "share-aware" scales the np=1 run to the cores it got and tells the model the cores the
held-out job got (``Cluster.available_cores``). MPICH ranks spin while they wait, so the cores a job
"got" include some waiting. Nothing here asserts on timings.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pilab import perfmodel  # noqa: E402
from pilab.config import Config  # noqa: E402

BASE = dict(width=0.25, batch_size=32, train_subset=960, test_subset=200, epochs=1, threads=1)
HELD_OUT = [
    ("np2", 2, {}),
    ("np3", 3, {}),
    ("np2 width 0.5", 2, {"width": 0.5}),
    ("np2 batch 16", 2, {"batch_size": 16}),
]


def cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the ranks mpiexec waited for
    return ru.ru_utime + ru.ru_stime


def train(np_: int, settings: dict, out: str, mpiexec: str | None) -> tuple[dict, float]:
    """One real run (``pilab.harness`` on np ranks, as ``pilab train`` runs them; np=1 under
    ``mpiexec -n 1`` too, like the study's np=1 point); returns (result, cores the job got on average)."""
    from pilab.launch import run_job
    env = dict(os.environ, OMP_NUM_THREADS=str(settings.get("threads", 1)))
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    result = run_job(np_, "pilab.harness", {"config": Config(out=out, **settings).to_dict()},
                     name=f"train np={np_}", mpiexec=mpiexec, env=env, cwd=REPO)
    cores = (cpu_seconds() - cpu0) / (time.perf_counter() - t0)
    return result, cores


def compute_split(points=((0.25, 4), (0.25, 8), (0.25, 16), (0.25, 32), (0.25, 64), (0.5, 4), (0.5, 8),
                          (0.5, 16), (0.5, 32), (0.5, 64), (1.0, 16), (1.0, 32)),
                  steps: int = 6) -> dict:
    """Fit one-thread step time = (per-step work + batch x (FLOPs + k x activations)) / rate over
    (width, batch) points: k is FLOPS_PER_ACTIVATION_CPU, the per-step work over the model's parameter
    tensors is STEP_WORK_PER_TENSOR_CPU."""
    import numpy as np
    import torch

    from pilab.models import activation_elements, build_model, train_flops_per_image

    torch.set_num_threads(1)
    torch.manual_seed(0)
    n_tensors = len(perfmodel.gradient_layout("mobilenetv2_cifar", 1.0))
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
        rows.append({"width": w, "batch": batch,
                     "activations": activation_elements("mobilenetv2_cifar", w),
                     "flops": train_flops_per_image("mobilenetv2_cifar", w),
                     "step_s": statistics.median(times[1:])})  # median: robust on a shared box
    A = np.array([[1.0, r["batch"] * r["flops"], r["batch"] * r["activations"]] for r in rows])
    t = np.array([r["step_s"] for r in rows])
    # least squares on relative errors: small steps count as much as large ones
    (fixed, per_flop, per_act), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
    for r, fit in zip(rows, A @ np.array([fixed, per_flop, per_act])):
        r["fit_err_pct"] = pct(fit, r["step_s"])
    return {"rows": rows, "step_fixed_s": fixed, "s_per_flop": per_flop, "s_per_activation": per_act,
            "flops_per_activation": per_act / per_flop,
            "step_work_per_tensor": fixed / per_flop / n_tensors}


def pct(pred: float, meas: float) -> float:
    return 100 * (pred - meas) / meas


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=1,
                   help="repeat calibration + held-out runs this many times (default 1)")
    p.add_argument("--bench-nps", type=int, nargs="+", default=[2, 3],
                   help="np of the Allreduce micro-benchmark (default 2 3)")
    p.add_argument("--mpiexec", default=None, help="launcher (default: next to this Python)")
    p.add_argument("--out", default=None, help="write every number as JSON here")
    p.add_argument("--split", action="store_true",
                   help="first measure how compute time moves with width and batch (~1 min)")
    p.add_argument("--split-only", action="store_true", help="only that measurement")
    args = p.parse_args(argv)

    split = None
    if args.split or args.split_only:
        split = compute_split()
        for r in split["rows"]:
            print(f"width {r['width']}, batch {r['batch']}: {r['activations'] / 1e6:.2f} M "
                  f"activations and {r['flops'] / 1e6:.0f} MFLOP per image, step "
                  f"{r['step_s'] * 1e3:.1f} ms (fit {r['fit_err_pct']:+.1f}%)")
        print(f"per-step fixed {split['step_fixed_s'] * 1e3:.1f} ms; flops per activation "
              f"{split['flops_per_activation']:.0f} (perfmodel.FLOPS_PER_ACTIVATION_CPU = "
              f"{perfmodel.FLOPS_PER_ACTIVATION_CPU:.0f}); step work per tensor "
              f"{split['step_work_per_tensor']:.3g} (STEP_WORK_PER_TENSOR_CPU = "
              f"{perfmodel.STEP_WORK_PER_TENSOR_CPU:.3g})\n")
        if args.split_only:
            return 0

    bench = perfmodel.run_comm_bench(args.bench_nps, mpiexec=args.mpiexec)
    fit = bench["fit"]
    print(f"micro-benchmark (np {' '.join(map(str, args.bench_nps))}): "
          f"alpha {fit['alpha'] * 1e6:.1f} us, beta "
          f"{fit['beta'] * 1e9:.3f} ns/B ({fit['bandwidth_MBps'] or 0:.0f} MB/s), fit rms "
          f"{100 * fit['rel_rms']:.0f}%; oversubscribed extra {fit['oversub_alpha'] * 1e6:.0f} us/round")

    rows, cals = [], []
    with tempfile.TemporaryDirectory(prefix="pilab-bench-pm-") as tmp:
        for rep in range(args.repeat):
            r1, got1 = train(1, BASE, os.path.join(tmp, f"np1_{rep}"), args.mpiexec)
            cal_idle = perfmodel.calibrate(r1, bench, source="np=1 run")
            cal_load = perfmodel.calibrate(r1, bench, source="np=1 run", available_cores=got1)
            cals.append({"as_calibrated": cal_idle.to_dict(), "share_aware": cal_load.to_dict(),
                         "np1_time": r1["epochs"][0]["time"], "np1_cores_got": got1})
            print(f"\nrepeat {rep + 1}: np=1 epoch {r1['epochs'][0]['time']:.2f} s, the job got "
                  f"{got1:.2f} cores -> {cal_idle.compute_s_per_image * 1e3:.2f} ms/image as run, "
                  f"{cal_load.compute_s_per_image * 1e3:.2f} ms/image with its core to itself")
            for name, np_, change in HELD_OUT:
                settings = {**BASE, **change}
                res, got = train(np_, settings, os.path.join(tmp, f"{name.replace(' ', '_')}_{rep}"),
                                 args.mpiexec)
                cfg = Config(**settings)
                idle = perfmodel.predict(cfg, np_, cal_idle)
                demand = np_ * settings["threads"]
                box = perfmodel.this_box(cal_load)
                if got < 0.95 * min(demand, box.cores_per_node):  # the job did not get what it wanted
                    box = dataclasses.replace(box, available_cores=got)
                aware = perfmodel.predict(cfg, np_, box)
                ep = res["epochs"][0]
                rows.append({
                    "repeat": rep + 1, "run": name, "np": np_, "width": cfg.width,
                    "batch": cfg.batch_size, "cores_got": got,
                    "measured_time": ep["time"], "predicted_time_idle": idle["first_epoch_time"],
                    "err_idle_pct": pct(idle["first_epoch_time"], ep["time"]),
                    "predicted_time_share_aware": aware["first_epoch_time"],
                    "err_share_aware_pct": pct(aware["first_epoch_time"], ep["time"]),
                    "measured_eval": ep["eval_time"], "predicted_eval_share_aware": aware["eval_time"],
                    "err_eval_pct": pct(aware["eval_time"], ep["eval_time"]),
                    "measured_compute": ep["compute"], "predicted_compute": aware["compute"],
                    "measured_comm_exposed": ep["comm_exposed"],
                    "predicted_comm_exposed": aware["comm_exposed"],
                })

    print("\npredicted vs measured training time of the epoch (seconds; err = (pred - meas) / meas)")
    head = (f"{'run':<15}{'rep':>4}{'cores':>6}{'measured':>10}{'as calib.':>10}{'err':>7}"
            f"{'share-aware':>12}{'err':>7}{'eval meas':>11}{'pred':>7}{'err':>7}")
    print(head)
    for r in rows:
        print(f"{r['run']:<15}{r['repeat']:>4}{r['cores_got']:>6.2f}{r['measured_time']:>10.2f}"
              f"{r['predicted_time_idle']:>10.2f}{r['err_idle_pct']:>6.0f}%"
              f"{r['predicted_time_share_aware']:>12.2f}{r['err_share_aware_pct']:>6.0f}%"
              f"{r['measured_eval']:>11.2f}{r['predicted_eval_share_aware']:>7.2f}{r['err_eval_pct']:>6.0f}%")
    for key in ("err_idle_pct", "err_share_aware_pct"):
        errs = [abs(r[key]) for r in rows]
        within = sum(e <= 15 for e in errs)
        print(f"{key}: median |err| {statistics.median(errs):.0f}%, within 15%: {within}/{len(errs)}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"split": split, "bench": bench, "calibrations": cals, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
