"""The notebook side: a connected set of MPI engines (:class:`Engines`); the runs on them and their failure
reporting are :mod:`pilab.lab.cluster.client`' (:class:`Run`; :class:`LocalRun` for a kernel without engines)::

    lab = cluster.start(n=2)                   # see pilab.lab.cluster.profiles
    run = lab.train(cfg, np_=2, callbacks=[live])   # returns at once; rank 0's events reach `live`
    run.stop()                                 # every rank stops after its current step
    result = run.wait()                        # never hangs: a dead or stuck rank raises ClusterError

A watcher thread per run reads rank 0's events (:class:`pilab.lab.cluster.events.EventReader`) and watches the
engines: an unregistered engine is a dead rank, an error from one rank while the others wait in a collective
is a failed run, and no event for ``hang_s`` seconds is a hung one. Each is reported with the ranks, hosts,
pids and (for local engines) their process status.

The runs on a set of engines (:class:`Run`) or in this kernel (:class:`LocalRun`), and how a failure
is described (which ranks, hosts, pids, process states)::

    run = lab.train(cfg, np_=2, callbacks=[live])   # a Run (pilab.lab.cluster.client.Engines.train)
    run.stop()                                 # every rank stops after its current step
    result = run.wait()                        # never hangs: a dead or stuck rank raises ClusterError

A watcher thread per run reads rank 0's events (:class:`pilab.lab.cluster.events.EventReader`) and watches the
engines: an unregistered engine is a dead rank, an error from one rank while the others wait in a collective
is a failed run, and no event for ``hang_s`` seconds is a hung one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
import threading
import time
from typing import Callable, Iterable

import psutil  # an ipyparallel dependency

from .events import EventReader
from .rank import ClusterError, StopFlag, engine_train, whoami


# ``lab`` below is a pilab.lab.cluster.client.Engines (named as a string: that module imports this one)

def _describe(lab: "Engines", ranks: Iterable[int]) -> str:
    parts = []
    for r in ranks:
        i = lab.ranks[r]
        parts.append(f"rank {r} (engine {i['engine']}, {i['host']} pid {i['pid']})")
    return ", ".join(parts) if parts else "no rank"


def _local_status(lab: "Engines", ranks: Iterable[int]) -> str:
    """OS status of engine processes on this host (stopped, zombie, sleeping...), where visible."""
    here = socket.gethostname()
    notes = []
    for r in ranks:
        i = lab.ranks[r]
        if i["host"] != here:
            continue
        try:
            notes.append(f"rank {r}: {psutil.Process(i['pid']).status()}")
        except psutil.NoSuchProcess:
            notes.append(f"rank {r}: process gone")
    return "; ".join(notes)


def _pending_ranks(lab: "Engines", ar) -> list[int]:
    """Ranks (positions in a rank-ordered view) whose part of ``ar`` has not come back yet."""
    outstanding = lab.client.outstanding
    return [r for r, m in enumerate(ar.msg_ids) if m in outstanding]


def _failed_ranks(lab: "Engines", ar) -> dict[int, BaseException]:
    """Ranks whose part of ``ar`` came back as an error while others may still be running."""
    results = lab.client.results
    out = {}
    for r, m in enumerate(ar.msg_ids):
        value = results.get(m)
        if isinstance(value, BaseException):
            out[r] = value
    return out


def _wait_ar(lab: "Engines", ar, timeout: float | None, poll_s: float = 0.2):
    """Wait for an AsyncResult on all ranks, checking that every engine is still registered."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ar.ready():
        gone = lab.missing()
        if gone:
            with contextlib.suppress(Exception):
                ar.wait(2)  # the hub has told us; let the failures of the other ranks arrive
            raise ClusterError(f"{_describe(lab, gone)} died; lab.stop() and start a new cluster")
        if deadline is not None and time.monotonic() > deadline:
            busy = _pending_ranks(lab, ar)
            raise ClusterError(f"no answer within {timeout} s from {_describe(lab, busy)}; "
                               f"{_local_status(lab, busy) or 'no local process status'}")
        ar.wait(poll_s)
    return ar.get()


