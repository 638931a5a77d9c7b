"""Signals: the one place that installs handlers and puts the previous ones back.

    with signals.handled((signal.SIGINT,), lambda signum, frame: flag.set()):
        ...                                        # SIGINT sets the flag here, and only here
    with signals.interruptible(mpi=False) as stop:  # Ctrl-C / SIGTERM: stop after the step
        result = pilab.train(cfg, None, stop=stop)

Used by the CLI (a run's Ctrl-C and SIGTERM, a launcher's forwarding), the rank harness
(``pilab.engine.harness``) and the notebook engines' stop flag (``pilab.lab.cluster.stop_flag``). No pilab imports.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

__all__ = ["handled", "exit_code_for", "Interrupt", "interruptible", "sigterm_as_interrupt"]


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
