"""The performance model against measurements: ``pilab bench``'s ``perfmodel`` and ``network`` sections'
model side.

The ``perfmodel`` section: ``pilab.perfmodel`` calibrated here from a real np=1 run and the Allreduce
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

The ``network`` section's analysis: the performance model against what :mod:`pilab.bench.network` measured
on the testbed, from the stored measurements only (no root, no runs)::

    from pilab.perfmodel import check
    print(check.report("benchmarks/results/bench_network.json"))

It says how far the model is from each point (median and worst |predicted / measured - 1|); a tolerance to
count the points within (a study's goal, e.g. experiments/network-model/goal.py) is the caller's.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import tempfile
import time

from .. import perfmodel as pm, testbed
from ..config import Config
from ..files import load_json
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

    from ..models import activation_elements, build_model, train_flops_per_image

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


# ----------------------------------------------------------------------------------------------
# the model's side (from the stored measurements only: --analyse redoes it without running anything)
# ----------------------------------------------------------------------------------------------
# What the section runs (pilab.bench.network runs it; the analysis below reads its settings)
TRAIN = dict(width=0.25, batch_size=8, train_subset=512, test_subset=100, epochs=1, threads=1)
COMM_BOUND = 0.30  # communication-bound: measured network time >= this share of the step
# Local SGD: each rank steps alone and the parameters are averaged every LOCAL_H steps (and at
# the epoch's end), so a step's exposed network time is the metrics' tiny Allreduce, and every H-th step
# the parameters': measured as the mean over the steps after the first (the median is a local step's).
# Twice the images of TRAIN, so that np=8 still averages twice. At LOCAL_RATE, the slowest link.
LOCAL_H, LOCAL_RATE = 8, "100mbit"
LOCAL_TRAIN = dict(TRAIN, train_subset=2 * TRAIN["train_subset"], local_steps=LOCAL_H)
FIT = {"min_bytes": 16 * 1024, "stat": "seconds"}  # see perfmodel.fit_alpha_beta


def inter_links(data: dict, fit=FIT) -> dict:
    """The inter-node link fitted per rate, from the 2-node x 1-rank micro-benchmarks: the training
    runs' rates first, then any other rate benchmarked so (the wire's)."""
    two = [b for b in data["bench"] if b["rate"] is not None and b["nodes"] == 2 and b["np"] == 2]
    rates = list(data.get("rates", [])) + sorted({b["rate"] for b in two} - set(data.get("rates", [])))
    return {rate: pm.fit_alpha_beta([b for b in two if b["rate"] == rate], **fit) for rate in rates}


def links(data: dict, fit=FIT) -> dict:
    """Fitted links: intra (one node), inter per rate (``inter_links``)."""
    intra_runs = [b for b in data["bench"] if b["nodes"] == 1]
    return {"intra": pm.fit_alpha_beta(intra_runs, **fit), "inter": inter_links(data, fit)}


def cluster_for(cal, fits, rate, np_, nodes, cores, cores_got=None):
    # every node of the testbed shares this machine's cores: a node gets cores / nodes of them
    # (share-aware: of the cores the job actually got)
    avail = (cores_got if cores_got else cores) / nodes
    inter = fits["inter"][rate]
    return pm.cluster_from_calibration(
        cal, nodes=nodes, ranks_per_node=np_ // nodes,
        inter=pm.Link(inter["alpha"], inter["beta"]), available_cores=avail)


def calibration(data: dict, **kw):
    """The model's calibration from the section's np=1 run on node01 and its one-node micro-benchmarks."""
    return pm.calibrate(data["np1"]["result"], [b for b in data["bench"] if b["nodes"] == 1],
                        source="testbed node01 np=1", **kw)


def analyse(data: dict) -> dict:
    fits = links(data)
    cores = data["cores"]
    np1 = data["np1"]
    cal = calibration(data)
    cal_share = calibration(data, available_cores=min(np1["cores_got"], TRAIN["threads"]))
    # the micro-benchmark's own held-out points: 1 MB Allreduce, predicted vs measured
    bench_rows = []
    for b in data["bench"]:
        if b["rate"] is None or (b["nodes"] == 2 and b["np"] == 2):
            continue
        cl = cluster_for(cal, fits, b["rate"], b["np"], b["nodes"], cores)
        crowded = b["np"] // b["nodes"] > cores / b["nodes"]
        for size, t in zip(b["sizes_bytes"], b["seconds"]):
            if size not in (128 * 1024, 2 ** 20, 4 * 2 ** 20):
                continue
            pred = pm.allreduce_time(size, b["np"], cl, None, crowded)
            pred_h = pm.allreduce_time(size, b["np"], cl, "hierarchical", crowded)
            bench_rows.append({"rate": b["rate"], "np": b["np"], "nodes": b["nodes"], "bytes": size,
                               "measured_s": t, "predicted_s": pred, "ratio": pred / t,
                               "predicted_hierarchical_s": pred_h})
    rows = []
    for r in data["train"]:
        np_, nodes, rate = r["np"], r["nodes"], r["rate"]
        h = r.get("local_steps", 1)
        cfg = Config(**(LOCAL_TRAIN if h > 1 else TRAIN))
        # a local-SGD run's network time comes every H-th step: its mean per step, not a local step's median
        measured = r["net_step_mean"] if h > 1 else r["net_step_median"]
        cl = cluster_for(cal, fits, rate, np_, nodes, cores)
        cl_s = cluster_for(cal_share, fits, rate, np_, nodes, cores, r["cores_got"])
        p = pm.predict(cfg, np_, cl, "pilab")
        ps = pm.predict(cfg, np_, cl_s, "pilab")
        net_pred = p["step"]["comm_exposed"]
        # the testbed's links are token buckets (pilab.testbed.burst_bytes), refilled while a step
        # computes: the first burst of each step's inter-node transfer passes at once
        credit = testbed.burst_bytes(rate) / (testbed.parse_rate(rate) / 8) if nodes > 1 else 0.0
        if r["compute_step_median"] < credit:
            credit = 0.0  # not idle long enough to refill
        if h > 1:  # only the averages move enough bytes to take the bucket's credit
            credit *= -(-p["steps_per_epoch"] // h) / p["steps_per_epoch"]
        share = measured / r["step_median"] if r["step_median"] else 0.0
        over = np_ > cores
        rows.append({
            "rate": rate, "np": np_, "nodes": nodes, "rep": r.get("rep", 1), "oversubscribed": over,
            "local_steps": h, "cores_got": r["cores_got"], "comm_share": share,
            "net_step_measured": measured, "net_step_predicted": net_pred,
            "net_ratio": net_pred / measured if measured > 0 else None,
            "tbf_credit": credit, "net_step_predicted_tbf": net_pred - credit,
            "net_ratio_tbf": (net_pred - credit) / measured if measured > 0 else None,
            "epoch_measured": r["epoch_time"], "epoch_predicted": p["time"],
            "epoch_ratio": p["time"] / r["epoch_time"],
            "epoch_predicted_share": ps["time"], "epoch_ratio_share": ps["time"] / r["epoch_time"],
            # what the network half is checked on: communication-bound (>= 30% of the step) across nodes;
            # local SGD: every multi-node point (its point is that the network no longer bounds it)
            "comm_bound": nodes > 1 and (h > 1 or share >= COMM_BOUND),
        })
    return {"links": {"intra": {k: fits["intra"][k] for k in ("alpha", "beta", "oversub_alpha", "rel_rms")},
                      "inter": {rate: {k: f[k] for k in ("alpha", "beta", "rel_rms", "bandwidth_MBps")}
                                for rate, f in fits["inter"].items()}},
            "calibration": cal.to_dict(), "bench_rows": bench_rows, "rows": rows}


def table(an: dict) -> str:
    head = ("| link | np | nodes | comm share | Allreduce/step measured ms | predicted ms | ratio | "
            "+ tbf credit ms | ratio | epoch measured s | predicted s | ratio | share-aware s | ratio |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 12]
    for r in sorted(an["rows"], key=lambda r: (r.get("local_steps", 1), r["rate"], r["np"], r["nodes"], r["rep"])):
        tag = (" (oversubscribed)" if r["oversubscribed"] else "") + \
            (f" local SGD H={r['local_steps']}" if r.get("local_steps", 1) > 1 else "")
        mark = "" if r["comm_bound"] else "*"
        lines.append(
            f"| {r['rate']} | {r['np']}{tag} | {r['nodes']} | {r['comm_share'] * 100:.0f}% | "
            f"{r['net_step_measured'] * 1e3:.1f} | {r['net_step_predicted'] * 1e3:.1f} | "
            f"{(r['net_ratio'] or 0):.2f}{mark} | {r['net_step_predicted_tbf'] * 1e3:.1f} | "
            f"{(r['net_ratio_tbf'] or 0):.2f}{mark} | {r['epoch_measured']:.2f} | {r['epoch_predicted']:.2f} | "
            f"{r['epoch_ratio']:.2f}{mark} | {r['epoch_predicted_share']:.2f} | {r['epoch_ratio_share']:.2f}{mark} |")
    return "\n".join(lines)


def bench_table(an: dict) -> str:
    lines = ["| link | np | nodes | bytes | measured ms | predicted ms | ratio | hierarchical ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in an["bench_rows"]:
        lines.append(f"| {b['rate'] or 'shm'} | {b['np']} | {b['nodes']} | {b['bytes']} | "
                     f"{b['measured_s'] * 1e3:.2f} | {b['predicted_s'] * 1e3:.2f} | {b['ratio']:.2f} | "
                     f"{b['predicted_hierarchical_s'] * 1e3:.2f} |")
    return "\n".join(lines)


def summary(an: dict, within: float | None = None) -> str:
    """The fitted links, then how far the model is from the communication-bound multi-node points
    (median and worst |predicted / measured - 1|); ``within`` (a tolerance, e.g. a study's goal): how many
    points are within it too."""
    local = [r for r in an["rows"] if r["comm_bound"] and r.get("local_steps", 1) > 1]
    bound = [r for r in an["rows"] if r["comm_bound"] and r.get("local_steps", 1) == 1]
    L = an["links"]
    parts = [f"intra: alpha {L['intra']['alpha'] * 1e6:.1f} us, {1 / L['intra']['beta'] / 1e6:.0f} MB/s"
             if L["intra"]["beta"] else "intra: beta 0"]
    for rate, f in L["inter"].items():
        parts.append(f"inter {rate}: alpha {f['alpha'] * 1e6:.0f} us, {f['bandwidth_MBps'] or 0:.1f} MB/s "
                     f"(fit rms {f['rel_rms'] * 100:.0f}%)")
    keys = (("Allreduce/step", "net_ratio"), ("with the tbf credit", "net_ratio_tbf"), ("epoch", "epoch_ratio"),
            ("epoch share-aware", "epoch_ratio_share"))
    text = "; ".join(parts) + (f"\ncommunication-bound (comm >= {COMM_BOUND:.0%} of the step, multi-node): "
                               f"{len(bound)} points; |predicted / measured - 1| "
                               + ", ".join(f"{name} {_errors(bound, k, within)}" for name, k in keys))
    if local:
        text += (f"\nlocal SGD H={LOCAL_H} at {LOCAL_RATE} (multi-node): {len(local)} points; network per step "
                 "(mean) " + ", ".join(f"{name} {_errors(local, k, within)}" for name, k in keys[:3]))
    return text


def _errors(rows: list[dict], key: str, within: float | None) -> str:
    """"median 8%, worst 31%" of |ratio - 1| over ``rows`` (with ``within``: "..., 5/7 within 20%")."""
    errs = [abs(r[key] - 1) for r in rows if r[key]]
    if not errs:
        return "—"
    text = f"median {statistics.median(errs):.0%}, worst {max(errs):.0%}"
    return text + (f", {sum(e <= within for e in errs)}/{len(rows)} within {within:.0%}" if within is not None else "")


def wire_rows(data: dict) -> list[dict]:
    """Each wire run against its bound: max(the ceiling, forward + the time the link needs for the
    Allreduce's bytes). A node's link carries 2(n-1)/n of the gradient's bytes each way for n nodes (a
    ring over the nodes, ranks of one node combined over shared memory: the least any Allreduce can
    send), at the rate fitted from the 2-node Allreduce micro-benchmark at that rate."""
    rows = []
    fits = inter_links(data) if data.get("wire") else {}
    for w in data.get("wire", []):
        fit = fits[w["rate"]]
        n = w["nodes"]
        link = fit["alpha"] + 2 * (n - 1) / n * w["gradient_bytes"] * fit["beta"]
        ceiling = w["step_s"]["ceiling"]["median"]
        bound = max(ceiling, w["forward_s"] + link)
        med = {k: v["median"] for k, v in w["step_s"].items()}
        rows.append({"rate": w["rate"], "np": w["np"], "nodes": n, "gradient_mb": w["gradient_bytes"] / 1e6,
                     "link_MBps": 1 / fit["beta"] / 1e6 if fit["beta"] else None, "link_s": link,
                     "forward_s": w["forward_s"], "bound_s": bound, "step_s": med,
                     "over_ceiling": w["over_ceiling"], "pilab_over_ddp": w["pilab_over_ddp"],
                     "over_bound": {k: v / bound for k, v in med.items()}})
    return rows


# the wire's contenders as the performance model sees them: (Config changes, pilab's metrics Allreduce);
# DDP as buckets filled the same way at its bucket size (25 MiB by default), no metrics exchange
WIRE_MODEL = {"pilab": ({}, True), "pilab_fp16": ({"compression": "fp16"}, True),
              "pilab_one_bucket": ({"bucket_mb": 64.0}, True), "ddp_gloo": ({"bucket_mb": 25.0}, False),
              "ddp_gloo_1mb": ({"bucket_mb": 1.0}, False)}


def wire_model_rows(data: dict) -> list[dict]:
    """The performance model against each contender of each wire run (``perfmodel.exchange``): the
    measured ceiling as the step's compute (its forward measured too), the links fitted as for the
    training runs (the wire's rate from its 2-node micro-benchmark), buckets posted as backward fills
    them. Exposed = step - ceiling, measured and predicted."""
    if not data.get("wire") or not data.get("np1"):
        return []
    import dataclasses
    fits = links(data)
    cal = calibration(data)
    rows = []
    for w in data["wire"]:
        rate, np_, nodes = w["rate"], w["np"], w["nodes"]
        full = cluster_for(cal, fits, rate, np_, nodes, data["cores"])
        # the probe's two node properties (runs before it had none: the model's old full-rate premise)
        probe = w.get("probe", {})
        cl = dataclasses.replace(full, overlap_rate=probe_rate(w), gamma_fp16=probe.get("gamma_fp16", 0.0))
        ceiling = w["step_s"]["ceiling"]["median"]
        for k, (change, metrics) in WIRE_MODEL.items():
            cfg = Config(model=w["model"], width=w["width"], batch_size=w["per_rank_batch"], threads=w["threads"],
                         **change)
            pred = pm.exchange(cfg, np_, cl, ceiling, forward_s=w["forward_s"], metrics=metrics)
            pred_full = pm.exchange(cfg, np_, full, ceiling, forward_s=w["forward_s"], metrics=metrics)
            step = w["step_s"][k]["median"]
            exposed = step - ceiling
            row = {"rate": rate, "np": np_, "nodes": nodes, "contender": k, "ceiling_s": ceiling,
                   "overlap_rate": cl.overlap_rate, "gamma_fp16": cl.gamma_fp16,
                   "step_predicted_full_rate": pred_full["step"],
                   "step_measured": step, "step_predicted": pred["step"], "step_ratio": pred["step"] / step,
                   "exposed_measured": exposed, "exposed_predicted": pred["exposed"],
                   "exposed_ratio": pred["exposed"] / exposed if exposed > 0 else None}
            rows.append(row)
    return rows


def probe_rate(w: dict) -> float:
    """The overlap rate the wire run's probe measured; 1 where it has none, or where in most rounds
    nothing was left after backward (the figure is then only a lower bound: backward hid it all)."""
    probe = w.get("probe")
    if not probe or 2 * probe["saturated"] > len(w.get("probe_rounds", [])):
        return 1.0
    return probe["overlap_rate"]


def wire_model_table(rows: list[dict], within: float | None = None) -> str:
    """The model against each wire point, and how far it is (with ``within``, a tolerance such as a
    study's goal: at how many points it is within it)."""
    if not rows:
        return ""
    lines = ["| link | ranks x nodes | probe: overlap rate, fp16 ns/B | contender | step measured s | predicted s "
             "| ratio | full-rate model ratio | exposed measured s | predicted s | ratio |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        er = f"{r['exposed_ratio']:.2f}" if r["exposed_ratio"] is not None else "—"
        lines.append(f"| {r['rate']} | {r['np'] // r['nodes']} x {r['nodes']} | {r.get('overlap_rate', 1.0):.2f}, "
                     f"{r.get('gamma_fp16', 0.0) * 1e9:.1f} | {r['contender']} | "
                     f"{r['step_measured']:.3f} | {r['step_predicted']:.3f} | {r['step_ratio']:.2f} | "
                     f"{r.get('step_predicted_full_rate', r['step_predicted']) / r['step_measured']:.2f} | "
                     f"{r['exposed_measured']:.3f} | {r['exposed_predicted']:.3f} | {er} |")
    lines.append("")
    lines.append(_wire_errors(rows, within))
    return "\n".join(lines)


def _wire_errors(rows: list[dict], within: float | None) -> str:
    """The model's distance from the wire points: |predicted / measured - 1| of the step (and the full-rate
    model's) and of the exposed exchange; with ``within``, the points within it."""
    def err(r, key):
        v = r.get(key, r["step_predicted"] / r["step_measured"]) if key == "full" else r[key]
        return abs(v - 1) if v is not None else None
    full = [{**r, "full": r.get("step_predicted_full_rate", r["step_predicted"]) / r["step_measured"]} for r in rows]
    step = [err(r, "step_ratio") for r in rows]
    exposed = [e for e in (err(r, "exposed_ratio") for r in rows) if e is not None]
    text = (f"|predicted / measured - 1|: the step median {statistics.median(step):.0%}, worst {max(step):.0%} "
            f"(the full-rate model: worst {max(err(r, 'full') for r in full):.0%})"
            + (f"; the exposed exchange median {statistics.median(exposed):.0%}, worst {max(exposed):.0%}"
               if exposed else "") + ".")
    if within is None:
        return text
    steps = sum(e <= within for e in step)
    fulls = sum(err(r, "full") <= within for r in full)
    met = sum(err(r, "step_ratio") <= within and err(r, "exposed_ratio") is not None
              and err(r, "exposed_ratio") <= within for r in rows)
    return text + (f" Within {within:.0%}: the step at {steps} of {len(rows)} points (the full-rate model: {fulls}), "
                   f"step and exposed exchange both at {met} of {len(rows)}.")


def wire_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = ("pilab", "pilab_fp16", "pilab_one_bucket", "ddp_gloo", "ddp_gloo_1mb")
    head = ("| link | ranks x nodes | gradient MB | link MB/s | ceiling s | bound s | "
            + " | ".join(f"{k} s (/ceiling, /bound)" for k in keys) + " | pilab / DDP |")
    lines = [head, "|---|---|" + "---:|" * (5 + len(keys))]
    for r in rows:
        def cell(k):
            oc = r["over_ceiling"][k]
            return (f"{r['step_s'][k]:.3f} ({oc['median']:.2f} [{oc['p10']:.2f}-{oc['p90']:.2f}], "
                    f"{r['over_bound'][k]:.2f})")
        pd = r["pilab_over_ddp"]
        lines.append(f"| {r['rate']} | {r['np'] // r['nodes']} x {r['nodes']} | {r['gradient_mb']:.1f} | "
                     f"{r['link_MBps'] or 0:.1f} | {r['step_s']['ceiling']:.3f} | {r['bound_s']:.3f} | "
                     + " | ".join(cell(k) for k in keys) + f" | {pd['median']:.2f} [{pd['p10']:.2f}-{pd['p90']:.2f}] |")
    return "\n".join(lines)


def report(data, within: float | None = None, wire_within: float | None = None) -> str:
    """The section's tables (markdown) from its dict or a stored JSON's path, analysed again; ``within``
    and ``wire_within``: tolerances to count the points within (a study's goals: experiments/network-model)."""
    if isinstance(data, str):
        data = load_json(data)
    data = data.get("network", data)  # a `pilab bench` bench.json holds the section under "network"
    an = analyse(data)
    return "\n\n".join([bench_table(an), table(an), summary(an, within),
                         "* not communication-bound: communication < 30% of the step, or one node"]
                        + ([wire_table(wire_rows(data))] if data.get("wire") else [])
                        + ([wire_model_table(wire_model_rows(data), wire_within)]
                           if data.get("wire") and data.get("np1") else []))


def markdown(n: dict, when: str = "") -> list[str]:
    """BENCHMARKS.md's lines for the ``network`` section ``n``, analysed again by this code (as
    :func:`report` does: a saved run's ``analysis`` is what the code of its day made of it); ``when``: the
    line saying when and at what load it ran, or which saved run it is."""
    an = analyse(n)
    return ["## Performance model against the testbed's shaped links", "",
            f"Testbed {n['testbed']['name']} ({n['testbed']['subnet']}), links {', '.join(n['rates'])}; "
            f"{'quick settings; ' if n.get('quick') else ''}see `pilab.bench.network` and "
            "`pilab.perfmodel.check` for what each column is. " + when, "", bench_table(an), "", table(an), "",
            summary(an), "* not communication-bound: communication < 30% of the step, or one node", ""] + _wire(n)


def _wire(n: dict) -> list[str]:
    rows = wire_rows(n)
    if not rows:
        return []
    model = wire_model_table(wire_model_rows(n))
    return ["### One step on the wire: pilab, DDP-gloo, the ceiling and the bound", "",
            "Each contender's step (the slowest rank's, median over rounds; contenders alternated round by "
            "round) with its ratio to the no-exchange ceiling (median [p10-p90] over rounds) and to the bound: "
            "max(ceiling, forward + the link time of the Allreduce's bytes, 2(n-1)/n of the gradient per node "
            "link at the measured rate). Model: " + f"{n['wire'][0]['model']} {n['wire'][0]['width']}, "
            f"{n['wire'][0]['per_rank_batch']} images per rank, 1 thread (`pilab.bench.wire`).", "",
            wire_table(rows), ""] + (["The performance model against each point (`perfmodel.exchange`, the measured "
            "ceiling as the compute; the probe's overlap rate and fp16 cost per node layout, see "
            "`pilab.bench.wire`; docs/perfmodel.md):", "", model, ""] if model else [])
