"""A measured trace beside the performance model's prediction of the same run: per bucket and for the
step, predicted against measured and the error, in the manner of ASTRA-sim's validation tables::

    from pilab.trace import format as tf
    from pilab.trace.validate import validate, table
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

from . import format as tf
from .read import analyse, figures, steps


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
    from .predict import predicted_trace

    meta = measured.get("otherData") or {}
    if not meta.get("config") or not meta.get("np"):
        raise tf.TraceError("the trace's otherData has no config and np (a trace written by "
                            "`python -m pilab train --trace` has both)")
    from ..perfmodel.layout import remember
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
