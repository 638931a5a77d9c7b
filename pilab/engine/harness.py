"""The rank harness: one training run on the ranks of a communicator, guarded against what ends a job
badly (a bad setting on one rank, an exception, a signal, a peer gone off the network)::

    ds = harness.vote(comm, lambda: load_checked(cfg, comm))     # every rank checks; one refusal stops all
    outcome = harness.guarded_run(cfg, comm, data=Handoff(ds), hang_s=120)
    outcome.result, outcome.model, outcome.signum

    mpiexec -n 2 python -m pilab.engine.harness ANSWER.json --config '{"epochs": 1, ...}'   # the study's points

Two ways a rank lives, one function (``where``):

* ``"job"``, a process of an ``mpiexec`` job (``pilab train``, the study's measured points): SIGINT and
  SIGTERM stop every rank after the same step, a second one exits at once; an exception aborts the
  job; the watchdog ends a rank on any verdict; rank 0 keeps what was done in ``<out>/result.json``.
* ``"engine"``, an ipyparallel engine that outlives the run (``pilab.lab.cluster.engine_train``): the
  caller's stop flag is polled; an exception goes back to the client and the engine lives on; the
  watchdog ends a rank only when a peer is unreachable (a stuck one is the client's to report).

Imports torch and MPI inside the functions only: the CLI imports this module to answer ``--help``.

Signals (below): the one place that installs handlers and puts the previous ones back::

    with harness.handled((signal.SIGINT,), lambda signum, frame: flag.set()):
        ...                                        # SIGINT sets the flag here, and only here
    with harness.interruptible(mpi=False) as stop:  # Ctrl-C / SIGTERM: stop after the step
        result = pilab.train(cfg, None, stop=stop)

used by the CLI (a run's Ctrl-C and SIGTERM, a launcher's forwarding), the guarded run above and the
notebook engines' stop flag (``pilab.lab.cluster.stop_flag``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..config import Config, ConfigError

__all__ = ["guarded_run", "Outcome", "prepare", "vote", "Refused", "exit_code", "end_rank", "EXIT_WRITE", "print_stragglers",
           "handled", "exit_code_for", "Interrupt", "interruptible", "sigterm_as_interrupt"]

EXIT_WRITE = 74  # a result or checkpoint could not be written (sysexits' EX_IOERR)
EXIT_REFUSED = 2  # a rank refused the settings (the CLI's exit code for bad input)


class Refused(Exception):
    """A rank's check failed in :func:`vote`; raised on every rank. ``speaks`` is true on the lowest
    failing rank (it says why, the others stay quiet), ``error`` is that rank's exception there."""

    def __init__(self, error: BaseException | None, first: int, speaks: bool):
        super().__init__(str(error) if error is not None else f"rank {first} refused the settings")
        self.error, self.first, self.speaks = error, first, speaks


# What a rank's check may raise for a bad setting (anything else is a bug: it propagates).
def _refusals() -> tuple:
    from ..data import DataError
    return (ConfigError, DataError, ValueError)


def vote(comm, check: Callable[[], Any], refusals: tuple = ()) -> Any:
    """``check()`` on every rank of ``comm``, then one vote: when any rank's check raised a bad-setting
    error (``ConfigError``, ``DataError``, ``ValueError`` or one of ``refusals``), every rank raises
    :class:`Refused` before any collective of the training itself, instead of leaving some ranks
    waiting. Returns this rank's ``check()`` value::

        ds = harness.vote(comm, lambda: engine.load_data(cfg))
    """
    MPI = _mpi()
    error, value = None, None
    try:
        value = check()
    except (*_refusals(), *refusals) as e:
        error = e
    rank, size = comm.Get_rank(), comm.Get_size()
    first = comm.allreduce(rank if error is not None else size, op=MPI.MIN)
    if first < size:
        raise Refused(error, first, speaks=rank == first)
    return value


