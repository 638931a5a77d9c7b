"""The trace format module: what it writes opens in Perfetto's format, and what breaks the format is named."""
import json

import pytest

from pilab.trace import format as tf


def _events():
    return [tf.process(0, "node01"), tf.thread(0, 1, "rank 1"),
            tf.span("forward", pid=0, tid=1, ts=10.0, dur=100.0, step=0),
            tf.span("backward", pid=0, tid=1, ts=110.0, dur=300.0, step=0),
            *tf.flight("bucket 0", pid=0, tid=1, ts=200.0, end=450.0, id="1-0-0", step=0, bytes=4096)]


def test_round_trip(tmp_path):
    path = tmp_path / "trace.json"
    tf.write(str(path), list(reversed(_events())), meta={"np": 2})
    doc = tf.read(str(path))
    phases = [e["ph"] for e in doc["traceEvents"]]
    assert phases[:2] == ["M", "M"] and sorted(phases[2:]) == ["X", "X", "b", "e"]
    assert doc["otherData"] == {"np": 2} and doc["displayTimeUnit"] == "ms"
    assert list(tmp_path.iterdir()) == [path]      # nothing half-written beside it


@pytest.mark.parametrize("breaks, says", [
    (lambda ev: ev[4].pop("id"), "has no 'id'"),
    (lambda ev: ev.pop(5), "never ended"),
    (lambda ev: ev.pop(4), "never began"),
    (lambda ev: ev[5].update(ts=100.0), "ends before it began"),
    (lambda ev: ev[3].update(ts=5.0), "starts before the previous one"),
    (lambda ev: ev[2].update(dur=-1.0), "no valid 'dur'"),
    (lambda ev: ev[2].pop("pid"), "has no 'pid'"),
    (lambda ev: ev[2].update(ph="i"), "phase 'i'"),
])
def test_broken_traces_are_named(tmp_path, breaks, says):
    ev = _events()
    breaks(ev)
    with pytest.raises(tf.TraceError, match=says):
        tf.validate({"traceEvents": ev})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    with pytest.raises(tf.TraceError, match=says):
        tf.read(str(path))
