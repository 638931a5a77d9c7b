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
"""
from __future__ import annotations

from . import format as tf
from ..perfmodel.assumptions import METRIC_BYTES
from ..perfmodel.predict import step_schedule
from ..perfmodel.presets import resolve_cluster

US = 1e6  # trace times are microseconds


def predicted_trace(cfg, np_: int, cluster, profile: str = "pilab", **sizes) -> tuple[list, dict]:
    """(events, meta) of one predicted step of ``cfg`` at ``np_`` ranks on ``cluster`` (a preset name,
    Cluster, Calibration or JSON path, as ``predict`` takes); ``tracefile.write(path, events, meta=meta)``
    writes it. ``meta["prediction"]`` holds the step's figures in seconds."""
    from ..perfmodel.predict import _as_config  # one reading of a config for predict and the trace
    cfg = _as_config(cfg)
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