def prepare(comm, make_cfg: Callable[[], Config], hang_s: float | None, *, also=None, refusals: tuple = ()):
    """Every rank of a job before it trains (``pilab train`` under mpiexec, and :func:`main`): the
    launcher checked, then on every rank the Config (``make_cfg()``), ``also(cfg)`` (the caller's own
    checks), the data set and that it fits the world, the watchdog's seconds (``hang_s``, else
    ``$PILAB_HANG_S``); one :func:`vote`, so a bad setting on any rank raises :class:`Refused` on all.
    Returns (cfg, the data handed over, hang_s, ``also``'s value)::

        cfg, data, hang_s, _ = harness.prepare(comm, lambda: cfg, None)
        harness.guarded_run(cfg, comm, data=data, hang_s=hang_s)
    """
    from ..dist import check_launcher
    from .backend import load_data
    from .loop import Handoff
    from .watchdog import hang_s_from_env
    check_launcher(comm)

    def check():
        cfg = make_cfg()
        extra = also(cfg) if also is not None else None
        ds = load_data(cfg)
        cfg.check_world(comm.Get_size(), len(ds.y_train))
        if cfg.resume and comm.Get_rank() == 0:  # rank 0 reads the checkpoint (as it will to resume)
            from .checkpoint import check_unchanged
            check_unchanged(cfg, ds)
        seconds = hang_s if hang_s is not None else hang_s_from_env()
        if seconds < 0:
            raise ConfigError(f"--hang-s {hang_s} must be >= 0 (0: no watchdog)")
        return cfg, ds, seconds, extra
    cfg, ds, seconds, extra = vote(comm, check, refusals)
    return cfg, Handoff(ds), seconds, extra  # handed over: a rank keeps its shard, not the whole training set


@dataclass
class Outcome:
    """What :func:`guarded_run` returns: the result dict (as in ``result.json``), the trained model and
    the signal that stopped the run (None: no signal did)."""
    result: dict
    model: Any
    signum: int | None = None


def guarded_run(cfg: Config, comm, *, data=None, callbacks=(), hang_s: float = 120.0, where: str = "job",
                stop=None, components=()) -> Outcome:
    """Train ``cfg`` on every rank of ``comm`` under the guards of ``where`` ("job" or "engine", see
    the module docstring); call it on every rank. ``data``: as for ``pilab.train`` (the CLI hands its data
    set over with ``engine.Handoff``). ``stop``: "engine" only, the caller's stop flag (a job installs
    its own signal handlers). ``hang_s``: the watchdog's quiet time (0: no watchdog). ``components``: yours
    (``pilab.Component``), beside the features ``cfg`` asks for::

        with cluster.stop_flag() as stop:
            out = harness.guarded_run(cfg, comm, where="engine", stop=stop, hang_s=120)
    """
    from .loop import fit  # torch: on the ranks only
    from .mpi import MPIRanks
    from .watchdog import Watchdog
    if where == "engine":
        with Watchdog(comm, hang_s, fatal=("unreachable",)) as watchdog:
            result, model = fit(cfg, MPIRanks(comm), callbacks=callbacks, stop=watchdog.polled(stop), data=data,
                                components=components)
        return Outcome(result, model)
    if where != "job":
        raise ValueError(f"where={where!r}: use 'job' or 'engine'")
    if stop is not None:
        raise ValueError("a job installs its own stop flag (SIGINT, SIGTERM); stop= is for engines")
    from ..dist import abort_on_error
    from .records import Keeper, failure_reason
    rank0 = comm.Get_rank() == 0
    # An abort keeps what was done: rank 0 writes result.json (stopped_early, the reason naming the
    # rank and host) when its watchdog ends it, when it fails itself, or when another rank tells it
    # (over the watchdog's side channel) that it failed, before that rank aborts the job.
    keeper, dog = Keeper(), []

    def on_error(e):
        reason = failure_reason(comm.Get_rank(), e)
        if rank0:
            keeper(reason)
        elif dog:
            dog[0].tell(reason)
    # The watchdog ends every rank, naming the unreachable or stuck one, when a collective never
    # completes (a node off the network): MPI over TCP would wait for TCP's timeouts.
    with interruptible(mpi=True, speak=rank0) as flag, abort_on_error(comm, on_error=on_error), \
            Watchdog(comm, hang_s, on_end=keeper, on_peer_failure=keeper) as watchdog:
        dog.append(watchdog)
        flag.on_signal, flag.on_exit = keeper, keeper.cleanup
        result, model = fit(cfg, MPIRanks(comm), callbacks=callbacks, data=data, keeper=keeper,
                            stop=_Polled(watchdog.polled(flag), flag), components=components)
    return Outcome(result, model, flag.signum)


