"""Traces in the Chrome Trace Event Format: the JSON that Perfetto (ui.perfetto.dev) and Chrome's
``about:tracing`` open. One module builds, writes, reads and checks them, for a measured run's trace and
for the performance model's predicted one alike::

    from pilab.trace import format as tf
    ev = [tf.process(0, "node01"), tf.thread(0, 1, "rank 1"),
          tf.span("backward", pid=0, tid=1, ts=120.0, dur=800.5, step=3),
          *tf.flight("bucket 2", pid=0, tid=1, ts=400.0, end=950.0, id="1-3-2", step=3, bytes=1048576)]
    tf.write("runs/x/trace.json", ev, meta={"np": 2})   # atomic; checks the events first
    doc = tf.read("runs/x/trace.json")                   # checked again on the way in

Layout pilab keeps: one process per host (``pid`` = the host's index, named by ``process``), one thread
per rank (``tid`` = the rank), times in microseconds from the run's common zero. Phases of a step are
complete events (``ph: "X"``); a gradient bucket's Allreduce, which overlaps backward, is an async
begin/end pair (``ph: "b"``/``"e"``, matched by ``cat`` and ``id``) so viewers draw it on its own row.
The format's reference: "Trace Event Format" (Google, 2016), the subset above.
"""
from __future__ import annotations

import json
import math

from ..files import atomic_write_text

__all__ = ["process", "thread", "span", "flight", "write", "read", "validate", "TraceError"]

ASYNC_CAT = "allreduce"


class TraceError(ValueError):
    """A trace that does not follow the format (the message names the first problem)."""


def process(pid: int, name: str) -> dict:
    """The metadata event naming process ``pid`` (pilab: a host)."""
    return {"name": "process_name", "ph": "M", "pid": int(pid), "tid": 0, "args": {"name": str(name)}}


def thread(pid: int, tid: int, name: str) -> dict:
    """The metadata event naming thread ``tid`` of process ``pid`` (pilab: a rank)."""
    return {"name": "thread_name", "ph": "M", "pid": int(pid), "tid": int(tid), "args": {"name": str(name)}}


def span(name: str, *, pid: int, tid: int, ts: float, dur: float, cat: str = "step", **args) -> dict:
    """A complete event: ``name`` ran on (pid, tid) from ``ts`` for ``dur`` microseconds."""
    return {"name": name, "cat": cat, "ph": "X", "pid": int(pid), "tid": int(tid),
            "ts": float(ts), "dur": float(dur), "args": args}


def flight(name: str, *, pid: int, tid: int, ts: float, end: float, id: str, cat: str = ASYNC_CAT,
           **args) -> tuple[dict, dict]:
    """An async begin/end pair: something posted at ``ts`` that completed at ``end`` (a bucket's
    non-blocking Allreduce), overlapping whatever (pid, tid) does meanwhile."""
    b = {"name": name, "cat": cat, "ph": "b", "pid": int(pid), "tid": int(tid), "ts": float(ts),
         "id": str(id), "args": args}
    e = {"name": name, "cat": cat, "ph": "e", "pid": int(pid), "tid": int(tid), "ts": float(end),
         "id": str(id), "args": {}}
    return b, e


def validate(doc: dict) -> dict:
    """Check ``doc`` against the format as pilab writes it; return it, or raise ``TraceError`` naming the
    first problem: a missing field, a negative or non-finite time, an end without its begin (or a begin
    never ended, or one ending before it began), a complete event starting before the previous one of
    its own track."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError("a trace is a JSON object with a 'traceEvents' list")
    open_, last = {}, {}
    for i, ev in enumerate(events):
        for key in ("name", "ph", "pid", "tid"):
            if key not in ev:
                raise TraceError(f"event {i} has no '{key}'")
        ph = ev["ph"]
        if ph == "M":
            continue
        ts = ev.get("ts")
        if not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"event {i} ({ev['name']!r}) has no valid 'ts' (microseconds >= 0)")
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or not math.isfinite(dur) or dur < 0:
                raise TraceError(f"event {i} ({ev['name']!r}) is complete but has no valid 'dur'")
            track = (ev["pid"], ev["tid"])
            if ts < last.get(track, 0.0):
                raise TraceError(f"event {i} ({ev['name']!r}) starts before the previous one on "
                                 f"pid {track[0]} tid {track[1]}: complete events go in time order per track")
            last[track] = ts
        elif ph in ("b", "e"):
            key = (ev.get("cat"), ev.get("id"))
            if key[1] is None:
                raise TraceError(f"async event {i} ({ev['name']!r}) has no 'id'")
            if ph == "b":
                if key in open_:
                    raise TraceError(f"async event {i} begins id {key[1]!r} twice")
                open_[key] = ts
            else:
                if key not in open_:
                    raise TraceError(f"async event {i} ends id {key[1]!r}, which never began")
                if ts < open_.pop(key):
                    raise TraceError(f"async event {i} (id {key[1]!r}) ends before it began")
        else:
            raise TraceError(f"event {i} has phase {ph!r}; pilab writes only M, X, b and e")
    if open_:
        raise TraceError(f"async id {next(iter(open_))[1]!r} began but never ended")
    return doc


def write(path: str, events: list, *, meta: dict | None = None) -> dict:
    """Check and write ``events`` (metadata first, then each track's events in time order) to ``path``
    atomically; ``meta`` goes to ``otherData`` (the run's config, the clocks' alignment error, ...)."""
    order = {"M": 0}
    events = sorted(events, key=lambda e: (order.get(e["ph"], 1), e.get("ts", 0.0)))
    doc = validate({"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta or {})})
    atomic_write_text(path, json.dumps(doc, separators=(",", ":")))
    return doc


def read(path: str) -> dict:
    """Load and check a trace file (``TraceError`` names what is wrong with it)."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path} is not JSON ({e}); write it with pilab.trace.format.write") from None
    return validate(doc)
