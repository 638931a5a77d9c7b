"""Start MPI engines from a notebook, train on them with live metrics, stop them again.

Each ipyparallel engine is one MPI rank, so ``%%px`` cells and :meth:`Engines.train` run collectives
across them. The helper starts and stops a cluster only when asked to::

    from pilab import cluster
    lab = cluster.start(n=2)                   # 2 engines = 2 ranks of one mpiexec (profiles/profile_mpi)
    lab                                        # rank -> engine id, host, pid, in rank order
    run = lab.train(cfg, np_=2, callbacks=[live])   # returns at once; rank 0's events reach `live`
    run.stop()                                 # every rank stops after its current step
    result = run.wait()                        # never hangs: a dead or stuck rank raises ClusterError
    lab.stop()

Or from a shell, then attach: ``ipcluster start --profile-dir profiles/profile_pi`` and
``lab = cluster.connect(profile="pi")``.

Stopping works on busy engines: the client asks each engine's nanny process (ipyparallel's per-engine
helper, reachable while the engine computes) to send SIGINT; while training, the engine's handler only
sets a flag (:func:`stop_flag`), which ``train.run`` polls every step and OR-reduces over the ranks, so
all ranks leave after the same step. A ``%%px`` cell interrupted from the notebook sends the same SIGINT.

The functions below :class:`Run` run on the engines (``%%px`` cells and :meth:`Engines.train` call them).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Callable, Iterable

import numpy as np

__all__ = [
    "ClusterError", "Engines", "Run", "LocalRun", "start", "connect", "find_mpiexec", "profile_dir",
    "hostfile_slots", "lan_address", "whoami", "stop_flag", "StopFlag", "publish", "engine_train",
    "rank_state", "RankTable", "scatter_shards", "load_scattered",
]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ClusterError(RuntimeError):
    """Engines are missing, a rank died or stopped making progress. The message names the ranks."""


# ----------------------------------------------------------------------------------------------
# finding things: mpiexec, profiles, hostfiles, the LAN address
# ----------------------------------------------------------------------------------------------
def find_mpiexec() -> str:
    """Absolute path of the ``mpiexec`` that belongs to this Python's mpi4py.

    ``$PILAB_MPIEXEC`` if set, else the one beside ``sys.executable`` (a venv with pip's MPICH), else
    the first on ``PATH``. A notebook kernel's PATH often lacks the venv's ``bin``, hence this order.
    """
    env = os.environ.get("PILAB_MPIEXEC")
    if env:
        return os.path.abspath(env)
    for name in ("mpiexec", "mpiexec.hydra", "mpirun"):
        beside = os.path.join(os.path.dirname(sys.executable), name)
        if os.access(beside, os.X_OK):
            return beside
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return os.path.abspath(found)
    raise ClusterError("no mpiexec found beside this Python or on PATH; install the MPI extra "
                       "(`pip install 'pilab[mpich]'`) or set PILAB_MPIEXEC=/path/to/mpiexec")


def profile_dir(profile: str = "mpi") -> str:
    """Directory of an ipyparallel profile: a name (``"mpi"``, ``"pi"`` -> ``profiles/profile_<name>``
    in this repository, or under ``$PILAB_PROFILES``) or a path to a profile directory."""
    if os.sep in profile or os.path.isdir(profile):
        return os.path.abspath(profile)
    name = f"profile_{profile}"
    roots = [os.environ.get("PILAB_PROFILES", ""), os.path.join(_REPO, "profiles")]
    # A non-editable install has no repository beside the package: look up from the working
    # directory (a notebook runs in notebooks/, next to profiles/).
    here = os.getcwd()
    while True:
        roots.append(os.path.join(here, "profiles"))
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    for root in roots:
        if root and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    raise ClusterError(f"no ipyparallel profile {name} (looked in $PILAB_PROFILES, {_REPO}/profiles and "
                       "above the working directory); use profile='mpi' or 'pi', or pass the path of a "
                       "profile directory")


def _hostfile_lines(path: str) -> list[tuple[str, int]]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            host, _, slots = line.partition(":")
            out.append((host.strip(), int(slots) if slots.strip() else 1))
    return out


def hostfile_slots(path: str) -> int:
    """Total MPI slots in an MPICH hostfile (``host:slots`` lines, ``#`` comments)::

        hostfile_slots("profiles/profile_pi/hosts.template")   # 48
    """
    lines = _hostfile_lines(path)
    if not lines:
        raise ClusterError(f"hostfile {path} lists no hosts; add lines such as 'pi01:2'")
    return sum(slots for _, slots in lines)


def lan_address(hostfile: str | None = None) -> str:
    """This machine's address on the network the cluster nodes are on.

    The address the kernel would send from to reach the first remote host of ``hostfile`` (a UDP
    ``connect`` sends nothing), else the first non-loopback address of this host; ``127.0.0.1`` if
    there is none (then only engines on this machine can register).
    """
    targets = [h for h, _ in _hostfile_lines(hostfile)] if hostfile and os.path.isfile(hostfile) else []
    for host in targets:
        if host in ("localhost", "127.0.0.1", socket.gethostname()):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                addr = s.getsockname()[0]
            if not addr.startswith("127."):
                return addr
        except OSError:
            continue
    for addr in non_loopback_addresses():
        return addr
    return "127.0.0.1"


def non_loopback_addresses() -> list[str]:
    """IPv4 addresses of this host other than 127.x (from its name, then from its interfaces)."""
    found = []
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(info[4][0])
    except OSError:
        pass
    try:
        import psutil  # an ipyparallel dependency

        for addrs in psutil.net_if_addrs().values():
            found += [a.address for a in addrs if a.family == socket.AF_INET]
    except ImportError:
        pass
    return list(dict.fromkeys(a for a in found if not a.startswith("127.")))


# ----------------------------------------------------------------------------------------------
# the client side: a running set of engines
# ----------------------------------------------------------------------------------------------
def start(n: int | None = None, profile: str = "mpi", *, timeout: float | None = None,
          log_level: int | str = "WARNING") -> "Engines":
    """Start a controller and ``n`` MPI engines (one ``mpiexec -n n``), wait until all registered,
    and map engine ids to MPI ranks. ``n=None`` takes the profile's count (``mpi``: 2; ``pi``: the
    hostfile's slots). Nothing else in pilab starts engines::

        lab = cluster.start(n=4)                   # this machine
        lab = cluster.start(profile="pi")          # 48 ranks from profiles/profile_pi/hosts
    """
    import ipyparallel as ipp

    import logging

    pdir = profile_dir(profile)
    if isinstance(log_level, str):
        log_level = logging.getLevelName(log_level.upper())
    kwargs = dict(engines="mpi", profile_dir=pdir, log_level=log_level)
    if n is not None:
        if n < 1:
            raise ClusterError(f"n={n} must be >= 1 engines")
        kwargs["n"] = int(n)
    _check_profile(pdir)
    ipc = ipp.Cluster(**kwargs)
    if timeout is not None:
        ipc.engine_timeout = int(timeout)
    try:
        client = ipc.start_and_connect_sync()
    except Exception as e:
        output = _launcher_output(ipc)
        with contextlib.suppress(Exception):
            ipc.stop_cluster_sync()
        raise ClusterError(f"the engines did not all register within {ipc.engine_timeout} s "
                           f"({type(e).__name__}: {e}); mpiexec said:\n{output}") from None
    try:
        return Engines(client, ipc, owned=True)
    except Exception:
        with contextlib.suppress(Exception):
            ipc.stop_cluster_sync()
        raise


def connect(profile: str = "mpi", *, cluster_id: str = "", timeout: float = 30) -> "Engines":
    """Attach to engines started elsewhere (``ipcluster start --profile-dir ...``); ``stop()`` on the
    result then only disconnects::

        lab = cluster.connect(profile="pi")
    """
    import ipyparallel as ipp

    pdir = profile_dir(profile)
    if cluster_id:
        client = ipp.Client(profile_dir=pdir, cluster_id=cluster_id, timeout=timeout)
    else:
        client = ipp.Client(profile_dir=pdir, timeout=timeout)
    deadline = time.monotonic() + timeout
    while not client.ids and time.monotonic() < deadline:
        time.sleep(0.2)
    if not client.ids:
        client.close()
        raise ClusterError(f"no engines registered with the controller of {pdir} within {timeout} s")
    return Engines(client, None, owned=False)


def _check_profile(pdir: str) -> None:
    """Load the profile's ipcluster_config.py once here: ipyparallel logs an error in it and goes on
    with defaults (engines on localhost), which would hide e.g. a missing hostfile."""
    from traitlets.config.loader import PyFileConfigLoader

    if os.path.isfile(os.path.join(pdir, "ipcluster_config.py")):
        try:
            PyFileConfigLoader("ipcluster_config.py", path=pdir).load_config()
        except Exception as e:
            raise ClusterError(f"profile {pdir} cannot be used: {e}") from None


def _launcher_output(ipc) -> str:
    lines = []
    for es in (ipc.engines or {}).values():
        with contextlib.suppress(Exception):
            lines.append(es.get_output(remove=False))
    text = "\n".join(x for x in lines if x).strip()
    return text[-3000:] if text else "(nothing)"


class Engines:
    """A connected set of MPI engines, addressed in rank order (see :func:`start`).

    ``view`` is a blocking DirectView on all engines in rank order and is activated, so ``%px`` and
    ``%%px`` cells run on every rank. ``ranks`` lists ``{"rank", "engine", "host", "pid"}``.
    """

    def __init__(self, client, ipp_cluster=None, *, owned: bool = False, timeout: float = 60):
        self.client = client
        self.ipp_cluster = ipp_cluster
        self.owned = owned
        self._run: Run | None = None
        ids = list(client.ids)
        infos = client[ids].apply_async(whoami).get(timeout=timeout)
        sizes = {i["size"] for i in infos}
        if sizes != {len(ids)} or sorted(i["rank"] for i in infos) != list(range(len(ids))):
            raise ClusterError(
                f"the {len(ids)} engines are not one MPI world (sizes {sorted(sizes)}, ranks "
                f"{sorted(i['rank'] for i in infos)}); start them with engines='mpi' from one mpiexec, "
                "and use the mpiexec of this Python's MPI (see find_mpiexec)")
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
              scatter: bool = False, hang_s: float = 120.0, poll_s: float = 0.2) -> "Run":
        """Start ``train.run(cfg)`` on ranks ``0..np_-1`` (default: all) and return a :class:`Run`
        at once. Rank 0's events are passed to each callback as they arrive, from a watcher thread;
        engines of ranks ``>= np_`` take part only in the communicator split and then idle.
        ``scatter=True``: rank 0 loads the data and sends each rank its shard (no copy on the nodes).
        ``hang_s``: seconds without an event from rank 0 after which the run counts as stuck::

            run = lab.train(cfg, np_=1, callbacks=[plots.LivePlot()])
            run.wait()["np"]     # 1
        """
        np_ = self.size if np_ is None else int(np_)
        if not 1 <= np_ <= self.size:
            raise ClusterError(f"np_={np_} must be between 1 and the {self.size} engines")
        if self._run is not None and not self._run.done:
            raise ClusterError("a run is still going on these engines; run.stop() or run.wait() first")
        self.check()
        ar = self.view.apply_async(engine_train, cfg, np_, stream=True, scatter=scatter)
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
                self.client.shutdown(targets=self.client.ids, hub=False, block=True)
                _wait_pids_exit([getattr(es, "pid", None)
                                 for es in self.ipp_cluster.engines.values()], timeout=10)
            with contextlib.suppress(Exception):
                self.client.close()
            self.ipp_cluster.stop_cluster_sync()
            print(f"stopped {self.size} engines and their controller")
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
    import psutil

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
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _describe(lab: Engines, ranks: Iterable[int]) -> str:
    parts = []
    for r in ranks:
        i = lab.ranks[r]
        parts.append(f"rank {r} (engine {i['engine']}, {i['host']} pid {i['pid']})")
    return ", ".join(parts) if parts else "no rank"


def _local_status(lab: Engines, ranks: Iterable[int]) -> str:
    """OS status of engine processes on this host (stopped, zombie, sleeping...), where visible."""
    try:
        import psutil
    except ImportError:
        return ""
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


def _pending_ranks(lab: Engines, ar) -> list[int]:
    """Ranks (positions in a rank-ordered view) whose part of ``ar`` has not come back yet."""
    outstanding = lab.client.outstanding
    return [r for r, m in enumerate(ar.msg_ids) if m in outstanding]


def _failed_ranks(lab: Engines, ar) -> dict[int, BaseException]:
    """Ranks whose part of ``ar`` came back as an error while others may still be running."""
    results = lab.client.results
    out = {}
    for r, m in enumerate(ar.msg_ids):
        value = results.get(m)
        if isinstance(value, BaseException):
            out[r] = value
    return out


def _wait_ar(lab: Engines, ar, timeout: float | None, poll_s: float = 0.2):
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

    def __init__(self, lab: Engines, ar, np_: int, *, callbacks=(), hang_s: float = 120.0,
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
        self._seq = 0
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
    def _rank0_data(self) -> dict:
        data = self.ar.data  # one dict per engine, in the order of the view (= rank order)
        return data[0] if isinstance(data, list) else data

    def _drain(self) -> None:
        data = self._rank0_data()
        while True:
            key = _event_key(self._seq)
            if key not in data:
                return
            self._seq += 1
            self._dispatch(data[key])

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
            if quiet > self.hang_s:
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

    def __init__(self, cfg, *, callbacks=()):
        self.lab, self.ar, self.np_ = None, None, 1
        self.callbacks = list(callbacks)
        self.events, self.status, self.result, self.error = [], "running", None, None
        self.stop_requested_at = None
        self.started_at, self.ended_at = time.monotonic(), None
        self._last_event = time.monotonic()
        self._done = threading.Event()
        self._callback_errors = []
        self._flag = StopFlag()
        self._thread = threading.Thread(target=self._work, args=(cfg,), name="pilab-local-run",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if not self.done and self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            self._flag.set()

    def _work(self, cfg) -> None:
        from . import train

        try:
            self.result = train.run(cfg, None, callbacks=[self._dispatch], stop=self._flag)
            self.status = "stopped" if self.result.get("stopped_early") else "done"
        except Exception as e:
            self._fail("failed", f"the run failed: {_short(e)}", e)
        finally:
            self.ended_at = time.monotonic()
            self._done.set()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def _event_key(seq: int) -> str:
    return f"pilab_event_{seq:09d}"


# ----------------------------------------------------------------------------------------------
# the engine side (called in %%px cells and by Engines.train)
# ----------------------------------------------------------------------------------------------
def whoami() -> dict:
    """This engine's MPI rank, world size, host and pid."""
    from mpi4py import MPI

    return {"rank": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size(),
            "host": socket.gethostname(), "pid": os.getpid()}


class StopFlag:
    """A callable that says whether a stop was requested (``train.run(..., stop=flag)``)."""

    def __init__(self):
        self.requested_at: float | None = None

    def set(self) -> None:
        if self.requested_at is None:
            self.requested_at = time.time()

    def __call__(self) -> bool:
        return self.requested_at is not None


@contextlib.contextmanager
def stop_flag(signals=(signal.SIGINT,)):
    """Turn SIGINT into a stop request for the duration of the block::

        %%px
        with cluster.stop_flag() as stop:
            result = train.run(cfg, MPI.COMM_WORLD, stop=stop)

    Interrupting the notebook kernel during that cell makes ipyparallel send SIGINT to the engines;
    here it sets the flag instead of raising KeyboardInterrupt in the middle of a collective (which
    would leave the other ranks waiting forever). ``train.run`` polls the flag every step and stops
    all ranks together when any rank has it set. Outside the main thread it yields a plain flag.
    """
    flag = StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    old = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def publish(event: dict) -> None:
    """A ``train.run`` callback that sends rank 0's events to the client (ipyparallel datapub), where
    :class:`Run` hands them to the notebook's callbacks. The ``end`` event is not sent: the result
    comes back as the task's return value."""
    if event.get("kind") == "end":
        return
    from ipyparallel.datapub import publish_data

    publish._seq = getattr(publish, "_seq", 0)
    publish_data({_event_key(publish._seq): _plain(event)})
    publish._seq += 1


def _plain(obj):
    """numpy scalars -> Python numbers, so events pickle small and render anywhere."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


# The last run on this engine: %%px cells can look at the trained model (see rank_state).
last: dict = {}


def engine_train(cfg, np_: int | None = None, *, stream: bool = True, scatter: bool = False) -> dict:
    """Train on ranks ``0..np_-1`` of COMM_WORLD; call it on every engine (it splits the world).

    Ranks ``>= np_`` get no communicator and return ``{"rank": r, "idle": True}`` at once. Rank 0 of
    the run publishes events (``stream``) and returns the result; the others return a short summary.
    The model stays in ``cluster.last["model"]`` on each rank of the run::

        lab.view.apply_async(cluster.engine_train, cfg, 2)     # what Engines.train does
    """
    from mpi4py import MPI

    from . import train

    world = MPI.COMM_WORLD
    np_ = world.Get_size() if np_ is None else int(np_)
    if not 1 <= np_ <= world.Get_size():
        raise ValueError(f"np_={np_} must be between 1 and the world size {world.Get_size()}")
    rank = world.Get_rank()
    publish._seq = 0
    with stop_flag() as stop:
        comm = world.Split(0 if rank < np_ else MPI.UNDEFINED, rank)
        if comm == MPI.COMM_NULL:
            return {"rank": rank, "idle": True}
        try:
            callbacks = [publish] if stream and comm.Get_rank() == 0 else []
            data = load_scattered(cfg, comm) if scatter else None
            result, model = train.train(cfg, comm, callbacks=callbacks, stop=stop, data=data)
            last.clear()
            last.update(model=model, cfg=cfg, np=np_, rank=comm.Get_rank(), result=result)
        finally:
            comm.Free()
    if rank == 0:
        return result
    return {"rank": rank, "np": result["np"], "stopped_early": result["stopped_early"]}


class RankTable(list):
    """A list of per-rank dicts (index = rank) that prints as a table."""

    def __repr__(self) -> str:
        if not self:
            return "(no ranks)"
        keys = list(self[0])
        cells = [[_fmt(r.get(k)) for k in keys] for r in self]
        widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
        line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
        return "\n".join([line(keys)] + [line(c) for c in cells])


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(_fmt(x) for x in v) + "]"
    return str(v)


def rank_state(comm, model=None, result: dict | None = None, *, values: int = 3,
               root: int = 0) -> RankTable | None:
    """Gather, in rank order on ``root``, what each rank holds: host, pid, its training shard size
    and the first ``values`` running means of the model's first BatchNorm layer (None elsewhere)::

        %%px
        cluster.rank_state(MPI.COMM_WORLD, model, result)    # shows the table on rank 0 only

    ``model``/``result`` default to this engine's last :func:`engine_train` run.
    """
    import torch

    model = model if model is not None else last.get("model")
    result = result if result is not None else last.get("result")
    rank = comm.Get_rank()
    row = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid()}
    sizes = (result or {}).get("data", {}).get("shard_sizes")
    row["shard_size"] = sizes[rank] if sizes and rank < len(sizes) else None
    bn = next((m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
              if model is not None else None, None)
    row["bn_running_mean"] = bn.running_mean[:values].tolist() if bn is not None else None
    rows = comm.gather(row, root=root)
    return RankTable(rows) if rank == root else None


# ----------------------------------------------------------------------------------------------
# data distribution: rank 0 sends each rank its shard
# ----------------------------------------------------------------------------------------------
def scatter_shards(ds, comm, *, seed: int = 0, root: int = 0):
    """Give every rank its static training shard and its test slice from ``root``'s copy of the data
    set, as raw uint8 buffers (``Scatterv``, no pickling), so the nodes need no copy on disk::

        ds = data.load("embedded") if comm.rank == 0 else None
        local = cluster.scatter_shards(ds, comm, seed=cfg.seed)
        train.run(cfg, comm, data=local)        # sharding="static" only

    The returned data set has the full shapes, but only this rank's rows are filled (the rest stay
    untouched zero pages, which cost no memory); ``data.ShardLoader`` and ``train.evaluate`` read just
    those rows. ``root`` returns ``ds`` itself. Labels (8 bytes an image) are broadcast to all.
    """
    from mpi4py import MPI

    from . import data as data_mod

    rank, size = comm.Get_rank(), comm.Get_size()
    meta = None
    if rank == root:
        meta = {"n_train": len(ds.y_train), "n_test": len(ds.y_test), "classes": tuple(ds.classes),
                "source": ds.source, "checksum": ds.checksum}
    meta = comm.bcast(meta, root=root)
    n_train, n_test = meta["n_train"], meta["n_test"]
    pixel = 32 * 32 * 3

    y_train = ds.y_train if rank == root else np.empty(n_train, dtype=np.int64)
    y_test = ds.y_test if rank == root else np.empty(n_test, dtype=np.int64)
    comm.Bcast([np.ascontiguousarray(y_train, dtype=np.int64), MPI.INT64_T], root=root)
    comm.Bcast([np.ascontiguousarray(y_test, dtype=np.int64), MPI.INT64_T], root=root)

    # Every rank computes the same partition from the labels; only root reads pixels.
    shards = data_mod.static_shards(y_train, size, seed)
    test = [data_mod.test_shard(n_test, size, r) for r in range(size)]
    x_train = np.zeros((n_train, 32, 32, 3), np.uint8) if rank != root else None
    x_test = np.zeros((n_test, 32, 32, 3), np.uint8) if rank != root else None

    counts = [len(s) * pixel for s in shards]
    send = None
    if rank == root:
        send = [np.ascontiguousarray(ds.x_train[np.concatenate(shards)]), counts,
                np.cumsum([0] + counts[:-1]).tolist(), MPI.BYTE]
    recv = np.empty((len(shards[rank]), 32, 32, 3), np.uint8)
    comm.Scatterv(send, [recv, MPI.BYTE], root=root)
    if rank != root:
        x_train[shards[rank]] = recv

    tcounts = [(s.stop - s.start) * pixel for s in test]
    tsend = None
    if rank == root:
        tsend = [np.ascontiguousarray(ds.x_test), tcounts, [s.start * pixel for s in test], MPI.BYTE]
    trecv = np.empty((test[rank].stop - test[rank].start, 32, 32, 3), np.uint8)
    comm.Scatterv(tsend, [trecv, MPI.BYTE], root=root)
    if rank == root:
        return ds
    x_test[test[rank]] = trecv
    return data_mod.CIFAR10(x_train, y_train, x_test, y_test, classes=meta["classes"],
                            source=f"{meta['source']} [shard {rank}/{size} from rank {root}]",
                            checksum=meta["checksum"])


def load_scattered(cfg, comm, *, root: int = 0):
    """Rank ``root`` loads ``cfg``'s data set (with its subsets) and scatters the shards::

        train.run(cfg, comm, data=cluster.load_scattered(cfg, comm))
    """
    from . import data as data_mod
    from .config import ConfigError

    if cfg.sharding != "static":
        raise ConfigError("scattered data needs sharding='static'; 'reshuffle' reads the whole set on "
                          "every rank each epoch: put the data on every node (or a shared directory)")
    ds = None
    if comm.Get_rank() == root:
        ds = data_mod.load(cfg.data, train_subset=cfg.train_subset, test_subset=cfg.test_subset,
                           seed=cfg.seed)
    return scatter_shards(ds, comm, seed=cfg.seed, root=root)
