"""The notebook side: a connected set of MPI engines (:class:`Engines`); the runs on them and their failure
reporting are :mod:`pilab.lab.cluster.runs`' (:class:`Run`; :class:`LocalRun` for a kernel without engines)::

    lab = cluster.start(n=2)                   # see pilab.lab.cluster.profiles
    run = lab.train(cfg, np_=2, callbacks=[live])   # returns at once; rank 0's events reach `live`
    run.stop()                                 # every rank stops after its current step
    result = run.wait()                        # never hangs: a dead or stuck rank raises ClusterError

A watcher thread per run reads rank 0's events (:class:`pilab.lab.cluster.events.EventReader`) and watches the
engines: an unregistered engine is a dead rank, an error from one rank while the others wait in a collective
is a failed run, and no event for ``hang_s`` seconds is a hung one. Each is reported with the ranks, hosts,
pids and (for local engines) their process status.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterable

import psutil  # an ipyparallel dependency

from .errors import ClusterError
from .rank import engine_train, whoami
from .runs import Run, _describe, _short_path, _wait_ar


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