class _Polled:
    """The watchdog's poll, carrying the interrupt's reason into the result (``stop_reason``)."""

    def __init__(self, poll, flag):
        self.poll, self.flag = poll, flag

    def __call__(self) -> bool:
        return self.poll()

    @property
    def reason(self):
        return self.flag.reason


def exit_code(result: dict, signum: int | None = None) -> int:
    """A run's exit status: 0; 74 when a checkpoint or the result could not be written; 128 + the
    signal when stopped by one (130 when another rank's signal or a stop request ended the run)."""
    import signal
    if result.get("write_error"):
        return EXIT_WRITE
    if result.get("stopped_early"):
        return exit_code_for(signum or signal.SIGINT)
    return 0


def print_stragglers(ev) -> None:
    """A callback that prints the straggler monitor's warnings (``pilab.trace.stragglers``) and the start's
    (a SyncBatchNorm group split over hosts: ``loop.split_sync_groups``) on stderr."""
    if ev["kind"] == "straggler":
        print(ev["line"], file=sys.stderr, flush=True)
    for line in ev.get("warnings", ()) if ev["kind"] == "start" else ():
        print(f"pilab: warning: {line}", file=sys.stderr, flush=True)


def _mpi():
    from ..launch import mpi
    return mpi()


def end_rank(code: int):
    """End this rank of a finished run with ``code``: its output flushed, MPI finalized, then ``os._exit``
    -- not the interpreter's own shutdown. That shutdown runs C++ static destructors and stops daemon
    threads by unwinding them (CPython before 3.14), and in a rank that has run torch and MPI it aborted
    now and then ("terminate called without an active exception", exit 6) after the result was written,
    so that the launcher saw a failed rank: one CI run in two lost one job that way. Nothing is left to do
    here: the result and the checkpoints are written and closed, pilab registers no atexit work, and
    MPI_Finalize is what mpi4py's own atexit would have called::

        raise SystemExit(end_rank(main()))     # a rank's entry point, after a normal return
    """
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    MPI = _mpi()
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(code)


# ----------------------------------------------------------------------------------------------
# the job: one guarded run launched by pilab.launch.run_job (the study's measured points)
# ----------------------------------------------------------------------------------------------
def save_components(components, path: str) -> str:
    """Your components pickled into ``path`` for a job's ranks (``--components``), each rank unpickling
    its own copy. A class only this process knows (defined in a notebook or ``__main__``) cannot reach
    them: ConfigError, naming it."""
    import pickle

    for c in components:
        if type(c).__module__ == "__main__":
            raise ConfigError(f"component {type(c).__name__} is defined in this process only, which MPI ranks "
                              "cannot import; put its class in a .py file the ranks can import (or simulate)")
    with open(path, "wb") as f:
        pickle.dump(list(components), f)
    return path


