"""How rank 0's training events reach the notebook: both halves of one small protocol.

On the engine, :func:`publish` is a ``pilab.train`` callback that sends each event through ipyparallel's
datapub channel under a numbered key; on the client, an :class:`EventReader` reads the keys of a running
task in order, each once::

    %%px                                       # engine side (engine_train does this on rank 0)
    pilab.train(cfg, comm, callbacks=[cluster.publish])

    reader = EventReader(ar)                   # client side (Run's watcher thread does this)
    for event in reader.new_events(): ...

Keys are ``pilab_event_000000000``, ``..._000000001``, ...; :func:`begin_stream` restarts the numbering
when a run starts, so a new task's reader begins at 0. The ``end`` event is never sent: the result comes
back as the task's return value.
"""
from __future__ import annotations

import numpy as np

_next_seq = 0  # number of the next event this engine publishes


def event_key(seq: int) -> str:
    """The datapub key of event number ``seq`` of a run."""
    return f"pilab_event_{seq:09d}"


def begin_stream() -> None:
    """Number the next published event 0 (call on the engine when a run starts)."""
    global _next_seq
    _next_seq = 0


def publish(event: dict) -> None:
    """A ``pilab.train`` callback that sends rank 0's events to the client (ipyparallel datapub), where
    :class:`pilab.lab.cluster.Run` hands them to the notebook's callbacks. The ``end`` event is not sent:
    the result comes back as the task's return value."""
    global _next_seq
    if event.get("kind") == "end":
        return
    # Imported here: publish_data works only inside an engine's task, the one place this runs.
    from ipyparallel.datapub import publish_data

    publish_data({event_key(_next_seq): _plain(event)})
    _next_seq += 1


def _plain(obj):
    """numpy scalars -> Python numbers, so events pickle small and render anywhere."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


class EventReader:
    """Rank 0's published events of one ipyparallel AsyncResult, in order, each returned once::

        reader = EventReader(ar)       # ar: view.apply_async(...) over the engines in rank order
        events = reader.new_events()   # what arrived since the last call (maybe [])
    """

    def __init__(self, ar):
        self.ar = ar
        self.seq = 0  # number of the next event to hand out

    def new_events(self) -> list[dict]:
        data = self.ar.data  # one dict per engine, in the order of the view (= rank order)
        rank0 = data[0] if isinstance(data, list) else data
        out = []
        while event_key(self.seq) in rank0:
            out.append(rank0[event_key(self.seq)])
            self.seq += 1
        return out
