"""The performance model's step as a trace: what one synchronous step of a configured run would look
like on a cluster, in the format of a measured run's ``trace.json`` (``pilab.trace.format``)::

    from pilab.trace import format as tf
    from pilab.perfmodel import pi_config
    from pilab.trace.predict import predicted_trace
    events, meta = predicted_trace(pi_config(), 48, "pi4b_cluster")
    tf.write("runs/pi48/predicted.json", events, meta=meta)   # open it in ui.perfetto.dev

    python -m pilab perfmodel trace --np 48 --cluster pi4b_cluster --out runs/pi48/predicted.json

Every time comes from ``predict.step_schedule`` (``predict``'s own step and ``bucket_schedule``'s
buckets), so the trace's step is ``predict``'s ``step_time``. Per rank (one process per node, one
track per rank, all ranks alike: the model has one rank's step):

    data | forward | backward | wait (the straggler term, then the exposed tail) | optimizer
    "bucket K" flights: posted when backward has filled bucket K, ended when its Allreduce is done;
    inside each, "bucket K intra" / "bucket K inter" (cat "allreduce-phase"): the runs of the
    schedule's rounds that stay inside a node or cross nodes, scaled to the bucket's time on the wire
    (which the overlap rate stretches while backward runs); "metrics": the per-step metrics Allreduce.

The model folds the optimizer's update into compute (forward + backward); the "optimizer" span is its
per-step overhead (``Cluster.step_overhead_s``: the optimizer call, Python, logging).

A measured trace beside the performance model's prediction of the same run: per bucket and for the
step, predicted against measured and the error, in the manner of ASTRA-sim's validation tables::

    from pilab.trace import format as tf
    from pilab.trace.predict import validate, table
    v = validate(tf.read("runs/x/trace.json"), "runs/perfmodel/calibration.json")
    print(table(v, step_goal=0.10, tail_goal=0.20))     # goals are the caller's (experiments/perfmodel)

    python -m pilab perfmodel validate runs/x/trace.json --calibration runs/perfmodel/calibration.json

What is compared (seconds; measured: the median over steps of the median over ranks):
  bucket K  its Allreduce from posted to done ("bucket K" flights, matched by K)
  step      the step's time (its slowest rank's, data to optimizer)
  tail      the exposed tail: measured, the wait after backward less the wait for a slower peer;
            predicted, ``predict``'s exposed communication
Error = (predicted - measured) / measured. No goal lives here: pass ``step_goal``/``tail_goal``.
"""
from __future__ import annotations

import statistics

from ..perfmodel import METRIC_BYTES, remember, resolve_cluster, step_schedule
from . import format as tf
from .read import analyse, figures, steps

US = 1e6  # trace times are microseconds


def predicted_trace(cfg, np_: int, cluster, profile: str = "pilab", **sizes) -> tuple[list, dict]:
    """(events, meta) of one predicted step of ``cfg`` at ``np_`` ranks on ``cluster`` (a preset name,
    Cluster, Calibration or JSON path, as ``predict`` takes); ``tracefile.write(path, events, meta=meta)``
    writes it. ``meta["prediction"]`` holds the step's figures in seconds."""
    from ..perfmodel import as_config  # one reading of a config for predict and the trace
    cfg = as_config(cfg)
    cl = resolve_cluster(cluster)
    out = step_schedule(cfg, np_, cl, profile, **sizes)
    p, rpn = out["np"], out["ranks_per_node"]
    events = []
    for node in range(out["nodes"]):
        events.append(tf.process(node, f"node{node + 1:02d}"))
        for r in range(node * rpn, min(p, (node + 1) * rpn)):
            events.append(tf.thread(node, r, f"rank {r}"))
            events += _rank_step(out, node, r, cfg)
    part = out["step"]
    meta = {"kind": "predicted", "config": cfg.to_dict(), "np": p, "cluster": cl.name, "profile": profile,
            "prediction": {"step_time": out["step_time"], **part,
                           "buckets": [{k: b[k] for k in ("bytes", "posted", "start", "end", "cost", "phases")}
                                       for b in out["schedule"]["buckets"]]}}
    return events, meta


def _rank_step(out: dict, pid: int, r: int, cfg) -> list:
    """One rank's spans and flights of the predicted step (step 0, epoch 1)."""
    part, sched = out["step"], out["schedule"]
    data, straggler, exposed, overhead = part["data"], part["straggler"], part["comm_exposed"], part["overhead"]
    # the order predict sums the step in, so the optimizer ends at exactly predict's step_time
    wait_end = data + part["compute"] + straggler + exposed
    bwd_end = data + sched["backward_end"]
    step = {"step": 0, "epoch": 1}
    ev = [tf.span("data", pid=pid, tid=r, ts=0.0, dur=data * US, **step),
          tf.span("forward", pid=pid, tid=r, ts=data * US, dur=sched["forward_end"] * US, **step),
          tf.span("backward", pid=pid, tid=r, ts=(data + sched["forward_end"]) * US,
                  dur=(sched["backward_end"] - sched["forward_end"]) * US, **step),
          tf.span("wait", pid=pid, tid=r, ts=bwd_end * US, dur=max(0.0, wait_end - bwd_end) * US,
                  peer_s=straggler, exposed_s=exposed, **step),
          tf.span("optimizer", pid=pid, tid=r, ts=wait_end * US, dur=overhead * US, **step)]
    for k, b in enumerate(sched["buckets"]):
        ev += tf.flight(f"bucket {k}", pid=pid, tid=r, ts=(data + b["posted"]) * US, end=(data + b["end"]) * US,
                        id=f"{r}-0-{k}", step=0, bucket=k, bytes=b["bytes"])
        ev += _phases(b, data, pid, r, k)
    if out["metric_s"]:
        last = data + max([sched["backward_end"]] + [b["end"] for b in sched["buckets"]])
        ev += tf.flight("metrics", pid=pid, tid=r, ts=last * US, end=(last + out["metric_s"]) * US,
                        id=f"{r}-0-metrics", step=0, bytes=METRIC_BYTES)
    return ev