def load_components(path: str) -> list:
    """The components ``save_components`` wrote (the job's own file: its launcher wrote it)."""
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def main(argv=None) -> int:
    """Every rank of ``mpiexec -n N python -m pilab.engine.harness ANSWER.json --config JSON [--hang-s S]
    [--components FILE]``: the run ``pilab train`` makes under mpiexec (the vote, the guards, result.json in
    the config's ``out``), without the CLI; rank 0 writes the result to ANSWER.json as well.
    ``--components``: your components, pickled into FILE by ``save_components`` (a study's points)."""
    p = argparse.ArgumentParser(description="one guarded training run on the ranks of this job")
    p.add_argument("answer", help="where rank 0 writes the result (JSON)")
    p.add_argument("--config", required=True, help="the Config as JSON (its to_dict())")
    p.add_argument("--hang-s", type=float, default=None, help="watchdog (default: $PILAB_HANG_S or 120)")
    p.add_argument("--components", default=None, help="your components, pickled (save_components)")
    a = p.parse_args(argv)
    from ..files import save_json
    comm = _mpi().COMM_WORLD
    try:
        cfg, data, hang_s, _ = prepare(comm, lambda: Config(**json.loads(a.config)), a.hang_s)
    except Refused as e:
        if e.speaks:
            print(f"pilab: error: {e.error}", file=sys.stderr)
        return EXIT_REFUSED
    components = load_components(a.components) if a.components else ()
    out = guarded_run(cfg, comm, data=data, callbacks=[print_stragglers], hang_s=hang_s, components=components)
    if comm.Get_rank() == 0:
        save_json(out.result, a.answer)
    return exit_code(out.result, out.signum)


@contextlib.contextmanager
def handled(signums, handler):
    """``handler(signum, frame)`` for each of ``signums`` during the block; the earlier handlers after
    it (the default one where the earlier was not set from Python). Yields True, or False without
    installing anything outside the main thread (Python lets only the main thread set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old = {s: signal.getsignal(s) for s in signums}
    for s in signums:
        signal.signal(s, handler)
    try:
        yield True
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def exit_code_for(signum: int) -> int:
    """The shell's convention: 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupt:
    """The stop request a signal makes; ``pilab.train(..., stop=flag)`` polls it after every step."""

    def __init__(self):
        self.signum: int | None = None
        self.reason: str | None = None
        # on_signal(reason): at once, on the first signal (rank 0 keeps what was done, engine.Keeper):
        # a launcher that ends the job (a node lost, a batch system's SIGKILL after SIGTERM) may not
        # leave the ranks the step it takes to stop; the full result replaces it when they do stop
        self.on_signal = None
        self.on_exit = None  # before a second signal's os._exit: remove what a cut-short write left

    def __call__(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def interruptible(*, mpi: bool, speak: bool = True):
    """SIGINT (Ctrl-C) and SIGTERM (a batch system's notice) become a stop request: every rank ends
    after the same step and writes what it did. A second signal exits at once: ``KeyboardInterrupt``
    in one process; under mpiexec this rank leaves at once and the launcher ends the others::

        with interruptible(mpi=False) as stop:
            result = pilab.train(cfg, None, stop=stop)
    """
    flag = Interrupt()

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if flag.signum is None:
            flag.signum, flag.reason = signum, f"interrupted by {name}"
            if speak:
                print(f"\npilab: {name}: stopping after the current step and writing what is done "
                      f"({'Ctrl-C' if signum == signal.SIGINT else name} again exits at once)",
                      file=sys.stderr, flush=True)
            if flag.on_signal is not None:
                flag.on_signal(f"{flag.reason} (during a step; the job ended before that step did)")
            return
        if mpi:
            if speak:
                print(f"pilab: {name} again: exiting now", file=sys.stderr, flush=True)
            if flag.on_exit is not None:
                flag.on_exit()
            os._exit(exit_code_for(signum))
        raise KeyboardInterrupt

    with handled((signal.SIGINT, signal.SIGTERM), handler):
        yield flag


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt like Ctrl-C does (for commands that stop by unwinding)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)
    with handled((signal.SIGTERM,), handler):
        yield


if __name__ == "__main__":
    end_rank(main())