class Run:
    """A training run on the engines, returned by :meth:`Engines.train`.

    A watcher thread passes rank 0's events to the callbacks as they come (so a cell can block in
    :meth:`wait` while plots update) and watches the engines: ``status`` is ``running``, ``done``,
    ``stopped`` (ended early on request), ``failed`` (an error on a rank), ``died`` (a rank's engine
    vanished) or ``hung`` (no event for ``hang_s`` seconds).
    """

    def __init__(self, lab: "Engines", ar, np_: int, *, callbacks=(), hang_s: float = 120.0,
                 poll_s: float = 0.2):
        self.lab, self.ar, self.np_ = lab, ar, np_
        self.callbacks = list(callbacks)
        self.hang_s, self.poll_s = hang_s, poll_s
        self.events: list[dict] = []
        self.status = "running"
        self.result: dict | None = None
        self.error: BaseException | None = None
        self.stop_requested_at: float | None = None
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self._events = EventReader(ar)
        self._last_event = time.monotonic()
        self._done = threading.Event()
        self._cluster_stopping = False
        self._callback_errors: list[str] = []
        self._thread = threading.Thread(target=self._watch, name="pilab-run-watcher", daemon=True)
        self._thread.start()

    # -- public ----------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        """Ask every rank to stop after its current step (idempotent; returns at once)."""
        if self.done or self.stop_requested_at is not None:
            return
        self.stop_requested_at = time.monotonic()
        self.lab.interrupt(range(self.np_))

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends and return rank 0's result dict.

        A kernel interrupt (JupyterLab's ■ while a cell waits here) asks the ranks to stop after
        their current step and goes on waiting for them; a second one returns at once (the run goes
        on, ``run.wait()`` again to collect it).
        Raises ClusterError if a rank failed, died or stopped making progress (``hang_s``), or
        ``timeout`` seconds passed: never waits forever.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self._done.wait(0.2):
                    break
            except KeyboardInterrupt:
                if self.stop_requested_at is not None:
                    raise
                print("interrupted: every rank stops after its current step", file=sys.stderr)
                self.stop()
            if deadline is not None and time.monotonic() > deadline:
                raise ClusterError(f"the run did not end within {timeout} s ({self.describe()}); "
                                   "run.stop() asks it to, lab.stop() ends the engines")
        if self.status in ("done", "stopped"):
            return self.result
        raise ClusterError(self.describe())

    def describe(self) -> str:
        """One line: where the run is, or why it ended."""
        last = next((e for e in reversed(self.events) if e.get("kind") == "step"), None)
        where = f"step {last['global_step']}/{last.get('total_steps', '?')}" if last else "no step yet"
        if self.status == "running":
            return f"running on {self.np_} ranks, {where}"
        if self.status in ("done", "stopped"):
            extra = " (stopped early)" if self.status == "stopped" else ""
            return f"finished on {self.np_} ranks at {where}{extra}"
        return self._failure

    # -- the watcher -----------------------------------------------------------------------------
    def _drain(self) -> None:
        for event in self._events.new_events():
            self._dispatch(event)

    def _dispatch(self, event: dict) -> None:
        self._last_event = time.monotonic()
        self.events.append(event)
        for cb in self.callbacks:
            try:
                cb(event)
            except Exception as e:  # a broken plot must not end the run or the watcher
                if len(self._callback_errors) < 5:
                    self._callback_errors.append(f"{getattr(cb, '__name__', cb)!r}: {e!r}")

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as e:  # pragma: no cover - the watcher must always finish the run
            self._fail("failed", f"the run watcher failed: {e!r}", e)
        finally:
            self.ended_at = time.monotonic()
            self._done.set()

    def _watch_loop(self) -> None:
        lab = self.lab
        ranks = range(self.np_)
        while True:
            self._drain()
            if self.ar.ready():
                break
            gone = lab.missing()
            if gone or self._cluster_stopping:
                with contextlib.suppress(Exception):
                    self.ar.wait(3)  # let the other ranks' failures arrive too
                gone = lab.missing() or gone
                why = "the cluster was stopped" if self._cluster_stopping and not gone else \
                    f"{_describe(lab, gone)} died (engine unregistered)"
                self._fail("died", f"{why} during the run at {self._where()}; the other ranks cannot "
                           "go on without it: lab.stop() and start a new cluster", None)
                return
            failed = _failed_ranks(lab, self.ar)
            if failed:
                self.ar.wait(1.0)  # several ranks failing at once is one error: report it whole
                if self.ar.ready():
                    break
                # One rank raised; the others wait for it in a collective and never return.
                r, e = next(iter(failed.items()))
                self._fail("failed", f"rank {r} failed at {self._where()}: {_short(e)}; the other "
                           "ranks are left waiting for it in a collective: lab.stop() and start a "
                           "new cluster", e)
                return
            quiet = time.monotonic() - self._last_event
            # the ranks' own watchdogs (pilab.engine.watchdog) look first: they can name an unreachable node
            if quiet > self.hang_s + WATCHDOG_GRACE_S:
                status = _local_status(lab, ranks)
                self._fail("hung", f"no progress from rank 0 for {quiet:.0f} s (hang_s={self.hang_s}) "
                           f"at {self._where()}; a rank is stuck or far slower than the others "
                           f"({status or 'no local process status'}); run.stop() may not reach a stuck "
                           "rank: lab.stop() and start a new cluster", None)
                return
            self.ar.wait(self.poll_s)
        # Data messages travel on another channel than the reply: wait for the outputs to settle.
        with contextlib.suppress(Exception):
            self.ar.wait_for_output(5)
        self._drain()
        try:
            results = self.ar.get()
        except Exception as e:
            gone = lab.missing()
            if gone:
                self._fail("died", f"{_describe(lab, gone)} died during the run at {self._where()}: "
                           f"{_short(e)}; lab.stop() and start a new cluster", e)
            else:
                self._fail("failed", f"the run failed at {self._where()}: {_short(e)}", e)
            return
        self.result = results[0]
        self.status = "stopped" if self.result.get("stopped_early") else "done"
        self._dispatch({"kind": "end", "result": self.result})

    def _where(self) -> str:
        last = next((e for e in reversed(self.events) if e.get("kind") == "step"), None)
        return f"step {last['global_step']}/{last.get('total_steps', '?')}" if last else "the start"

    def _fail(self, status: str, message: str, error) -> None:
        found = _watchdog_lines(self.ar)
        if found:  # what the ranks' watchdogs found out before they ended (the unreachable hosts)
            message += "; the ranks' watchdog: " + found[0].split(WATCHDOG_MARK, 1)[1].strip()
        self.status = status
        self._failure = message
        self.error = error
        self._dispatch({"kind": "error", "status": status, "message": message})

    def __repr__(self) -> str:
        return f"<pilab Run: {self.describe()}>"


class LocalRun(Run):
    """A run in this process, on a thread, for a kernel without engines; the same interface as
    :class:`Run` (``stop``, ``wait``, ``status``, ``events``)::

        run = cluster.LocalRun(cfg, callbacks=[live])
        result = run.wait()
    """

    def __init__(self, cfg, *, callbacks=(), components=()):
        self.lab, self.ar, self.np_ = None, None, 1
        self.callbacks = list(callbacks)
        self.events, self.status, self.result, self.error = [], "running", None, None
        self.stop_requested_at = None
        self.started_at, self.ended_at = time.monotonic(), None
        self._last_event = time.monotonic()
        self._done = threading.Event()
        self._callback_errors = []
        self._flag = StopFlag()
        self.components = list(components)
        self._thread = threading.Thread(target=self._work, args=(cfg,), name="pilab-local-run",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if not self.done and self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            self._flag.set()

    def _work(self, cfg) -> None:
        from ... import engine  # torch, only once a local run starts: importing pilab.lab.cluster stays light

        try:
            self.result = engine.train(cfg, None, callbacks=[self._dispatch], stop=self._flag,
                                       components=self.components)
            self.status = "stopped" if self.result.get("stopped_early") else "done"
        except Exception as e:
            self._fail("failed", f"the run failed: {_short(e)}", e)
        finally:
            self.ended_at = time.monotonic()
            self._done.set()


WATCHDOG_MARK = "pilab: watchdog:"  # = pilab.engine.watchdog.MARK
WATCHDOG_GRACE_S = 20.0  # seconds the ranks' watchdogs get to probe their peers and end


def _watchdog_lines(ar) -> list[str]:
    """The watchdog's reports in the ranks' stderr, rank 0's first."""
    try:
        streams = ar.stderr if ar is not None else []
    except Exception:  # noqa: BLE001 - a broken AsyncResult must not hide the failure it reports
        return []
    streams = streams if isinstance(streams, list) else [streams]
    return [line for text in streams for line in (text or "").splitlines() if WATCHDOG_MARK in line]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _short_path(path: str) -> str:
    """``path`` relative to the working directory where that is shorter (a notebook's one line)."""
    import os

    rel = os.path.relpath(path)
    return rel if len(rel) < len(path) else path


class Engines:
    """A connected set of MPI engines, addressed in rank order (see :func:`start`).

    ``view`` is a blocking DirectView on all engines in rank order and is activated, so ``%px`` and
    ``%%px`` cells run on every rank. ``ranks`` lists ``{"rank", "engine", "host", "pid"}``.
    """

    def __init__(self, client, ipp_cluster=None, *, owned: bool = False, timeout: float = 60,
                 on_stop=None):
        self.client = client
        self.ipp_cluster = ipp_cluster
        self.owned = owned
        # on_stop(cluster_id): told when an owned cluster has stopped (profiles.start keeps the ids of
        # the clusters this process started; passed in, so that this module need not import it)
        self._on_stop = on_stop
        self.log_file: str | None = None  # where cluster.start sent ipyparallel's log
        self._run: Run | None = None
        ids = list(client.ids)
        infos = client[ids].apply_async(whoami).get(timeout=timeout)
        sizes = {i["size"] for i in infos}
        if sizes != {len(ids)} or sorted(i["rank"] for i in infos) != list(range(len(ids))):
            raise ClusterError(
                f"the {len(ids)} engines are not one MPI world (sizes {sorted(sizes)}, ranks "
                f"{sorted(i['rank'] for i in infos)}); start them with engines='mpi' from one mpiexec, "
                "and use the mpiexec of this Python's MPI (see pilab.launch.find_mpiexec)")
        for eid, info in zip(ids, infos):
            info["engine"] = eid
        self.ranks = sorted(infos, key=lambda i: i["rank"])
        self.engine_ids = [i["engine"] for i in self.ranks]  # index = rank
        self.view = client[self.engine_ids]
        self.view.block = True
        if _in_ipython():
            self.view.activate()  # %px / %%px on every rank, outputs in rank order

    # -- facts -------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """Number of engines (= MPI ranks)."""
        return len(self.engine_ids)

    def engine(self, rank: int) -> int:
        """Engine id of an MPI rank."""
        return self.engine_ids[rank]

    def rank_of(self, engine_id: int) -> int:
        """MPI rank of an engine id."""
        return self.engine_ids.index(engine_id)

    def missing(self) -> list[int]:
        """Ranks whose engines are no longer registered (died, killed, or lost heartbeats)."""
        alive = set(self.client.ids)
        return [r for r, eid in enumerate(self.engine_ids) if eid not in alive]

    def check(self) -> None:
        """Raise ClusterError naming the ranks whose engines are gone."""
        gone = self.missing()
        if gone:
            raise ClusterError(f"{_describe(self, gone)} no longer registered (died or lost); "
                               "stop the cluster (lab.stop()) and start a new one")

    # -- using the engines -------------------------------------------------------------------
    def push(self, **names) -> None:
        """Set names in every engine's namespace (``lab.push(cfg=cfg)``, then use ``cfg`` in %%px)."""
        self.check()
        self.view.push(names, block=True)

    def apply(self, fn: Callable, *args, timeout: float | None = 120, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; the results as a list indexed by rank."""
        self.check()
        ar = self.view.apply_async(fn, *args, **kwargs)
        return _wait_ar(self, ar, timeout)

    def train(self, cfg, np_: int | None = None, *, callbacks: Iterable[Callable] = (),
              scatter: bool = False, hang_s: float = 120.0, poll_s: float = 0.2, trace: bool | None = None,
              components=()) -> "Run":
        """Start ``pilab.train(cfg)`` on ranks ``0..np_-1`` (default: all) and return a :class:`Run`
        at once. Rank 0's events are passed to each callback as they arrive, from a watcher thread;
        engines of ranks ``>= np_`` take part only in the communicator split and then idle.
        ``scatter=True``: rank 0 loads the data and sends each rank its shard (no copy on the nodes).
        ``hang_s``: seconds without an event from rank 0 after which the run counts as stuck. ``trace``:
        ``cfg.trace`` set (every rank's step on one time axis, ``pilab.trace.recorder``: ``<out>/trace.json``
        and the result's ``trace``). ``components``: yours (``pilab.Component``), sent to every engine::

            run = lab.train(cfg, np_=1, callbacks=[plots.LivePlot()])
            run.wait()["np"]     # 1
            lab.train(replace(cfg, out="runs/t"), trace=True).wait()["trace"]["path"]   # 'runs/t/trace.json'
        """
        if trace is not None:
            cfg = dataclasses.replace(cfg, trace=bool(trace))
        np_ = self.size if np_ is None else int(np_)
        if not 1 <= np_ <= self.size:
            raise ClusterError(f"np_={np_} must be between 1 and the {self.size} engines")
        if self._run is not None and not self._run.done:
            raise ClusterError("a run is still going on these engines; run.stop() or run.wait() first")
        self.check()
        ar = self.view.apply_async(engine_train, cfg, np_, stream=True, scatter=scatter, hang_s=hang_s,
                                   components=list(components))
        self._run = Run(self, ar, np_, callbacks=callbacks, hang_s=hang_s, poll_s=poll_s)
        return self._run

    def interrupt(self, ranks: Iterable[int] | None = None) -> None:
        """Send SIGINT to engines (default: all). During :func:`stop_flag` it only sets the flag."""
        ranks = range(self.size) if ranks is None else ranks
        targets = [self.engine_ids[r] for r in ranks if self.engine_ids[r] in self.client.ids]
        if targets:
            self.client.send_signal("SIGINT", targets=targets, block=False)

    # -- ending --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the engines and the controller if :func:`start` started them, else just disconnect.
        A run still going is stopped first, every rank after its current step."""
        if self._run is not None and not self._run.done:
            print("stopping the run first: every rank ends after its current step")
            self._run.stop()
            with contextlib.suppress(ClusterError):
                self._run.wait(timeout=60)
            self._run._cluster_stopping = True
        if self.owned and self.ipp_cluster is not None:
            # Ask the engines to exit first: each rank then finalizes MPI and mpiexec ends cleanly,
            # instead of being killed after ipyparallel's TERM timeout.
            with contextlib.suppress(Exception):
                # Not block=True: an engine on a node that dropped off never replies, and its pid
                # wait below is bounded anyway.
                self.client.shutdown(targets=self.client.ids, hub=False, block=False)
                _wait_pids_exit([getattr(es, "pid", None)
                                 for es in self.ipp_cluster.engines.values()], timeout=10)
            with contextlib.suppress(Exception):
                self.client.close()
            self.ipp_cluster.stop_cluster_sync()
            if self._on_stop is not None:
                self._on_stop(self.ipp_cluster.cluster_id)
            where = f" (their log: {_short_path(self.log_file)})" if self.log_file else ""
            print(f"stopped {self.size} engines and their controller{where}")
        else:
            with contextlib.suppress(Exception):
                self.client.close()
            print("disconnected; the engines keep running (started outside pilab)")

    def __enter__(self) -> "Engines":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        head = f"{self.size} MPI engines" + (" (started here)" if self.owned else " (attached)")
        rows = [f"  rank {i['rank']:>2} = engine {i['engine']:>2}  on {i['host']}  pid {i['pid']}"
                for i in self.ranks]
        return "\n".join([head] + rows)


def _wait_pids_exit(pids, timeout: float) -> None:
    """Wait until these local processes (mpiexec) have exited or are zombies, at most ``timeout``."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        if not pid:
            continue
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)


def _in_ipython() -> bool:
    """True in a notebook kernel or IPython shell, where %px / %%px can be activated."""
    try:
        from IPython import get_ipython  # only asked here; plain scripts never need IPython
    except ImportError:
        return False
    return get_ipython() is not None