def _phases(b: dict, t0: float, pid: int, r: int, k: int) -> list:
    """Bucket k's intra-/inter-node phases, scaled to its time on the wire (start to end)."""
    total = sum(t for _, t in b["phases"]) or 1.0
    scale = (b["end"] - b["start"]) / total
    ev, ts = [], t0 + b["start"]
    for j, (kind, t) in enumerate(b["phases"]):
        ev += tf.flight(f"bucket {k} {kind}", pid=pid, tid=r, ts=ts * US, end=(ts + t * scale) * US,
                        id=f"{r}-0-{k}-{j}", cat="allreduce-phase", step=0, bucket=k, phase=kind,
                        alone_s=t)
        ts += t * scale
    return ev


def _bucket_times(doc: dict) -> dict:
    """{K: median over steps of the median over ranks of bucket K's posted-to-done seconds}."""
    recs, _ = steps(doc)
    per: dict = {}
    for (_, s), x in recs.items():
        for k, (a, b) in x["buckets"].items():
            per.setdefault(k, {}).setdefault(s, []).append(b - a)
    return {k: statistics.median(statistics.median(v) for v in by_step.values()) for k, by_step in sorted(per.items())}


def _step_and_tail(doc: dict) -> tuple[float, float]:
    meta = doc.get("otherData") or {}
    if meta.get("kind") == "predicted" and "prediction" in meta:
        p = meta["prediction"]
        return p["step_time"], p["comm_exposed"]
    recs, _ = steps(doc)
    fig = figures(recs)
    by_step: dict = {}
    for (_, s), f in fig.items():
        by_step.setdefault(s, []).append(f)
    step = statistics.median(max(f["time"] for f in fs) for fs in by_step.values())
    tail = statistics.median(statistics.median(f["network"] for f in fs) for fs in by_step.values())
    return step, tail


def _err(pred: float, meas: float) -> float | None:
    return (pred - meas) / meas if meas else None


def compare(measured: dict, predicted: dict) -> dict:
    """Per bucket and for the step: {"buckets": [{bucket, measured, predicted, error}], "step": {...},
    "tail": {...}} (seconds; error a fraction, None where the measurement is 0 or missing)."""
    analyse(measured, top=0)  # raises TraceError for a trace without steps
    mb, pb = _bucket_times(measured), _bucket_times(predicted)
    buckets = [{"bucket": k, "measured": mb.get(k), "predicted": pb.get(k),
                "error": _err(pb[k], mb[k]) if k in mb and k in pb else None} for k in sorted(set(mb) | set(pb))]
    (ms, mt), (ps, pt) = _step_and_tail(measured), _step_and_tail(predicted)
    return {"buckets": buckets, "step": {"measured": ms, "predicted": ps, "error": _err(ps, ms)},
            "tail": {"measured": mt, "predicted": pt, "error": _err(pt, mt)}}


def validate(measured: dict, cluster, profile: str = "pilab") -> dict:
    """Predict the measured trace's run (its ``otherData`` config and np) on ``cluster`` (a calibration
    JSON path, preset name, Calibration or Cluster) and ``compare``; the prediction's trace events and
    meta come back under "predicted"."""

    meta = measured.get("otherData") or {}
    if not meta.get("config") or not meta.get("np"):
        raise tf.TraceError("the trace's otherData has no config and np (a trace written by "
                            "`python -m pilab train --trace` has both)")
    remember(meta.get("model_profile"))  # the model as the run measured it: its builder is not imported
    events, pmeta = predicted_trace(meta["config"], int(meta["np"]), cluster, profile)
    predicted = {"traceEvents": events, "otherData": pmeta}
    out = compare(measured, predicted)
    out["predicted"] = predicted
    out["np"] = int(meta["np"])
    return out


def table(v: dict, step_goal: float | None = None, tail_goal: float | None = None) -> str:
    """The validation table as text (ms, error %); with goals, whether each holds ("miss" shown)."""
    def pct(e):
        return "       -" if e is None else f"{100 * e:+7.1f}%"

    def ms(x):
        return "        -" if x is None else f"{1e3 * x:>9.2f}"
    lines = [f"{'ms':<10} {'measured':>9} {'predicted':>9} {'error':>8}  goal"]
    for b in v["buckets"]:
        lines.append(f"{'bucket ' + str(b['bucket']):<10} {ms(b['measured'])} {ms(b['predicted'])} {pct(b['error'])}")
    for name, goal in (("step", step_goal), ("tail", tail_goal)):
        x = v[name]
        verdict = "" if goal is None or x["error"] is None else \
            (f"holds (within {100 * goal:.0f}%)" if abs(x["error"]) <= goal else f"MISS (goal {100 * goal:.0f}%)")
        lines.append(f"{name:<10} {ms(x['measured'])} {ms(x['predicted'])} {pct(x['error'])}  {verdict}")
    return "\n".join(lines)
